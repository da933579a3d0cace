"""The six-term reconstruction loss stack (docs/design.md section 4), as pure functions over tensors.

Notation: ``B`` examples, conditioned length ``T``, vocabulary ``V``. ``token_nll`` is the
conditioned per-token NLL ``l_t`` of the decoder, ``[B, T-1]``, zero where ``m_t = 0``.
``target_mask`` is ``m_t``, ``[B, T-1]`` (1 on supervised response positions), unless a
function says it takes the ``[B, T]`` token mask. Every term returns a scalar batch mean.

Two stages, as in the seed notes: compute the masked per-token NLL once
(:func:`masked_token_nll_per_position`), then aggregate it with uniform weights
(:func:`uniform_token_weights`) or with the reference's token weights
(:func:`token_weighted_masked_nll_per_example`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar, overload

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ReconstructionLossConfig

if TYPE_CHECKING:
    from .token_weighting import TokenWeighting

_Block = TypeVar("_Block")

# The six terms, in docs/design.md order, with the config field that weights each.
TERM_WEIGHT_FIELDS: dict[str, str] = {
    "reconstruction_loss": "reconstruction_weight",
    "sequence_reconstruction_loss": "sequence_reconstruction_weight",
    "token_weighted_reconstruction_loss": "token_weighted_weight",
    "normalized_concentration_corrected_token_weighted_reconstruction_loss": (
        "normalized_concentration_corrected_token_weighted_weight"
    ),
    "normalized_inverse_surprisal_token_weighted_reconstruction_loss": (
        "normalized_inverse_surprisal_token_weighted_weight"
    ),
    "zfree_relative_reconstruction_loss": "zfree_relative_weight",
}
TERMS_NEEDING_WEIGHTING = frozenset(
    {
        "token_weighted_reconstruction_loss",
        "normalized_concentration_corrected_token_weighted_reconstruction_loss",
        "normalized_inverse_surprisal_token_weighted_reconstruction_loss",
    }
)
TERMS_NEEDING_SCALE = frozenset(
    {
        "normalized_concentration_corrected_token_weighted_reconstruction_loss",
        "normalized_inverse_surprisal_token_weighted_reconstruction_loss",
        "zfree_relative_reconstruction_loss",
    }
)


def _check_shifted_shapes(logits: torch.Tensor, input_ids: torch.Tensor, target_mask: torch.Tensor) -> int:
    """``T`` of ``input_ids`` ``[B, T]``; ``logits`` (``[B, T, ...]``) and ``target_mask`` must share its ``[B, T]``."""
    bsz, seq = input_ids.shape
    if logits.shape[:2] != (bsz, seq) or target_mask.shape != (bsz, seq):
        raise ValueError(
            f"logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)} and target_mask "
            f"{tuple(target_mask.shape)} must agree on [B, T]"
        )
    return seq


def apply_head(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` for ``[B, c, H]`` states, as one ``[B c, H] x [H, V]`` matmul: ``[B, c, V]``.

    A chunk of positions of a ``[B, T, H]`` window is a strided view, and a linear layer on a strided
    3-D input runs as a batched matmul against the weight expanded over the batch (for bf16 weights on
    the CPU a copy of the whole ``[V, H]`` weight per example, which made the head several times slower
    than the decoder's body); the rows are made contiguous first (``B c H`` elements), so it is one matmul.
    """
    out = head(hidden.reshape(-1, hidden.shape[-1]))  # [B c, V]
    return out.view(*hidden.shape[:-1], out.shape[-1])  # (an explicit V: a chunk may have no positions)


def _over_chunks(
    block: Callable[[torch.Tensor, torch.Tensor], _Block],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None,
) -> list[_Block]:
    """``block`` on consecutive chunks of ``chunk_size`` positions of ``inputs`` ``[B, N, ...]`` and ``targets``
    ``[B, N]`` (one chunk when ``chunk_size`` is ``None``, 0 or at least ``N``), one result per chunk.

    With gradients enabled each chunk runs under activation checkpointing, so only one chunk's
    ``[B, chunk, V]`` block exists at a time in the backward pass too; under ``no_grad`` nothing is
    saved for backward and chunks need no checkpointing.
    """
    step = max(1, chunk_size or inputs.shape[1])
    run = (lambda f, *a: checkpoint(f, *a, use_reentrant=False)) if torch.is_grad_enabled() else (lambda f, *a: f(*a))
    return [run(block, inputs[:, i : i + step], targets[:, i : i + step]) for i in range(0, inputs.shape[1], step)]


