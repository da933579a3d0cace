"""The main job, timed by phase: ``disentangle train --config configs/default.yaml``, in this process.

    python benchmarks/main_job.py                      # twice: empty caches, then the same caches warm
    python benchmarks/main_job.py --caches empty       # once, model and feature caches empty
    python benchmarks/main_job.py --caches user        # once, with the user's own caches as they are
    python benchmarks/main_job.py --threads 2 --max-steps 3 --max-examples 200   # a quick check

``empty`` uses fresh temporary model and feature cache folders (the embedded GGUF is dequantised again
and the frozen pass runs over every example); ``warm`` runs the job again on the folders the ``empty``
run filled (``both``, the default, does the two in a row: the second run of the same job on the same
data); ``user`` leaves the folders to the config and the environment (``~/.cache/disentanglement``).
Each run goes to its own temporary output folder, deleted afterwards (``--keep`` keeps them).

It times the trainer's own functions, wrapped in place (nothing in the package changes):

| phase | what |
| --- | --- |
| model load | ``trainer._decoder_and_tokenizer``: the decoder and tokenizer; with an empty model cache the GGUF's dequantisation and the safetensors write |
| data | ``trainer.load_pairs`` + ``trainer.prepare_data``: reading and tokenising the pairs, the split |
| weights hash | ``trainer.feature_fingerprint``: the reference's weights hashed (once per loaded model) and the examples |
| frozen pass | ``trainer.run_frozen_pass``: the feature cache read, and the pass over the examples it lacks |
| steps | ``trainer._optimizer_step``: mean, median, first and total |
| validation | ``trainer._validate`` (``eval_every``; ``eval_batches`` batches each) |
| checkpoints | ``trainer._save`` (``save_every`` and the last step) |
| verdict | ``verdict.train_verdict``: what ``disentangle train`` prints after training, ``eval``'s report on the validation split |
| other | the rest of ``train``: the CVAE's construction, c_base, the optimizer, accelerate, the run's files |

and prints one table per run (seconds), then a JSON line per run. Also the frozen pass's padding:
tokens of the sorted, batched examples that are padding, and the LM-head positions it scores beyond the
response tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from disentanglement import feature_store, trainer  # noqa: E402
from disentanglement.config import build_config, read_config_file  # noqa: E402
from disentanglement.verdict import train_verdict  # noqa: E402

PHASES = (
    ("model load", "_decoder_and_tokenizer"),
    ("data", "load_pairs"),
    ("data", "prepare_data"),
    ("weights hash", "feature_fingerprint"),
    ("frozen pass", "run_frozen_pass"),
    ("steps", "_optimizer_step"),
    ("validation", "_validate"),
    ("checkpoints", "_save"),
)
ORDER = (
    "model load",
    "data",
    "weights hash",
    "frozen pass",
    "steps",
    "validation",
    "checkpoints",
    "verdict",
    "other",
    "total",
)


class Timers:
    """Wraps the trainer's functions; records each call's seconds per phase."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.saved: list[tuple[str, object]] = []

    def __enter__(self) -> Timers:
        for phase, name in PHASES:
            original = getattr(trainer, name)
            self.saved.append((name, original))

            def timed(*args, _original=original, _phase=phase, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.calls[_phase].append(time.perf_counter() - start)

            setattr(trainer, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in reversed(self.saved):
            setattr(trainer, name, original)


def padding(examples, batch_size: int) -> dict[str, int]:
    """Tokens and padding of the frozen pass's batches (``features.build_feature_cache``: sorted by length)."""
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in examples]
    prompts = [len(e.prompt_ids) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: lengths[i])
    padded = head = 0
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(lengths[i] for i in batch)
        padded += width * len(batch)
        head += len(batch) * (width - min(prompts[i] for i in batch))  # positions from min(prompt) - 1 on
    return {
        "tokens": sum(lengths),
        "padded_tokens": padded - sum(lengths),
        "response_tokens": sum(len(e.response_ids) for e in examples),
        "head_positions": head,
    }


def run_once(args, label: str, model_cache: str | None, feature_cache: str | None) -> dict:
    values = read_config_file(args.config)
    out = Path(tempfile.mkdtemp(prefix=f"main_job-{label}-"))
    flat = {k: v for section in values.values() for k, v in section.items()} if _nested(values) else dict(values)
    flat.update(output_dir=str(out / "run"), progress=False, device=args.device)
    if model_cache is not None:
        flat["model_cache_dir"] = model_cache
    if feature_cache is not None:
        flat["feature_cache_dir"] = feature_cache
    if args.max_steps is not None:
        flat["max_steps"] = args.max_steps
    if args.max_examples is not None:
        flat["max_examples"] = args.max_examples
    config = build_config(flat)
    examples_seen = {}
    original_prepare = trainer.prepare_data

    def prepare(*a, **k):
        data = original_prepare(*a, **k)
        examples_seen["all"] = data.train + data.validation
        return data

    trainer.prepare_data = prepare
    try:
        with Timers() as timers:
            start = time.perf_counter()
            result = trainer.train(config)
            # What `disentangle train` does next: the verdict on the validation split.
            verdict_start = time.perf_counter()
            train_verdict(result, config)
            timers.calls["verdict"].append(time.perf_counter() - verdict_start)
            total = time.perf_counter() - start
    finally:
        trainer.prepare_data = original_prepare
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    seconds = {phase: sum(timers.calls.get(phase, [])) for phase in ORDER[:-2]}
    seconds["other"] = total - sum(seconds.values())
    seconds["total"] = total
    steps = timers.calls.get("steps", [])
    store = feature_store.last_stats
    return {
        "run": label,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "steps": len(steps),
        "step_mean_s": round(statistics.fmean(steps), 4) if steps else None,
        "step_median_s": round(statistics.median(steps), 4) if steps else None,
        "step_first_s": round(steps[0], 4) if steps else None,
        "validations": len(timers.calls.get("validation", [])),
        "checkpoints": len(timers.calls.get("checkpoints", [])),
        "feature_cache": {"hits": store.hits, "computed": store.computed} if config.train.feature_cache else None,
        "examples": len(examples_seen.get("all", [])),
        "padding": padding(examples_seen.get("all", []), max(config.train.batch_size, 16)),
        "final_step": result.final_step,
        "output": str(out) if args.keep else None,
    }


def _nested(values: dict) -> bool:
    return any(isinstance(v, dict) for v in values.values())


def print_table(runs: list[dict], args) -> None:
    print()
    print(
        f"main job: {args.config}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, device {args.device}"
        + (f", --max-steps {args.max_steps}" if args.max_steps is not None else "")
        + (f", --max-examples {args.max_examples}" if args.max_examples is not None else "")
    )
    header = "| phase | " + " | ".join(r["run"] for r in runs) + " |"
    print(header)
    print("| --- |" + " ---: |" * len(runs))
    for phase in ORDER:
        cells = []
        for r in runs:
            s = r["seconds"][phase]
            if phase == "steps":
                cells.append(f"{s:.1f} ({r['steps']} x {r['step_mean_s']:.3f} mean, {r['step_median_s']:.3f} median)")
            elif phase == "validation":
                cells.append(f"{s:.1f} ({r['validations']} x)")
            elif phase == "checkpoints":
                cells.append(f"{s:.1f} ({r['checkpoints']} x)")
            elif phase == "frozen pass" and r["feature_cache"] is not None:
                fc = r["feature_cache"]
                cells.append(f"{s:.1f} ({fc['computed']} computed, {fc['hits']} from the cache)")
            else:
                cells.append(f"{s:.1f}")
        name = f"**{phase}**" if phase == "total" else phase
        print(f"| {name} | " + " | ".join(cells) + " |")
    pad = runs[0]["padding"]
    print(
        f"frozen pass packing ({runs[0]['examples']} examples, sorted by length, batches of 16): "
        f"{pad['padded_tokens']} padding tokens of {pad['tokens'] + pad['padded_tokens']} "
        f"({100 * pad['padded_tokens'] / max(1, pad['tokens'] + pad['padded_tokens']):.2f}%); LM head at "
        f"{pad['head_positions']} positions for {pad['response_tokens']} response tokens"
    )
    for r in runs:
        print(json.dumps(r))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--caches", choices=("both", "empty", "user"), default="both")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--max-steps", type=int, default=None, help="instead of the config's (a quick check)")
    parser.add_argument("--max-examples", type=int, default=None, help="use only this many pairs (a quick check)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders and the empty-cache folders")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runs = []
    if args.caches == "user":
        runs.append(run_once(args, "user caches", None, None))
    else:
        caches = Path(tempfile.mkdtemp(prefix="main_job-caches-"))
        try:
            model_cache, feature_cache = str(caches / "models"), str(caches / "features")
            runs.append(run_once(args, "empty caches", model_cache, feature_cache))
            if args.caches == "both":
                runs.append(run_once(args, "warm caches (2nd run)", model_cache, feature_cache))
        finally:
            if not args.keep:
                shutil.rmtree(caches, ignore_errors=True)
    print_table(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
