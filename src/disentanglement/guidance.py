"""Contrastive guidance: generate under a latent, amplifying what it adds over the mixture of the prompt's latents.

Notation: ``R`` generated rows; row ``r`` is generated under latent ``z_r`` and contrasted with its set
``C_r`` of latents, ``z_r`` among them (the codes swept for a slot, or the combinations swept; a prompt's
prior draws; a factor's attribute vectors; a traversal's points); ``V`` vocabulary size.

Every row is decoded under each latent of its set, on its own prefix ``y_<t`` (one stream per latent). The
set's mixture, equally weighted at the start and updated by Bayes' rule on the tokens generated so far, is
the model's marginal given the prefix under a uniform prior over the set (over a slot's codes: the uniform
prior over the codes, not the learnt ``p(k | x)``; over prior draws: a Monte Carlo estimate of the marginal)::

    w_j(t)   ∝ prod_{s < t} p(y_s | x, z_j, y_<s)                  (w_j(0) = 1 / |C_r|)
    m(v)     = sum_j w_j(t) p(v | x, z_j, y_<t)                    the mixture, [V]
    g(v)     = log p(v | x, z_r, y_<t) + gamma * (log p(v | x, z_r, y_<t) - log m(v))

and the next token is drawn from ``softmax(g)`` (greedy: its argmax), restricted to the tokens the row's
own latent finds plausible: ``p(v | z_r) >= plausibility * max_u p(u | z_r)`` (the adaptive plausibility
constraint of contrastive decoding, Li et al. 2023), so the amplified log-ratio never promotes a token
the latent itself finds unlikely. ``log p(v | z_r) - log m(v) = log w_r(t + 1) - log w_r(t)`` when ``v``
is taken: the pointwise information the token carries about the row's latent. ``gamma = 0`` is plain
decoding (no plausibility cut either). Once the prefix has told the set's latents apart (``w_r -> 1``), ``m -> p(. | z_r)`` and the
guidance fades: it acts where the latents disagree and the text has not yet chosen.

This is classifier-free guidance (Ho & Salimans 2022; for language models Sanchez et al. 2023) with the
model's own mixture over its latents as the unconditional model, which the decoder needs no training
for: with a decoder fine-tuned with the latent, the z-free reference is not that mixture (it lacks what
the decoder learnt of the corpus, e.g. a marker's share), the mixture is.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cvae_base import CVAEBase
    from .generation import SamplingOptions


@dataclass(frozen=True)
class Guidance:
    """``scale`` (gamma >= 0; 0: plain decoding) and ``plausibility`` (in (0, 1]) of contrastive guidance."""

    scale: float = 0.0
    plausibility: float = 0.1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise ValueError(f"the guidance scale must be a finite number >= 0, got {self.scale!r}")
        if not 0 < self.plausibility <= 1:
            raise ValueError(f"the guidance plausibility must be in (0, 1], got {self.plausibility!r}")


def guided_scores(
    own_logprobs: torch.Tensor, set_logprobs: torch.Tensor, log_weights: torch.Tensor, guidance: Guidance
) -> torch.Tensor:
    """The guided scores ``g [R, V]`` (``-inf`` outside the plausible tokens) from the row's own latent's
    log-probabilities ``[R, V]``, its set's ``[R, C, V]`` and the set's log-weights ``[R, C]`` (``-inf`` for a
    padded entry of a smaller set; each row's weights sum to one). Scale 0: the own log-probabilities, as they are."""
    if guidance.scale == 0:  # plain decoding, no plausibility cut
        return own_logprobs
    mixture = torch.logsumexp(log_weights.unsqueeze(-1) + set_logprobs, dim=1)  # [R, V]
    scores = own_logprobs + guidance.scale * (own_logprobs - mixture)
    floor = own_logprobs.max(dim=-1, keepdim=True).values + math.log(guidance.plausibility)
    return scores.masked_fill(own_logprobs < floor, -math.inf)


def contrast_sets(keys: Sequence[Hashable]) -> list[list[int]]:
    """Each row's contrast set: the rows (itself among them) whose key equals its key, in row order."""
    members: dict[object, list[int]] = {}
    for r, key in enumerate(keys):
        members.setdefault(key, []).append(r)
    return [members[key] for key in keys]


@torch.no_grad()
def guided_generate(
    model: CVAEBase,
    prompt_ids: Sequence[list[int]],
    latent_sets: Sequence[torch.Tensor],
    own: Sequence[int],
    sampling: SamplingOptions,
    guidance: Guidance,
    eos: set[int],
    pad: int,
) -> torch.Tensor:
    """New token ids ``[R, S]`` (``S <= max_new_tokens``; ``pad`` after a row's end-of-sequence token) of row
    ``r``'s prompt ``prompt_ids[r]`` under latent ``latent_sets[r][own[r]]``, guided against the latents of its
    set ``latent_sets[r]`` (``[C_r, L]``), as the module docstring says. A KV-cached loop over ``sum_r C_r``
    streams (row ``r``'s prefix under each latent of its set), every placement (the memory placement's latent
    in the cache's first ``P`` entries); sampling as ``generate`` does it (temperature, then top-p, no top-k) on
    the guided scores; the n-gram rule (:func:`.generation.ban_repeats`) bans its tokens from the latent's own
    log-probabilities before the plausibility cut. A row that has ended keeps its weights.
    """
    from .generation import ban_repeats, choose_tokens, decode_step, generation_inputs

    R = len(prompt_ids)
    if len(latent_sets) != R or len(own) != R:
        raise ValueError(f"{R} prompts, {len(latent_sets)} latent sets and {len(own)} own indices")
    for r, (latents, k) in enumerate(zip(latent_sets, own, strict=True)):
        if latents.dim() != 2 or not 0 <= k < latents.shape[0]:
            raise ValueError(f"row {r}: its own latent {k} is not one of its set's {tuple(latents.shape)}")
    device = next(model.parameters()).device
    sizes = [latents.shape[0] for latents in latent_sets]
    C = max(sizes)
    # index [R, C]: row r's streams (padded entries point at stream 0 and weigh nothing)
    starts = [sum(sizes[:r]) for r in range(R)]
    index = torch.tensor([[starts[r] + min(j, sizes[r] - 1) for j in range(C)] for r in range(R)], device=device)
    log_weights = torch.tensor(
        [[-math.log(sizes[r]) if j < sizes[r] else -math.inf for j in range(C)] for r in range(R)], device=device
    )
    own_index = torch.tensor(list(own), device=device)
    rows = torch.arange(R, device=device)
    stream_rows = torch.tensor([r for r in range(R) for _ in range(sizes[r])], device=device)

    stream_vectors = torch.cat([latents.to(device) for latents in latent_sets])  # [S, L]
    inputs, mask = generation_inputs(model, [prompt_ids[r] for r in stream_rows.tolist()], stream_vectors, pad)
    latent = model.latent_embeddings(stream_vectors) if model.latent_memory is not None else None
    embed = model.decoder.get_input_embeddings()
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    unfinished = torch.ones(R, dtype=torch.bool, device=device)
    cache = None
    tokens: list[torch.Tensor] = []
    for _ in range(sampling.max_new_tokens):
        logits, cache = decode_step(model, inputs, mask, cache, latent)
        set_logprobs = torch.log_softmax(logits, dim=-1)[index]  # [R, C, V]
        # the n-gram rule before the plausibility cut, so the cut is relative to the best token the rule allows
        # and never leaves a row without one
        own_logprobs = ban_repeats(set_logprobs[rows, own_index], sampling, tokens)
        next_tokens = choose_tokens(guided_scores(own_logprobs, set_logprobs, log_weights, guidance), sampling)
        next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
        tokens.append(next_tokens)
        # Bayes' rule on the token taken: w_j <- w_j p(y_t | z_j), renormalised (padded entries stay -inf)
        taken = set_logprobs.gather(2, next_tokens.view(R, 1, 1).expand(R, C, 1)).squeeze(2)  # [R, C]
        updated = torch.log_softmax(log_weights + taken, dim=1)
        log_weights = torch.where(unfinished.unsqueeze(1), updated, log_weights)
        unfinished &= ~torch.isin(next_tokens, eos_ids)
        if not unfinished.any():
            break
        inputs = torch.cat([inputs, embed(next_tokens[stream_rows]).unsqueeze(1).to(inputs.dtype)], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return torch.stack(tokens, dim=1)
