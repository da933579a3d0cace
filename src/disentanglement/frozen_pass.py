"""A training run's frozen pass over its data, and what is computed from it before the first step:
c_base (the z-free reference scale), the k-means sample of the codebook and the term-5 warning."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import distributed
from .checkpoints import CheckpointContents
from .config import RunConfig
from .cvae_base import CVAEBase, FrozenFeatures, WeightingParams
from .data import collate
from .features import FeatureCache, build_feature_cache
from .latent_space import latent_space_of
from .losses import estimate_zfree_reference_scale

if TYPE_CHECKING:
    from .splits import PreparedData

logger = logging.getLogger(__name__)


@dataclass
class FrozenPass:
    """The frozen pass over the data, computed up front when something needs it."""

    full: FeatureCache | None  # train + validation, in that order (None when nothing needed it)
    train: FeatureCache | None  # its training part (c_base, the k-means start and refreshes)
    steps: FeatureCache | None  # what the steps read: the training part with the cache option, else None
    validation: FeatureCache | None  # likewise for validation


def uses_kmeans(config: RunConfig) -> bool:
    """Whether the codebook starts from k-means (a discrete latent with ``codebook_init: kmeans``, of the encoder outputs,
    ``prior_kmeans``, of the prompt features, or ``view_kmeans``, of the view)."""
    return latent_space_of(config.latent.latent).uses_kmeans(config.latent)


def refresh_every(config: RunConfig) -> int:
    """Steps between k-means refreshes of the codebook (0: none)."""
    return config.latent.codebook_refresh_every if config.latent.codebook_init == "kmeans" else 0


def run_frozen_pass(
    config: RunConfig,
    model: CVAEBase,
    data: PreparedData,
    resumed: CheckpointContents | None,
    pad_id: int,
    device: torch.device,
    output_dir: Path,
    state=None,
) -> FrozenPass:
    """The frozen pass over train + validation, when the cache option, c_base or k-means need it.

    With several processes (``state``) it is sharded across them and gathered: each holds all of it.

    The k-means start (fresh runs) and refreshes (first half of training) need the frozen features,
    with or without the cache option, so that a resumed run refreshes exactly as an uninterrupted one.
    Without the cache option, steps and validation run the frozen pass themselves (the pass here is
    then only the one-off pass for c_base and k-means).
    """
    tcfg = config.train
    start_step = resumed.step if resumed is not None else 0
    refreshes_left = refresh_every(config) and start_step < tcfg.max_steps // 2
    needs_kmeans_features = uses_kmeans(config) and (resumed is None or refreshes_left)
    needs_c_base = resumed is None and config.reconstruction.zfree_reference_scale is None
    if not (tcfg.feature_cache or needs_c_base or needs_kmeans_features):
        return FrozenPass(None, None, None, None)
    examples = data.train + data.validation
    progress = tcfg.progress and distributed.is_main(state)
    if tcfg.feature_cache:  # the store shared by every run on the same weights and examples
        from .feature_store import load_or_build_features, store_limit_bytes

        cache = load_or_build_features(
            model,
            examples,
            pad_id,
            tcfg.feature_cache_dir,
            batch_size=max(tcfg.batch_size, 16),
            device=device,
            progress=progress,
            state=state,
            max_bytes=store_limit_bytes(tcfg.feature_cache_max_gb),
        )
    else:
        cache = build_feature_cache(
            model, examples, pad_id, max(tcfg.batch_size, 16), device, progress=progress, state=state
        )
    n_train = len(data.train)
    train_cache = cache.subset(0, n_train)
    if not tcfg.feature_cache:
        return FrozenPass(cache, train_cache, None, None)
    return FrozenPass(cache, train_cache, train_cache, cache.subset(n_train, len(examples)))


def run_c_base(
    config: RunConfig, resumed: CheckpointContents | None, train_cache: FeatureCache | None, n_train: int
) -> float:
    """c_base: the run's (resumed), the configured one, or the mean z-free NLL of the training data."""
    if resumed is not None:
        return float(resumed.trainer_state["zfree_reference_scale"])
    if config.reconstruction.zfree_reference_scale is not None:
        return config.reconstruction.zfree_reference_scale
    c_base = estimate_zfree_reference_scale(train_cache.example_base_losses())
    logger.info("estimated zfree_reference_scale c_base = %.4f nats/token over %d examples", c_base, n_train)
    return c_base


def warn_term5_amplification(config: RunConfig, train_cache: FeatureCache | None, c_base: float) -> None:
    """Warn when term 5 (the inverse-surprisal ablation) weighs single tokens' NLL by 100 or more (median over
    the training examples): it is then ill-conditioned, and a small change at a token the reference is sure
    of can make the loss jump (on ``two-factor`` at alpha 2, median 2,400: one seed of three diverged).
    Measured on the z-free surprisal only: with another ``token_weight_source`` it says nothing."""
    rcfg = config.reconstruction
    if rcfg.normalized_inverse_surprisal_token_weighted_weight <= 0 or train_cache is None:
        return
    if rcfg.token_weight_source != "surprisal" or rcfg.token_weight_alpha == 0:
        return
    params = WeightingParams(
        "surprisal", rcfg.token_weight_alpha, rcfg.token_weight_eps, rcfg.token_weight_interpolation
    )
    amplification = train_cache.inverse_term_amplification(params)
    median = float(amplification.median())
    if median >= 100:
        logger.warning(
            "term 5 (normalized_inverse_surprisal_token_weighted_weight) at token_weight_alpha %g weighs one "
            "token's NLL by a median of %.0f times its plain share over the training examples (max %.0f): a "
            "rise of 0.01 nats there adds %.2g nats to that example's loss (c_base %.2f), so training may "
            "diverge. It is an ablation; a smaller alpha or a larger token_weight_eps tames it.",
            rcfg.token_weight_alpha,
            median,
            float(amplification.max()),
            0.01 * median / c_base,
            c_base,
        )


def kmeans_sample(
    config: RunConfig, data: PreparedData, train_cache: FeatureCache | None, pad_id: int, device: torch.device
) -> FrozenFeatures | None:
    """The frozen features of the first 4096 training examples, which k-means starts and refreshes
    the codebook from (None unless the codebook starts from k-means and the pass was run)."""
    if train_cache is None or not uses_kmeans(config):
        return None
    sample = list(range(min(len(data.train), 4096)))
    return train_cache.features(collate([data.train[i] for i in sample], pad_id, indices=sample).to(device))
