"""Validation during training: the mean of every logged scalar over the first validation batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .config import RunConfig
from .cvae_base import CVAEBase
from .data import Example, collate
from .features import FeatureCache, batch_features
from .reference import eval_mode


def mean_records(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of each key over the records that hold it, keys sorted."""
    keys = {k for r in records for k in r}
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in sorted(keys)}


@torch.no_grad()
def validate(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache | None,
    pad_id: int,
    config: RunConfig,
    step: int,
    device: torch.device,
    processes: int = 1,
) -> dict[str, float]:
    """Mean of every logged scalar over the first ``eval_batches`` validation batches (posterior mean/argmax).

    A batch is the global batch, ``batch_size x processes`` examples. With several processes each of
    them validates the same batches (few: ``eval_batches``), so that all log the same and draw the same
    random numbers, as one process with the global batch does."""
    if not examples:
        return {}
    records = []
    size = config.train.batch_size * processes
    with eval_mode(model):
        for start in range(0, min(len(examples), size * config.train.eval_batches), size):
            indices = list(range(start, min(start + size, len(examples))))
            batch = collate([examples[i] for i in indices], pad_id, indices=indices).to(device)
            records.append(model(batch, features=batch_features(model, batch, cache), step=step).scalars())
    return {f"val_{k}": v for k, v in mean_records(records).items()}
