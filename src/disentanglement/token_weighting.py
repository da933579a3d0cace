"""Token-level surprisal-share weighting from a frozen z-free reference model.

Notation (docs/design.md section 2): ``B`` examples, conditioned length ``T``; every ``[B, N]``
tensor here has ``N = T - 1`` positions, position ``t`` being the prediction of token ``t + 1``.
``m_t`` (``target_mask``) is 1 on supervised (response) positions and 0 elsewhere.

    pi_t     = m_t b_t^alpha  / sum_s m_s b_s^alpha         (token_weights)
    pi_inv_t = m_t b_t^-alpha / sum_s m_s b_s^-alpha        (inverse_token_weights)

with ``b_t`` the aligned z-free surprisal floored at ``eps`` before the power.

Beyond the seed notes (docs/design.md section 8), two options change ``pi`` and ``pi_inv``; the statistics
(``b_base``, ``kappa``, ``rho``...) stay those of the reference surprisal ``b_t`` under the weights used:

- another signal ``s_t >= 0`` in place of ``b_t`` in the two shares: the reference's predictive
  entropy at the position (``token_weight_source = "entropy"``), or the training model's own current
  per-token NLL ``l_t``, detached (``"dynamic"``);
- interpolation towards uniform: ``pi_t = (1 - lambda) m_t / n_b + lambda pi_t`` (``pi_inv`` unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .losses import default_chunk_size, masked_token_nll_per_position
from .reference import reference_hidden_states


@dataclass(frozen=True)
class TokenWeighting:
    """The seed notes' bundle: detached token weights and per-example reference statistics."""

    token_weights: torch.Tensor  # [B, N], rows sum to 1 over supervised positions
    inverse_token_weights: torch.Tensor  # [B, N], rows sum to 1 over supervised positions
    aligned_base_token_nll: torch.Tensor  # [B, N], b_t, zero where m_t = 0
    example_base_loss: torch.Tensor  # [B], b_base = (1/n_b) sum_t m_t b_t
    token_weighted_base_loss: torch.Tensor  # [B], sum_t pi_t b_t
    inverse_token_weighted_base_loss: torch.Tensor  # [B], sum_t pi_inv_t b_t
    token_concentration_factor: torch.Tensor  # [B], kappa = token_weighted_base_loss / example_base_loss
    inverse_token_base_scale_factor: torch.Tensor  # [B], rho = inverse_weighted / example_base


def _check_mask(target_mask: torch.Tensor, name: str = "target_mask") -> torch.Tensor:
    if target_mask.dim() != 2:
        raise ValueError(f"{name} must be [B, N], got shape {tuple(target_mask.shape)}")
    mask = target_mask.to(torch.bool)
    if mask.numel() and not torch.equal(mask.to(target_mask.dtype), target_mask):
        raise ValueError(f"{name} must hold only 0 and 1")
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{name}: examples {empty} have no supervised token (n_b = 0)")
    return mask


def _normalised_power(base: torch.Tensor, mask: torch.Tensor, exponent: float) -> torch.Tensor:
    """``m_t base_t^exponent / sum_s m_s base_s^exponent`` computed in log space. [B, N]"""
    log_terms = exponent * base.log()  # [B, N]
    log_terms = log_terms.masked_fill(~mask, float("-inf"))
    return torch.softmax(log_terms, dim=1)


