"""Looking at one example and at a run (``disentangle inspect``).

For one example the token report colours each response token by, selectably:

- ``zfree_surprisal``: ``b_t``, the z-free reference's NLL;
- ``token_weight``: ``pi_t`` as configured (source, interpolation), at the configured alpha or the one given;
- ``inverse_token_weight``: ``pi_inv_t`` likewise;
- ``conditioned_nll``: ``l_t``, the decoder's NLL under the posterior latent (argmax code / mean);
- ``gain``: ``b_t - l_t`` (positive where the conditioned decoder beats the z-free reference);
- ``prior_nll``: the prior mixture's per-token NLL (:func:`evaluation.mixture_token_nll`);
- ``latent_gain``: ``prior_nll - conditioned_nll`` (where the posterior latent helps).

The page is self-contained (:func:`report.write_token_report`, no network) with a JSON sidecar
holding the same numbers. The run's plots: training curves, KL and schedules from
``metrics.jsonl``; code usage per slot (discrete) and the code (or k-means cluster) x label heat map
over the inspected data set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .config import DEFAULT_SCORING, Scoring
from .cvae_base import CVAEBase
from .data import Example, collate
from .evaluation import batch_weighting, example_factor_values, latent_assignments, posterior_latents, score_batch
from .features import FeatureCache
from .latent_space import latent_space_of_latents
from .metrics import label_agreement
from .reference import eval_mode
from .report import (
    plot_code_usage,
    plot_contingency_heatmap,
    plot_training_curves,
    read_metrics_jsonl,
    write_token_report,
)

QUANTITIES = (
    "zfree_surprisal",
    "token_weight",
    "inverse_token_weight",
    "conditioned_nll",
    "gain",
    "prior_nll",
    "latent_gain",
)


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token decoded on its own (special tokens kept), so that there is one string per token."""
    return [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]


@torch.no_grad()
def token_values(
    model: CVAEBase,
    tokenizer: Any,
    example: Example,
    alpha: float | None = None,
    scoring: Scoring = DEFAULT_SCORING,
    seed: int = 0,
) -> tuple[list[str], dict[str, list[float]], dict[str, Any]]:
    """``(tokens, values, meta)`` of one example's response tokens (see the module docstring).

    ``values`` maps each of :data:`QUANTITIES` to one number per response token, in order;
    ``meta`` holds the example's text, label, latent and per-token summaries. ``scoring``: the prior
    mixture's samples (default :class:`config.Scoring`; its ``iw_samples`` are not used here).
    """
    scoring = replace(scoring, iw_samples=1)
    device = next(model.parameters()).device
    batch = collate([example], tokenizer.pad_token_id).to(device)
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        features = model.frozen_pass(batch)
        scores = score_batch(model, batch, features, scoring)
    cfg = model.reconstruction_cfg
    alpha = cfg.token_weight_alpha if alpha is None else float(alpha)
    weighting = scores.weighting
    if alpha != cfg.token_weight_alpha:
        weighting = batch_weighting(model, batch, features, scores.posterior_nll, alpha)
    mask = scores.target[0].bool()
    if int(mask.sum()) != len(example.response_ids):
        raise RuntimeError(f"{int(mask.sum())} supervised positions for {len(example.response_ids)} response tokens")
    zfree = scores.zfree_nll[0][mask].double()  # b_t
    conditioned = scores.posterior_nll[0][mask].double()  # l_t
    prior = scores.prior_nll[0][mask].double()  # r_t
    values = {
        "zfree_surprisal": zfree,
        "token_weight": weighting.token_weights[0][mask].double(),
        "inverse_token_weight": weighting.inverse_token_weights[0][mask].double(),
        "conditioned_nll": conditioned,
        "gain": zfree - conditioned,
        "prior_nll": prior,
        "latent_gain": prior - conditioned,
    }
    latent = model.latent_space.example_latent(scores.summary)
    pi = values["token_weight"]
    meta = {
        "source": example.source,
        "label": example.label,
        "prompt": tokenizer.decode(example.prompt_ids, skip_special_tokens=False),
        "response": tokenizer.decode(example.response_ids, skip_special_tokens=False),
        "response_tokens": len(example.response_ids),
        "token_weight_alpha": alpha,
        "token_weight_source": cfg.token_weight_source,
        "token_weight_interpolation": float(cfg.token_weight_interpolation),
        "latent": latent,
        "prior_mixture": {"method": scores.mixture.method, "latents": scores.mixture.size},
        "zfree_nll_per_token": float(zfree.mean()),
        "conditioned_nll_per_token": float(conditioned.mean()),
        "prior_nll_per_token": float(prior.mean()),
        "gain_per_token": float((zfree - conditioned).mean()),
        "token_weighted_gain": float((pi * (zfree - conditioned)).sum()),
        "latent_gain_per_token": float((prior - conditioned).mean()),
        "token_weighted_latent_gain": float((pi * (prior - conditioned)).sum()),
    }
    return token_texts(tokenizer, example.response_ids), {k: v.tolist() for k, v in values.items()}, meta


def write_example_report(
    out_dir: str | Path,
    index: int,
    model: CVAEBase,
    tokenizer: Any,
    example: Example,
    title: str | None = None,
    extra_meta: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Path, Path]:
    """Write ``inspect_<index>.html`` and its ``.json`` sidecar under ``out_dir``."""
    tokens, values, meta = token_values(model, tokenizer, example, **kwargs)
    meta = dict(extra_meta or {}, index=index, **meta)
    title = title or f"Example {index}: {example.source}"
    return write_token_report(Path(out_dir) / f"inspect_{index}.html", tokens, values, title, meta)


def write_run_plots(
    out_dir: str | Path,
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    pad_token_id: int,
    metrics_path: str | Path | None = None,
    seed: int = 0,
) -> list[Path]:
    """Training curves (when ``metrics_path`` exists), code usage (discrete) and the latent x label heat map.

    Code usage and the heat map are computed over ``examples`` (argmax codes; continuous:
    k-means of posterior means with as many clusters as labels). The heat map needs a label on
    every example; one per factor, its x axis named after the factor, its y axis "code", "code
    combination" or "cluster (k-means of posterior means)". Returns the paths written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if metrics_path is not None and Path(metrics_path).is_file():
        written += plot_training_curves(read_metrics_jsonl(metrics_path), out_dir)
    if not examples:
        return written
    latents = posterior_latents(model, examples, cache, pad_token_id)
    usage = latent_space_of_latents(latents).code_usage(latents)  # None: no codes (continuous)
    if usage is not None:
        written.append(plot_code_usage(usage, out_dir / "code_usage.png"))
    factors = example_factor_values(examples) if len(examples) >= 2 else None
    for name, values in (factors or {}).items():  # one heat map per factor; a plain label is the factor "label"
        assignments = latent_assignments(latents, min(len(set(values)), len(examples)), seed=seed)
        agreement = label_agreement(assignments, values)
        file = "code_label_heatmap.png" if name == "label" else f"code_{_safe_name(name)}_heatmap.png"
        written.append(plot_contingency_heatmap(agreement["contingency"], out_dir / file, name, _rows_name(latents)))
    return written


def _rows_name(latents: dict[str, Any]) -> str:
    """What the heat map's rows are: argmax codes, code combinations (several slots) or k-means clusters."""
    return latent_space_of_latents(latents).heatmap_rows(latents)


def _safe_name(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
