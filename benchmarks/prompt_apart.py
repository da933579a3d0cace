"""The between placement's prompt run apart: a training step and the verdict's scoring, against one pass.

    python benchmarks/prompt_apart.py --threads 2 --repeats 3   # the embedded SmolLM2-135M, chatterbot pairs

With ``latent_placement: between`` (``[x][z][y]``) the prompt's keys and values do not depend on ``z``, so
``CVAEBase.decode`` runs the prompt once (a frozen decoder's without gradients, the chat template's shared system
turn once per batch) and each row's ``[z][y]`` from its cache (``cvae_base.SPLIT_PROMPT``). This script times, on
the same batches of the main job's data (``configs/default.yaml``), interleaved, the median of ``--repeats``:

| case | what |
| --- | --- |
| prefix | the default ``[z][x][y]``: one pass, forward and input-gradient backward (a training step's decoder work) |
| between, one pass | ``[x][z][y]`` in one pass (``SPLIT_PROMPT = False``): the same work as the prefix |
| between, prompt apart | ``[x][z][y]``, the prompt apart (``SPLIT_PROMPT = True``) |

each as a training step (batch 8: the CVAE's forward with all its terms, backward, no optimizer) and as the
verdict's scoring of a batch of 16 (``evaluation.score_batch``: the exact prior mixture, a decode per code, K = 8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from disentanglement import cvae_base, trainer  # noqa: E402
from disentanglement.config import resolve_config  # noqa: E402
from disentanglement.data import collate  # noqa: E402
from disentanglement.evaluation import score_batch  # noqa: E402
from disentanglement.features import build_feature_cache  # noqa: E402
from disentanglement.models import build_cvae  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--batches", type=int, default=4, help="batches of each kind, drawn from the data")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = trainer.choose_device(args.device, "--device")
    configs = {
        p: resolve_config(args.config, {"progress": False, "latent_placement": p}) for p in ("prefix", "between")
    }
    decoder, tokenizer = trainer._decoder_and_tokenizer(configs["prefix"], None, device)
    data = trainer.prepare_data(configs["prefix"], tokenizer, None)
    pad = tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(0)
    pick = torch.randperm(len(data.train), generator=generator).tolist()
    steps = [pick[i * 8 : (i + 1) * 8] for i in range(args.batches)]
    scored = [pick[200 + i * 16 : 200 + (i + 1) * 16] for i in range(args.batches)]
    torch.manual_seed(0)
    models = {p: build_cvae(c, decoder).to(device) for p, c in configs.items()}
    examples = [data.train[i] for i in sorted({i for b in steps + scored for i in b})]
    where = {id(e): n for n, e in enumerate(examples)}
    cache = build_feature_cache(models["prefix"], examples, pad, 16, progress=False)

    def batch_of(indices):
        chosen = [data.train[i] for i in indices]
        batch = collate(chosen, pad, indices=[where[id(e)] for e in chosen]).to(device)
        return batch, cache.features(batch, models["prefix"].weighting_params)

    step_batches = [batch_of(b) for b in steps]
    score_batches = [batch_of(b) for b in scored]
    cases = {
        "prefix": ("prefix", True),
        "between, one pass": ("between", False),
        "between, prompt apart": ("between", True),
    }

    def synchronize() -> None:  # CUDA runs asynchronously: a timer reads after the work is done
        if device.type == "cuda":
            torch.cuda.synchronize()

    times: dict[tuple[str, str], list[float]] = {}
    for repeat in range(args.warmup + args.repeats):
        for name, (placement, split) in cases.items():
            model = models[placement]
            cvae_base.SPLIT_PROMPT = split
            model.train()
            synchronize()
            start = time.perf_counter()
            for batch, features in step_batches:
                out = model(batch, features, step=100)
                out.loss.backward()
            model.zero_grad(set_to_none=True)
            synchronize()
            step = (time.perf_counter() - start) / len(step_batches)
            model.eval()
            start = time.perf_counter()
            with torch.no_grad():
                for batch, features in score_batches:
                    score_batch(model, batch, features)
            synchronize()
            score = (time.perf_counter() - start) / len(score_batches)
            if repeat >= args.warmup:
                times.setdefault((name, "step"), []).append(step)
                times.setdefault((name, "score"), []).append(score)
    cvae_base.SPLIT_PROMPT = True
    mean_prompt = statistics.fmean(len(e.prompt_ids) for e in examples)
    mean_response = statistics.fmean(len(e.response_ids) for e in examples)
    print(
        f"{device}, {torch.get_num_threads()} threads, decoder {next(decoder.parameters()).dtype}; mean prompt "
        f"{mean_prompt:.1f} and response {mean_response:.1f} tokens, P = {configs['prefix'].latent.latent_tokens}, "
        f"K = {configs['prefix'].latent.codebook_size}; medians of {args.repeats}"
    )
    print("| case | training step, batch 8 (ms) | scoring a batch of 16 (ms) |")
    print("| --- | ---: | ---: |")
    base = {kind: statistics.median(times[("prefix", kind)]) for kind in ("step", "score")}
    for name in cases:
        cells = []
        for kind in ("step", "score"):
            median = statistics.median(times[(name, kind)])
            cells.append(f"{1000 * median:.0f} ({base[kind] / median:.2f}x)")
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