@overload
def masked_token_nll_per_position(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    target_mask: torch.Tensor,
    chunk_size: int | None = None,
    *,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    entropy: Literal[False] = False,
) -> torch.Tensor: ...
@overload
def masked_token_nll_per_position(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    target_mask: torch.Tensor,
    chunk_size: int | None = None,
    *,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...
def masked_token_nll_per_position(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    target_mask: torch.Tensor,
    chunk_size: int | None = None,
    *,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Masked per-token NLL ``[B, T-1]`` from logits ``[B, T, V]`` and ids/mask ``[B, T]``: the one NLL kernel.

    ``out[b, t] = -log softmax(logits[b, t])[input_ids[b, t+1]] * target_mask[b, t+1]``.
    ``target_mask`` here is the ``[B, T]`` token mask (1 on response tokens). Half-precision scores
    are upcast to float32 before the log-softmax, whatever the model's dtype.

    ``logits`` is ``[B, T, V]``, or, when ``head`` is given, the hidden states ``[B, T, H]`` that
    ``head`` (the LM head) turns into logits. With ``chunk_size`` the positions are processed in
    chunks under activation checkpointing, so the peak extra memory is one ``[B, chunk, V]`` block
    in the forward and the backward pass: with ``head`` the full ``[B, T, V]`` logits never exist.
    Without chunking it is one ``F.cross_entropy`` call on a view of ``logits``, which materialises
    nothing beyond what ``cross_entropy`` itself needs.

    With ``entropy=True`` (no-grad) it returns ``(nll, entropy)``, ``[B, T-1]`` each, from one log-softmax
    per chunk: ``nll`` as above, in float32 whatever the input dtype (float64 too), and
    ``entropy[b, t] = H(softmax(logits[b, t])) * target_mask[b, t+1]``, the entropy (nats) of the
    distribution that predicts token ``t + 1``, whatever that token is.
    """
    seq = _check_shifted_shapes(logits, input_ids, target_mask)
    supervised = target_mask[:, 1:].to(torch.bool)  # [B, T-1]
    inputs = logits[:, :-1]  # [B, T-1, V or H], a view

    def scores_of(x: torch.Tensor) -> torch.Tensor:
        return apply_head(head, x) if head is not None else x  # [B, c, V]

    if entropy:
        with torch.no_grad():
            targets = input_ids[:, 1:].masked_fill(~supervised, 0)  # [B, T-1], any valid id where unsupervised

            def block_nll_entropy(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                log_p = F.log_softmax(scores_of(x).float(), dim=-1)  # [B, c, V]
                nll = -log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
                # p log p with p = 0 is 0: a -inf logit (a token ruled out) must not give 0 * -inf = NaN.
                return nll, -(log_p.exp() * log_p.clamp_min(torch.finfo(log_p.dtype).min)).sum(-1)

            blocks = _over_chunks(block_nll_entropy, inputs, targets, chunk_size)
            if not blocks:  # T = 1: no position predicts anything
                empty = inputs.new_zeros(inputs.shape[0], 0, dtype=torch.float32)
                return empty, empty
            nll, ent = (torch.cat(parts, dim=1) for parts in zip(*blocks, strict=True))
            return torch.where(supervised, nll, 0.0), torch.where(supervised, ent, 0.0)

    targets = input_ids[:, 1:].masked_fill(~supervised, -100)  # [B, T-1]

    def block_nll(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scores = scores_of(x)  # [B, c, V]
        if scores.dtype in (torch.float16, torch.bfloat16):
            scores = scores.float()  # log-softmax in at least float32, whatever the model's dtype
        if scores.is_contiguous():  # vocabulary-last cross-entropy is the fast kernel; reshape is a view here
            nll = F.cross_entropy(
                scores.reshape(-1, scores.shape[-1]), y.reshape(-1), reduction="none", ignore_index=-100
            )
            return nll.view(y.shape)
        return F.cross_entropy(scores.transpose(1, 2), y, reduction="none", ignore_index=-100)  # no copy

    if not chunk_size or chunk_size >= seq - 1:
        if head is None and logits.is_contiguous():
            # All T positions as one contiguous view; the last predicts nothing (target -100).
            padded = F.pad(targets, (0, 1), value=-100)  # [B, T]
            return block_nll(logits, padded)[:, :-1]
        return block_nll(inputs, targets)
    return torch.cat(_over_chunks(block_nll, inputs, targets, chunk_size), dim=1)


def default_chunk_size(batch_size: int, vocab_size: int, budget_elements: int = 1 << 24) -> int:
    """Positions per chunk so that one ``[B, chunk, V]`` float32 block stays near 64 MiB."""
    return max(1, budget_elements // max(1, batch_size * vocab_size))


def uniform_token_weights(target_mask: torch.Tensor) -> torch.Tensor:
    """``m_t / n_b``, ``[B, N]``. An example with ``n_b = 0`` is an error."""
    mask = target_mask.to(torch.float32 if not target_mask.is_floating_point() else target_mask.dtype)
    n = mask.sum(dim=1, keepdim=True)  # [B, 1]
    if (n == 0).any():
        empty = (n.squeeze(1) == 0).nonzero().flatten().tolist()
        raise ValueError(f"target_mask: examples {empty} have no supervised token (n_b = 0)")
    return mask / n


def token_weighted_masked_nll_per_example(token_nll: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
    """``sum_t w_t l_t`` per example, ``[B]``, for token NLL and weights of one ``[B, N]`` shape."""
    if token_nll.shape != token_weights.shape:
        raise ValueError(f"token_nll {tuple(token_nll.shape)} and token_weights {tuple(token_weights.shape)} differ")
    return (token_weights.to(token_nll.dtype) * token_nll).sum(dim=1)


def _check_scale(zfree_reference_scale: float | None, term: str) -> float:
    if zfree_reference_scale is None:
        raise ValueError(
            f"{term} needs zfree_reference_scale (c_base): set it in the config or estimate it "
            "with estimate_zfree_reference_scale before training"
        )
    scale = float(zfree_reference_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"zfree_reference_scale must be finite and > 0, got {zfree_reference_scale}")
    return scale


def reconstruction_loss(token_nll: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Term 1: ``mean_b (1/n_b) sum_t m_t l_t``."""
    weights = uniform_token_weights(target_mask.to(token_nll.dtype))
    return token_weighted_masked_nll_per_example(token_nll, weights).mean()


def sequence_reconstruction_loss(token_nll: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Term 2: ``mean_b sum_t m_t l_t`` (the ELBO's own reconstruction term)."""
    return (token_nll * target_mask.to(token_nll.dtype)).sum(dim=1).mean()


def token_weighted_reconstruction_loss(token_nll: torch.Tensor, weighting: TokenWeighting) -> torch.Tensor:
    """Term 3: ``mean_b sum_t pi_t l_t``."""
    return token_weighted_masked_nll_per_example(token_nll, weighting.token_weights).mean()


def normalized_concentration_corrected_token_weighted_reconstruction_loss(
    token_nll: torch.Tensor, weighting: TokenWeighting, zfree_reference_scale: float | None
) -> torch.Tensor:
    """Term 4: ``(1/c_base) mean_b (sum_t pi_t l_t) / kappa_b``."""
    scale = _check_scale(zfree_reference_scale, "normalized_concentration_corrected_token_weighted_reconstruction_loss")
    per_example = token_weighted_masked_nll_per_example(token_nll, weighting.token_weights)  # [B]
    return (per_example / weighting.token_concentration_factor.to(per_example.dtype)).mean() / scale


def normalized_inverse_surprisal_token_weighted_reconstruction_loss(
    token_nll: torch.Tensor, weighting: TokenWeighting, zfree_reference_scale: float | None
) -> torch.Tensor:
    """Term 5 (ablation): ``(1/c_base) mean_b (sum_t pi_inv_t l_t) / rho_b``."""
    scale = _check_scale(zfree_reference_scale, "normalized_inverse_surprisal_token_weighted_reconstruction_loss")
    per_example = token_weighted_masked_nll_per_example(token_nll, weighting.inverse_token_weights)  # [B]
    return (per_example / weighting.inverse_token_base_scale_factor.to(per_example.dtype)).mean() / scale


def zfree_relative_reconstruction_loss(
    token_nll: torch.Tensor, target_mask: torch.Tensor, zfree_reference_scale: float | None
) -> torch.Tensor:
    """Term 6: ``(1/c_base) mean_b (1/n_b) sum_t m_t l_t`` (empirical z-free-relative rescaling)."""
    scale = _check_scale(zfree_reference_scale, "zfree_relative_reconstruction_loss")
    return reconstruction_loss(token_nll, target_mask) / scale


@dataclass
class ReconstructionLossStack:
    """Every computed term (``terms``, scalars by docs/design.md name) and their weighted sum."""

    terms: dict[str, torch.Tensor]
    total: torch.Tensor


def term_weights(config: ReconstructionLossConfig) -> dict[str, float]:
    """The configured weight of each of the six terms, by term name."""
    return {term: float(getattr(config, field)) for term, field in TERM_WEIGHT_FIELDS.items()}


def term_coefficients(
    target_mask: torch.Tensor,
    weighting: TokenWeighting | None,
    zfree_reference_scale: float | None,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Every term is a fixed (detached) linear functional of ``l``: ``term_k = sum_{b,t} C_k[b, t] l[b, t]``.

    Returns ``C_k`` (``[B, N]``, in ``dtype``) for the terms computable from what is given, read off
    the definitions above (docs/design.md section 4):

        C_1 = m_t / (n_b B)            C_4 = pi_t / (kappa_b B c_base)
        C_2 = m_t / B                  C_5 = pi_inv_t / (rho_b B c_base)
        C_3 = pi_t / B                 C_6 = m_t / (n_b B c_base)
    """
    B = target_mask.shape[0]
    mask = target_mask.to(dtype)
    uniform = uniform_token_weights(mask) / B
    coefficients = {
        "reconstruction_loss": uniform,
        "sequence_reconstruction_loss": mask / B,
    }
    if weighting is not None:
        pi = weighting.token_weights.to(dtype)
        coefficients["token_weighted_reconstruction_loss"] = pi / B
        if zfree_reference_scale is not None:
            kappa = weighting.token_concentration_factor.to(dtype).unsqueeze(1)  # [B, 1]
            rho = weighting.inverse_token_base_scale_factor.to(dtype).unsqueeze(1)  # [B, 1]
            pi_inv = weighting.inverse_token_weights.to(dtype)
            coefficients["normalized_concentration_corrected_token_weighted_reconstruction_loss"] = pi / (
                kappa * (B * zfree_reference_scale)
            )
            coefficients["normalized_inverse_surprisal_token_weighted_reconstruction_loss"] = pi_inv / (
                rho * (B * zfree_reference_scale)
            )
    if zfree_reference_scale is not None:
        coefficients["zfree_relative_reconstruction_loss"] = uniform / zfree_reference_scale
    return coefficients


def reconstruction_loss_stack(
    token_nll: torch.Tensor,
    target_mask: torch.Tensor,
    weighting: TokenWeighting | None,
    config: ReconstructionLossConfig,
    zfree_reference_scale: float | None = None,
) -> ReconstructionLossStack:
    """All six terms (those computable from what is given) and ``sum_k weight_k * term_k``.

    ``token_nll`` and ``target_mask`` are ``[B, N]``. ``weighting`` may be ``None`` only when
    every term that needs it has weight 0; those terms are then absent from ``terms``. Terms
    that need ``c_base`` use ``zfree_reference_scale``, else ``config.zfree_reference_scale``;
    an enabled term without either is an error. A disabled scaled term is still logged when
    a scale is available.

    The terms and the total are products of their coefficient matrices (:func:`term_coefficients`)
    with ``l``: a few operations however many terms are logged, and the backward pass is one product.
    The term functions above are the reference definitions; the tests check that both agree.
    """
    scale = zfree_reference_scale if zfree_reference_scale is not None else config.zfree_reference_scale
    weights = term_weights(config)
    missing = [t for t in TERMS_NEEDING_WEIGHTING if weights[t] != 0 and weighting is None]
    if missing:
        raise ValueError(f"terms {sorted(missing)} have non-zero weight but no token weighting was given")
    for term in TERMS_NEEDING_SCALE:
        if weights[term] != 0:
            _check_scale(scale, term)
    if scale is not None:
        scale = _check_scale(scale, "zfree_reference_scale")

    with torch.no_grad():
        coefficients = term_coefficients(target_mask, weighting, scale, token_nll.dtype)
        names = list(coefficients)
        C = torch.stack([coefficients[name] for name in names]).flatten(1)  # [K, B * N]
        # The objective's own row: sum_k weight_k C_k over the enabled terms only. A disabled term may
        # overflow (the ill-conditioned term 5): it must reach neither the total nor its gradient.
        enabled = [k for k, name in enumerate(names) if weights[name] != 0]
        w = torch.tensor([weights[names[k]] for k in enabled], dtype=C.dtype, device=C.device)
        objective = (w.unsqueeze(1) * C[enabled]).sum(0)  # [B * N]
    # Elementwise products and sums, not matmul: autocast would run a matmul in bf16/fp16.
    flat_nll = token_nll.reshape(-1)
    values = (C * flat_nll).sum(1)  # [K], every term (logged; its graph is used only if someone differentiates it)
    total = (objective * flat_nll).sum()
    return ReconstructionLossStack(terms=dict(zip(names, values.unbind(), strict=True)), total=total)


def estimate_zfree_reference_scale(example_base_losses: torch.Tensor | Iterable[float]) -> float:
    """``c_base``: the mean of the per-example z-free base losses ``b_base,b``."""
    values = torch.as_tensor(
        example_base_losses if isinstance(example_base_losses, torch.Tensor) else list(example_base_losses),
        dtype=torch.float64,
    ).flatten()
    if values.numel() == 0:
        raise ValueError("estimate_zfree_reference_scale needs at least one example base loss, got none")
    if not torch.isfinite(values).all():
        raise ValueError("estimate_zfree_reference_scale: example base losses must be finite")
    scale = float(values.mean())
    if not scale > 0:
        raise ValueError(f"estimated zfree_reference_scale is {scale}; it must be > 0")
    return scale
