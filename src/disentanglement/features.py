"""The frozen pass, done once per data set (DESIGN.md section 7).

The frozen reference is deterministic per example, so its outputs (z-free per-token NLL of the
response, the prior's and the encoder's features) are computed once and reused by every step;
a training step then costs one decoder forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .cvae_base import CVAEBase, FrozenFeatures
from .data import Batch, Example, collate


@dataclass
class FeatureCache:
    """Per-example frozen-pass outputs, indexed like the example list they were built from."""

    response_nll: list[torch.Tensor]  # per example [n_b]: b_t of each response token
    prior_features: torch.Tensor  # [E, H]
    encoder_features: torch.Tensor  # [E, 2H]

    def __len__(self) -> int:
        return len(self.response_nll)

    def example_base_losses(self) -> torch.Tensor:
        """``b_base`` per example, ``[E]``: the mean z-free NLL over its response tokens."""
        return torch.stack([nll.double().mean() for nll in self.response_nll])

    def features(self, batch: Batch) -> FrozenFeatures:
        """The cached :class:`FrozenFeatures` of a collated batch (``batch.indices`` index the cache)."""
        B, T = batch.input_ids.shape
        device = batch.input_ids.device
        zfree = torch.zeros(B, T - 1, device=device)
        for row, (index, start, length) in enumerate(
            zip(batch.indices.tolist(), batch.prompt_lengths.tolist(), batch.response_lengths.tolist(), strict=True)
        ):
            # Response token k sits at z-free position start + k and is predicted at position start + k - 1.
            zfree[row, start - 1 : start - 1 + length] = self.response_nll[index].to(device)
        idx = batch.indices.cpu()
        return FrozenFeatures(
            zfree_token_nll=zfree,
            prior_features=self.prior_features[idx].to(device),
            encoder_features=self.encoder_features[idx].to(device),
        )


@torch.no_grad()
def build_feature_cache(
    model: CVAEBase,
    examples: Sequence[Example],
    pad_token_id: int,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
    progress: bool = True,
    description: str = "frozen pass",
) -> FeatureCache:
    """Run the frozen pass once over ``examples`` (in length order, to pad little)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].prompt_ids) + len(examples[i].response_ids))
    response_nll: list[torch.Tensor | None] = [None] * len(examples)
    prior: list[torch.Tensor | None] = [None] * len(examples)
    encoder: list[torch.Tensor | None] = [None] * len(examples)
    for start in tqdm(range(0, len(order), batch_size), desc=description, disable=not progress, unit="batch"):
        chunk = order[start : start + batch_size]
        batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
        out = model.frozen_pass(batch)
        for row, index in enumerate(chunk):
            p, r = int(batch.prompt_lengths[row]), int(batch.response_lengths[row])
            response_nll[index] = out.zfree_token_nll[row, p - 1 : p - 1 + r].float().cpu()
            prior[index] = out.prior_features[row].float().cpu()
            encoder[index] = out.encoder_features[row].float().cpu()
    return FeatureCache(response_nll, torch.stack(prior), torch.stack(encoder))  # type: ignore[arg-type]


def batch_features(model: CVAEBase, batch: Batch, cache: FeatureCache | None) -> FrozenFeatures:
    """Cached features when a cache is given, else a fresh frozen pass."""
    return cache.features(batch) if cache is not None else model.frozen_pass(batch)