def token_weighting_from_base_nll(
    aligned_base_token_nll: torch.Tensor,
    target_mask: torch.Tensor,
    alpha: float,
    eps: float = 1e-6,
    signal: torch.Tensor | None = None,
    interpolation: float = 1.0,
) -> TokenWeighting:
    """Turn aligned z-free per-token NLL ``b_t`` ``[B, N]`` into the weighting bundle.

    ``target_mask`` is ``[B, N]``, 1 on supervised positions. Surprisal is floored at ``eps``
    before the power, so a token the reference predicts with certainty gets a finite inverse
    weight. Computation is in float64 (small tensors) and results are cast back; all outputs
    are detached.

    ``signal`` (``[B, N]``, ``>= 0`` on supervised positions) replaces ``b_t`` in ``pi`` and ``pi_inv``
    (floored at ``eps`` likewise); ``interpolation`` is ``lambda`` in ``pi = (1 - lambda) m / n + lambda pi``.
    Both leave the statistics defined by ``b_t``: with ``signal = None`` and ``lambda = 1`` this is the seed
    notes' bundle.
    With another signal ``kappa >= 1`` and ``rho <= 1`` no longer hold: weights that fall on tokens the
    reference finds easy give ``kappa < 1`` (down to 0), and term 4 grows as ``1 / kappa``.
    """
    if alpha < 0 or not torch.isfinite(torch.tensor(float(alpha))):
        raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not 0 <= interpolation <= 1:
        raise ValueError(f"interpolation must be in [0, 1], got {interpolation}")
    if aligned_base_token_nll.shape != target_mask.shape:
        raise ValueError(
            f"aligned_base_token_nll {tuple(aligned_base_token_nll.shape)} and target_mask "
            f"{tuple(target_mask.shape)} must have the same [B, N] shape"
        )
    if signal is not None and signal.shape != target_mask.shape:
        raise ValueError(f"signal {tuple(signal.shape)} must have the [B, N] shape {tuple(target_mask.shape)}")
    mask = _check_mask(target_mask)
    out_dtype = aligned_base_token_nll.dtype if aligned_base_token_nll.is_floating_point() else torch.float32
    b = aligned_base_token_nll.detach().to(torch.float64)
    b = torch.where(mask, b, torch.zeros_like(b))  # b_t aligned, zero where m_t = 0
    if (b < 0).any():
        raise ValueError("aligned_base_token_nll must be >= 0 (it is a negative log-likelihood)")
    s = b if signal is None else torch.where(mask, signal.detach().to(torch.float64), torch.zeros_like(b))
    if signal is not None and (s < 0).any():
        raise ValueError("signal must be >= 0 on supervised positions (an NLL or an entropy)")
    # A NaN or infinite signal (a diverged model's own NLL) gives NaN weights: the loss is then
    # non-finite and the trainer's divergence handling takes over, as for any other non-finite step.
    floored = torch.where(mask, s.clamp_min(eps), torch.ones_like(s))  # [B, N]

    pi = _normalised_power(floored, mask, alpha)  # [B, N]
    pi_inv = _normalised_power(floored, mask, -alpha)  # [B, N]
    n = mask.sum(dim=1).to(torch.float64)  # [B]
    if interpolation != 1:
        pi = (1 - interpolation) * mask.to(torch.float64) / n.unsqueeze(1) + interpolation * pi
    example_base = b.sum(dim=1) / n  # [B]
    tok_base = (pi * b).sum(dim=1)  # [B]
    inv_base = (pi_inv * b).sum(dim=1)  # [B]
    # kappa and rho divide by b_base; an example the reference predicts perfectly (b_base = 0)
    # has no concentration to correct, so both factors are 1 there (the alpha = 0 value).
    safe_base = torch.where(example_base > 0, example_base, torch.ones_like(example_base))
    kappa = torch.where(example_base > 0, tok_base / safe_base, torch.ones_like(example_base))
    rho = torch.where(example_base > 0, inv_base / safe_base, torch.ones_like(example_base))

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(out_dtype)

    return TokenWeighting(
        token_weights=cast(pi),
        inverse_token_weights=cast(pi_inv),
        aligned_base_token_nll=cast(b),
        example_base_loss=cast(example_base),
        token_weighted_base_loss=cast(tok_base),
        inverse_token_weighted_base_loss=cast(inv_base),
        token_concentration_factor=cast(kappa),
        inverse_token_base_scale_factor=cast(rho),
    )


