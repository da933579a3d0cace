"""The frozen pass with and without its shared prefix: ``reference.reference_hidden_states`` runs the prefix that
every row of a batch shares (a chat template's system turn) once and continues each row from its keys and values.

    python benchmarks/shared_prefix.py --threads 2                    # the main job's 2,306 pairs
    python benchmarks/shared_prefix.py --threads 2 --max-examples 320 # a quick check

Both passes run in this process on the same examples and batches (``features.build_feature_cache``, batches of
16 in length order, as training's), alternately ``--repeats`` times; it prints the seconds of each (the fewest),
the ratio, the positions the decoder computes either way, and how far the two passes' features are apart (the
kernels' rounding: the same computation on fewer positions).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from disentanglement import reference, trainer  # noqa: E402
from disentanglement.config import resolve_config  # noqa: E402
from disentanglement.data import collate  # noqa: E402
from disentanglement.features import (  # noqa: E402
    build_feature_cache,
    frozen_pass_batches,
    shared_prefix_positions,
)
from disentanglement.models import build_cvae  # noqa: E402


def positions(examples, pad_id: int, batch_size: int) -> tuple[int, int]:
    """Decoder positions of the frozen pass's batches: ``(plain, with the shared prefix run once per batch)``."""
    plain = 0
    for chunk in frozen_pass_batches(examples, batch_size):
        plain += collate([examples[i] for i in chunk], pad_id).input_ids.numel()
    return plain, plain - shared_prefix_positions(examples, pad_id, batch_size)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-examples", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {"progress": False, **({"max_examples": args.max_examples} if args.max_examples else {})}
    config = resolve_config(args.config, overrides)
    device = trainer.choose_device(config.train.device, "TrainConfig.device")
    decoder, tokenizer = trainer._decoder_and_tokenizer(config, None, device)
    data = trainer.prepare_data(config, tokenizer, None)
    examples = data.train + data.validation
    model = build_cvae(config, decoder).to(device)
    pad = tokenizer.pad_token_id
    plain_positions, shared_positions = positions(examples, pad, 16)
    default_min = reference.MIN_SHARED_PREFIX
    seconds: dict[str, list[float]] = {"plain": [], "shared prefix": []}
    caches = {}
    for _ in range(args.repeats):
        for name, minimum in (("plain", 10**9), ("shared prefix", default_min)):
            reference.MIN_SHARED_PREFIX = minimum
            start = time.perf_counter()
            caches[name] = build_feature_cache(model, examples, pad, 16, progress=False)
            seconds[name].append(time.perf_counter() - start)
    reference.MIN_SHARED_PREFIX = default_min
    a, b = caches["plain"], caches["shared prefix"]
    nll_a, nll_b = torch.cat(a.response_nll), torch.cat(b.response_nll)
    enc_diff = (a.encoder_features - b.encoder_features).norm(dim=1) / a.encoder_features.norm(dim=1)
    prior_diff = (a.prior_features - b.prior_features).norm(dim=1) / a.prior_features.norm(dim=1)
    best = {name: min(values) for name, values in seconds.items()}
    print(
        f"{len(examples)} examples, {torch.get_num_threads()} threads, decoder {next(decoder.parameters()).dtype}; "
        f"decoder positions {plain_positions} plain, {shared_positions} with the shared prefix "
        f"({shared_positions / plain_positions:.3f})"
    )
    for name, values in seconds.items():
        print(f"  {name:14s} {best[name]:7.1f} s (runs: {', '.join(f'{v:.1f}' for v in values)})")
    print(f"  plain / shared prefix = {best['plain'] / best['shared prefix']:.2f}")
    print(
        f"  z-free NLL b_t: max abs difference {float((nll_a - nll_b).abs().max()):.4f} nats, mean abs "
        f"{float((nll_a - nll_b).abs().mean()):.5f} (mean b_t {float(nll_a.mean()):.3f}); relative L2 of the "
        f"encoder features max {float(enc_diff.max()):.4f}, of the prior features max {float(prior_diff.max()):.4f}"
    )


if __name__ == "__main__":
    main()
