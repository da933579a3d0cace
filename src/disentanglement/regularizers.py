"""Latent regularisers (docs/design.md section 5): KL, its beta schedule and free bits, and the
token-weighted inter-latent divergence. Pure functions over tensors.

Shapes: ``B`` examples, ``U`` latent units (slots for the discrete model, dimensions for the
continuous one), ``K`` codes, ``N`` conditioned positions, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .config import KLConfig

LOG_2PI = math.log(2.0 * math.pi)


def as_tensor(x: Any) -> torch.Tensor:
    """A float tensor of ``x`` (numpy or torch; a tensor is returned as it is); integer input becomes float32."""
    tensor = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return tensor if tensor.is_floating_point() else tensor.to(torch.float32)


def gaussian_kl(
    mu_q: Any,
    logvar_q: Any,
    mu_p: Any | None = None,
    logvar_p: Any | None = None,
) -> torch.Tensor:
    """Per-dimension ``KL(N(mu_q, e^logvar_q) || N(mu_p, e^logvar_p))``, ``[B, D]``.

    ``mu_q``, ``logvar_q`` are ``[B, D]``; ``mu_p``, ``logvar_p`` broadcast against them
    (``[B, D]`` or ``[D]``), and each defaults to the standard normal's (0 and 0):

        KL_d = 0.5 * (logvar_p - logvar_q + (e^logvar_q + (mu_q - mu_p)^2) / e^logvar_p - 1)
    """
    mu_q, logvar_q = as_tensor(mu_q), as_tensor(logvar_q)
    mu_p = torch.zeros_like(mu_q) if mu_p is None else as_tensor(mu_p).to(mu_q)
    logvar_p = torch.zeros_like(logvar_q) if logvar_p is None else as_tensor(logvar_p).to(logvar_q)
    return 0.5 * (logvar_p - logvar_q + (logvar_q.exp() + (mu_q - mu_p).pow(2)) * torch.exp(-logvar_p) - 1.0)


def diag_gaussian_log_density(z: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """``log N(z; mu, diag(e^logvar))`` summed over the last dimension: ``[..., D] -> [...]``."""
    return -0.5 * (LOG_2PI + logvar + (z - mu).pow(2) * torch.exp(-logvar)).sum(-1)


def categorical_kl(log_q: Any, log_p: Any) -> torch.Tensor:
    """Per-slot ``KL(q || p) = sum_k q_k (log q_k - log p_k)``, ``[B, M]``.

    ``log_q`` is ``[B, M, K]`` log-probabilities; ``log_p`` is ``[M, K]`` (a fixed prior) or
    ``[B, M, K]`` (a learned prior). Codes with ``q_k = 0`` contribute 0 (also where
    ``log p_k = -inf``); a code with ``q_k > 0`` and ``p_k = 0`` gives ``inf``.
    """
    log_q = as_tensor(log_q)
    log_p = as_tensor(log_p).to(log_q)
    if log_q.dim() != 3:
        raise ValueError(f"log_q must be [B, M, K], got shape {tuple(log_q.shape)}")
    if log_p.dim() == 2:
        log_p = log_p.unsqueeze(0)
    if log_p.dim() != 3 or log_p.shape[1:] != log_q.shape[1:]:
        raise ValueError(f"log_p must be [M, K] or [B, M, K] matching log_q {tuple(log_q.shape)}")
    q = log_q.exp()
    terms = torch.where(q > 0, q * (log_q - log_p), torch.zeros_like(q))  # [B, M, K]
    return terms.sum(dim=-1)


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