def align_to_conditioned(
    zfree_values: torch.Tensor,
    alignment_offsets: torch.Tensor,
    conditioned_positions: int,
    zfree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Place z-free position ``t`` of example ``b`` at ``t + alignment_offsets[b]``.

    ``zfree_values`` is ``[B, Nz]`` (or ``[B, Nz, ...]``, several values per position, which needs
    ``zfree_mask``); the result is ``[B, conditioned_positions, ...]``, zero where nothing lands. A value
    that would land out of range is an error when it is supervised (``zfree_mask`` 1, or non-zero
    when no mask is given); unsupervised values that fall out of range carry nothing and are dropped.
    """
    if zfree_values.dim() < 2 or (zfree_values.dim() > 2 and zfree_mask is None):
        raise ValueError(
            f"zfree_values must be [B, Nz], or [B, Nz, ...] with a zfree_mask; got shape {tuple(zfree_values.shape)}"
        )
    bsz, nz = zfree_values.shape[:2]
    offsets = torch.as_tensor(alignment_offsets, device=zfree_values.device).long().reshape(-1)
    if offsets.numel() != bsz:
        raise ValueError(f"alignment_offsets has {offsets.numel()} entries, expected B = {bsz}")
    keep = zfree_mask.to(torch.bool) if zfree_mask is not None else zfree_values != 0
    if keep.shape != (bsz, nz):
        raise ValueError(f"zfree_mask {tuple(keep.shape)} must be [B, Nz] = {(bsz, nz)}")
    if bsz:
        low, high = int(offsets.min()), int(offsets.max())
        if low == high and low >= 0 and nz + low <= conditioned_positions:
            # One offset for the whole batch (both latent placements) and everything lands in range: a shift.
            trailing = (0, 0) * (zfree_values.dim() - 2)
            return F.pad(zfree_values, (*trailing, low, conditioned_positions - nz - low))
    target = torch.arange(nz, device=zfree_values.device).unsqueeze(0) + offsets.unsqueeze(1)  # [B, Nz]
    in_range = (target >= 0) & (target < conditioned_positions)
    bad = keep & ~in_range
    if bad.any():
        b, t = bad.nonzero()[0].tolist()
        raise ValueError(
            f"supervised z-free position {t} of example {b} lands at conditioned position "
            f"{t + int(offsets[b])}, outside [0, {conditioned_positions}) (offset {int(offsets[b])})"
        )
    out = zfree_values.new_zeros(bsz, conditioned_positions, *zfree_values.shape[2:])
    rows = torch.arange(bsz, device=zfree_values.device).unsqueeze(1).expand(bsz, nz)
    out[rows[in_range], target[in_range]] = zfree_values[in_range]
    return out


def align_token_weighting(
    weighting: TokenWeighting,
    alignment_offsets: torch.Tensor,
    conditioned_positions: int,
    zfree_mask: torch.Tensor,
) -> TokenWeighting:
    """A weighting computed on the z-free layout ``[B, Nz]``, moved to the conditioned positions.

    The per-token fields move with :func:`align_to_conditioned`; the ``[B]`` statistics do not
    depend on positions. Equal to weighting the aligned NLL (the weights of an example depend
    only on its supervised values, not on where they sit).
    """

    per_token = torch.stack(
        [weighting.token_weights, weighting.inverse_token_weights, weighting.aligned_base_token_nll], -1
    )  # [B, Nz, 3], moved at once
    pi, pi_inv, b = align_to_conditioned(per_token, alignment_offsets, conditioned_positions, zfree_mask).unbind(-1)
    return replace(weighting, token_weights=pi, inverse_token_weights=pi_inv, aligned_base_token_nll=b)


@torch.no_grad()
def score_zfree_reference(
    reference_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
) -> torch.Tensor:
    """Masked per-position NLL ``[B, T-1]`` of a frozen causal LM on the z-free sequence.

    Runs in eval mode under ``torch.no_grad()`` and restores the caller's train/eval mode.
    ``target_mask`` is ``[B, T]`` over tokens (1 on response tokens), as for
    :func:`~disentanglement.losses.masked_token_nll_per_position`, whose NLL it is.
    """
    hidden = reference_hidden_states(reference_model, input_ids, attention_mask)[-1]  # [B, T, H]
    head = reference_model.get_output_embeddings()
    chunk = default_chunk_size(input_ids.shape[0], head.weight.shape[0])
    return masked_token_nll_per_position(hidden, input_ids, target_mask, chunk, head=head).float()


def compute_token_weighting(
    reference_model: torch.nn.Module,
    zfree_input_ids: torch.Tensor,
    zfree_attention_mask: torch.Tensor,
    zfree_target_mask: torch.Tensor,
    alignment_offsets: torch.Tensor,
    conditioned_length: int,
    alpha: float,
    eps: float = 1e-6,
) -> TokenWeighting:
    """Score the z-free sequence, align it to the conditioned positions and weight it.

    ``zfree_*`` are ``[B, Tz]`` over tokens; ``conditioned_length`` is the conditioned
    sequence length ``T``; every returned ``[B, N]`` tensor has ``N = T - 1``.
    """
    base_nll = score_zfree_reference(reference_model, zfree_input_ids, zfree_attention_mask, zfree_target_mask)
    return weighting_from_zfree_nll(
        base_nll, zfree_target_mask[:, 1:], alignment_offsets, conditioned_length, alpha, eps
    )


def weighting_from_zfree_nll(
    zfree_token_nll: torch.Tensor,
    zfree_position_mask: torch.Tensor,
    alignment_offsets: torch.Tensor,
    conditioned_length: int,
    alpha: float,
    eps: float = 1e-6,
) -> TokenWeighting:
    """Align already-computed z-free NLL ``[B, Tz-1]`` (with its position mask) and weight it."""
    aligned_nll = align_to_conditioned(
        zfree_token_nll, alignment_offsets, conditioned_length - 1, zfree_mask=zfree_position_mask
    )
    aligned_mask = align_to_conditioned(
        zfree_position_mask.float(), alignment_offsets, conditioned_length - 1, zfree_mask=zfree_position_mask
    )
    return token_weighting_from_base_nll(aligned_nll, aligned_mask, alpha, eps)
