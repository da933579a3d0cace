"""Latent regularisers (DESIGN.md section 5): KL, its beta schedule and free bits, and the
token-weighted inter-latent divergence. Pure functions over tensors.

Shapes: ``B`` examples, ``U`` latent units (slots for the discrete model, dimensions for the
continuous one), ``K`` codes, ``N`` conditioned positions, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import KLConfig


def gaussian_kl(
    mu_q: torch.Tensor,
    logvar_q: torch.Tensor,
    mu_p: torch.Tensor | None = None,
    logvar_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-dimension ``KL(N(mu_q, var_q) || N(mu_p, var_p))``, ``[B, D]``; the prior is N(0, I) when omitted."""
    if mu_p is None:
        mu_p = torch.zeros_like(mu_q)
    if logvar_p is None:
        logvar_p = torch.zeros_like(logvar_q)
    return 0.5 * (logvar_p - logvar_q + (logvar_q.exp() + (mu_q - mu_p).pow(2)) / logvar_p.exp() - 1.0)


def categorical_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Per-slot ``KL(q || p) = sum_k q_k (log q_k - log p_k)`` for ``[B, M, K]`` log-probabilities, ``[B, M]``.

    ``log_p`` may be ``[M, K]`` or ``[B, M, K]``. Terms with ``q_k = 0`` contribute 0.
    """
    q = log_q.exp()
    return torch.where(q > 0, q * (log_q - log_p), torch.zeros_like(q)).sum(dim=-1)


def beta_at(step: int, cfg: KLConfig) -> float:
    """KL weight at an optimizer step: constant, linear warm-up, or cyclical (linear rise, then flat)."""
    if cfg.beta_schedule == "constant" or cfg.beta_warmup_steps == 0:
        return cfg.beta
    if cfg.beta_schedule == "linear":
        return cfg.beta * min(1.0, step / cfg.beta_warmup_steps)
    position = step % cfg.beta_cycle_steps
    return cfg.beta * min(1.0, position / cfg.beta_warmup_steps)


def kl_objective(
    kl_per_unit: torch.Tensor, response_lengths: torch.Tensor, cfg: KLConfig, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL term of the objective and the per-unit batch-mean KL it was built from.

    ``kl_per_unit`` is ``[B, U]``. With ``kl_per_token`` each example's KL is divided by its
    response length ``n_b`` (``[B]``). Free bits (Kingma et al. 2016) floor the batch-mean KL of
    each unit at ``free_bits`` nats: ``beta * sum_u max(mean_b kl[b, u] / s_b, free_bits)``.
    Returns ``(kl_term, per_unit [U])``.
    """
    scale = response_lengths.to(kl_per_unit.dtype) if cfg.kl_per_token else torch.ones_like(kl_per_unit[:, 0])
    per_unit = (kl_per_unit / scale.unsqueeze(1)).mean(dim=0)  # [U]
    if cfg.free_bits > 0:
        per_unit = per_unit.clamp_min(cfg.free_bits)
    return beta * per_unit.sum(), per_unit


def annealed_temperature(step: int, start: float, minimum: float, anneal_steps: int) -> float:
    """Exponential annealing ``start * (minimum / start)^(step / anneal_steps)``, floored at ``minimum``."""
    if start <= minimum:
        return start
    if anneal_steps == 0:
        return minimum
    return start * math.pow(minimum / start, min(1.0, step / anneal_steps))


def next_token_divergence(logits_a: torch.Tensor, logits_b: torch.Tensor, kind: str = "js") -> torch.Tensor:
    """Per-position divergence between two next-token distributions: ``[..., V] -> [...]``.

    ``js``: Jensen-Shannon (natural log, in ``[0, log 2]``); ``kl``: ``KL(a || b)``.
    """
    log_a = F.log_softmax(logits_a.float(), dim=-1)
    log_b = F.log_softmax(logits_b.float(), dim=-1)
    if kind == "kl":
        return (log_a.exp() * (log_a - log_b)).sum(dim=-1)
    if kind != "js":
        raise ValueError(f"divergence must be 'js' or 'kl', got {kind!r}")
    log_m = torch.logsumexp(torch.stack([log_a, log_b]), dim=0) - math.log(2.0)
    return 0.5 * ((log_a.exp() * (log_a - log_m)).sum(-1) + (log_b.exp() * (log_b - log_m)).sum(-1))
