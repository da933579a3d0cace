"""What bf16 decoder weights do to the seed's quantities: ``b_t``, ``c_base``, ``pi_t``, ``kappa`` (and
``pi_inv_t``, ``rho``, the prior's and encoder's features) from a bf16 z-free reference against float32.

Usage::

    python benchmarks/bf16_quantities.py [--examples 300] [--alpha 1 2] [--threads N] [--f32-head]

The embedded SmolLM2-135M (``disentanglement.lm``, float32 weights) and a bf16 copy of the same
weights (what ``dtype: bfloat16`` / ``auto`` on a bf16 CPU loads: the cached float32 weights cast to
bf16), on the first ``--examples`` chatterbot pairs after a seeded shuffle (chat template, default
caps, as the trainer tokenises them). Each reference runs the frozen pass of training
(:func:`features.build_feature_cache`: batches of 16 in length order; the LM head per chunk, the
log-softmax in float32 from the head's logits); the token weights and statistics come from the cache
(:meth:`FeatureCache.response_weighting`, float64 arithmetic from the float32 ``b_t``), ``c_base``
from :func:`losses.estimate_zfree_reference_scale`, as in training.

With ``--f32-head`` a third reference runs the bf16 decoder body with a float32 LM head (the final
hidden states cast to float32, a float32 copy of the head's weights): how much of the difference is
the head's bf16 logits rather than the body.

Differences are bf16 minus float32: the largest absolute one, the mean absolute one, and relative ones
``|d| / |float32 value|`` (largest, and the 99th percentile, since a near-zero ``b_t`` of a token the
model is sure of gives a large relative difference of a tiny number). Features: per example, the
relative L2 difference of the vector. The frozen passes of the references run chunk by chunk of 64
examples, interleaved (the first reference rotating), so that the paired throughput ratio printed at
the end is robust to load from other work on the machine.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from disentanglement.config import ModelConfig, build_config
from disentanglement.cvae_base import CVAEBase, WeightingParams
from disentanglement.data import Example, load_chatterbot, tokenize_pairs
from disentanglement.features import _WEIGHTING_STATISTICS, FeatureCache, build_feature_cache
from disentanglement.lm import load_model_and_tokenizer
from disentanglement.losses import estimate_zfree_reference_scale
from disentanglement.models import build_cvae

CHUNK = 64  # examples per interleaved frozen-pass chunk
BATCH = 16  # the trainer's frozen-pass batch: max(batch_size, 16)


class Float32Head(nn.Module):
    """An LM head that computes in float32 from hidden states of any dtype (``--f32-head``)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.weight = nn.Parameter(head.weight.detach().float().clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


def reference_model(decoder: nn.Module) -> CVAEBase:
    """A frozen-decoder CVAE around ``decoder`` (the latent part plays no role in the frozen pass)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build_cvae(build_config({"preset": "raw"}), decoder).eval()  # the mean view, as measured


def merge(caches: Sequence[FeatureCache]) -> FeatureCache:
    return FeatureCache(
        [n for c in caches for n in c.response_nll],
        torch.cat([c.prior_features for c in caches]),
        torch.cat([c.encoder_features for c in caches]),
    )


def differences(test: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    test, ref = test.double().flatten(), ref.double().flatten()
    d = (test - ref).abs()
    rel = d / ref.abs().clamp_min(1e-12)
    return {
        "n": ref.numel(),
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "max_rel": float(rel.max()),
        "p99_rel": float(torch.quantile(rel, 0.99)) if rel.numel() > 1 else float(rel.max()),
        "ref_mean": float(ref.mean()),
    }


def vector_differences(test: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Per-row relative L2 differences of ``[E, D]`` features."""
    test, ref = test.double(), ref.double()
    rel = (test - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-12)
    return {
        "n": ref.shape[0],
        "max_abs": float((test - ref).abs().max()),
        "mean_abs": float((test - ref).abs().mean()),
        "max_rel": float(rel.max()),
        "p99_rel": float(torch.quantile(rel, 0.99)),
        "ref_mean": float(ref.norm(dim=1).mean()),
    }


def quantities(cache: FeatureCache, alphas: Sequence[float], eps: float) -> dict[str, torch.Tensor]:
    out = {
        "b_t": torch.cat(cache.response_nll),
        "c_base": torch.tensor([estimate_zfree_reference_scale(cache.example_base_losses())]),
    }
    for alpha in alphas:
        tokens, stats = cache.response_weighting(WeightingParams("surprisal", float(alpha), eps, 1.0))
        tag = f"a={alpha:g}"
        out[f"pi_t ({tag})"] = tokens[:, 1]
        out[f"pi_inv_t ({tag})"] = tokens[:, 2]
        out[f"kappa ({tag})"] = stats[:, _WEIGHTING_STATISTICS.index("token_concentration_factor")]
        out[f"rho ({tag})"] = stats[:, _WEIGHTING_STATISTICS.index("inverse_token_base_scale_factor")]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--alpha", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--f32-head", action="store_true", help="also a bf16 body with a float32 LM head")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    decoder32, tokenizer = load_model_and_tokenizer(ModelConfig(dtype="float32"))
    pairs = load_chatterbot()
    random.Random(0).shuffle(pairs)
    examples: list[Example] = tokenize_pairs(pairs[: args.examples], tokenizer, build_config().data)[0]
    pad = tokenizer.pad_token_id
    decoder16 = copy.deepcopy(decoder32).to(torch.bfloat16)
    models = {"float32": reference_model(decoder32), "bfloat16": reference_model(decoder16)}
    if args.f32_head:
        body = copy.deepcopy(decoder16)
        head = Float32Head(decoder32.get_output_embeddings())
        body.get_output_embeddings = lambda: head  # the frozen pass runs the head through this accessor
        models["bf16 body, f32 head"] = reference_model(body)
    names = list(models)

    one, five, _ = os.getloadavg()
    tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    print(
        f"SmolLM2-135M (embedded), {len(examples)} chatterbot examples ({tokens} tokens, "
        f"{sum(len(e.response_ids) for e in examples)} response tokens), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {one:.1f} / {five:.1f} on {os.cpu_count()} cores"
    )
    parts: dict[str, list[FeatureCache]] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for k, first in enumerate(range(0, len(examples), CHUNK)):
        chunk = examples[first : first + CHUNK]
        shift = k % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            parts[name].append(build_feature_cache(models[name], chunk, pad, batch_size=BATCH, progress=False))
            seconds[name].append(time.perf_counter() - start)
    caches = {name: merge(parts[name]) for name in names}
    eps = build_config().reconstruction.token_weight_eps
    values = {name: quantities(caches[name], args.alpha, eps) for name in names}

    for name in names[1:]:
        print(f"\n{name} against float32 (differences = {name} - float32)")
        header = "| quantity | n | float32 mean | max abs | mean abs | max rel | 99th pct rel |"
        print(header)
        print("| --- | --- | --- | --- | --- | --- | --- |")
        rows = [(key, differences(values[name][key], values["float32"][key])) for key in values["float32"]]
        rows.append(
            (
                "prior features (rel. L2)",
                vector_differences(caches[name].prior_features, caches["float32"].prior_features),
            )
        )
        rows.append(
            (
                "encoder features (rel. L2)",
                vector_differences(caches[name].encoder_features, caches["float32"].encoder_features),
            )
        )
        for key, d in rows:
            print(
                f"| {key} | {d['n']} | {d['ref_mean']:.4g} | {d['max_abs']:.3g} | {d['mean_abs']:.3g} | "
                f"{d['max_rel']:.3g} | {d['p99_rel']:.3g} |"
            )
        b32, b16 = values["float32"]["b_t"], values[name]["b_t"]
        print(f"c_base: float32 {float(values['float32']['c_base']):.5f}, {name} {float(values[name]['c_base']):.5f}")
        print(f"b_t rank correlation (Pearson of ranks): {_rank_correlation(b16, b32):.5f}")

    print("\nfrozen pass (batches of 16, length order, chunks of 64 examples interleaved):")
    for name in names:
        total = sum(seconds[name])
        print(f"  {name:<22} {total:7.1f} s  {tokens / total:8.0f} tokens/s")
    for name in names[1:]:
        paired = statistics.median(a / b for a, b in zip(seconds["float32"], seconds[name], strict=True))
        print(
            f"  float32 / {name}: {sum(seconds['float32']) / sum(seconds[name]):.2f} (paired median over chunks {paired:.2f})"
        )


def _rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


if __name__ == "__main__":
    main()
