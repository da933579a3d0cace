"""Reading the latent off data: posterior codes / means of a trained CVAE over examples."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .continuous_cvae import ContinuousCVAE
from .cvae_base import CVAEBase
from .data import Example, collate
from .features import FeatureCache
from .metrics import kmeans_assignments, label_agreement
from .shared_discrete_cvae import SharedDiscreteCVAE


@torch.no_grad()
def posterior_latents(
    model: CVAEBase, examples: Sequence[Example], cache: FeatureCache, pad_token_id: int, batch_size: int = 32
) -> dict[str, np.ndarray]:
    """Posterior summaries for every example, in order.

    Discrete: ``codes [E, M]`` (argmax) and ``probs [E, M, K]``. Continuous: ``mu [E, D]`` and
    ``logvar [E, D]``. ``cache`` must be indexed like ``examples``.
    """
    device = next(model.parameters()).device
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(examples), batch_size):
        indices = list(range(start, min(start + batch_size, len(examples))))
        batch = collate([examples[i] for i in indices], pad_token_id, indices=indices).to(device)
        features = cache.features(batch)
        if isinstance(model, SharedDiscreteCVAE):
            logits = model.posterior_logits(model.encoder_outputs(features))  # [B, M, K]
            values = {"codes": logits.argmax(-1), "probs": logits.softmax(-1)}
        elif isinstance(model, ContinuousCVAE):
            mu, logvar = model.posterior(features)
            values = {"mu": mu, "logvar": logvar}
        else:
            raise TypeError(f"unknown CVAE type {type(model).__name__}")
        for key, value in values.items():
            parts.setdefault(key, []).append(value.float().cpu() if value.is_floating_point() else value.cpu())
    return {key: torch.cat(chunks).numpy() for key, chunks in parts.items()}


def latent_assignments(model: CVAEBase, latents: dict[str, np.ndarray], num_clusters: int, seed: int = 0) -> np.ndarray:
    """One cluster id per example: the argmax code (single slot) or code tuple id (several slots);
    k-means of posterior means for the continuous model."""
    if "codes" in latents:
        codes = latents["codes"]
        if codes.shape[1] == 1:
            return codes[:, 0]
        _, ids = np.unique(codes, axis=0, return_inverse=True)
        return ids.reshape(-1)
    return kmeans_assignments(latents["mu"], num_clusters, seed=seed)


def label_recovery(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    pad_token_id: int,
    seed: int = 0,
) -> dict:
    """Agreement (NMI, ARI, homogeneity, completeness, contingency) between the latent and the labels."""
    labels = [e.label for e in examples]
    if any(label is None for label in labels):
        raise ValueError("label_recovery needs a label on every example")
    latents = posterior_latents(model, examples, cache, pad_token_id)
    assignments = latent_assignments(model, latents, len(set(labels)), seed=seed)
    return label_agreement(assignments, labels)
