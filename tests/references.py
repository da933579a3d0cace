"""Independent reference implementations the tests compare the package against, in one place.

Deliberately naive: float64 Python scalars, one example and one position at a time, powers computed
directly (not in log space), so that they share no code path with the package. Each names the
section of docs/design.md it implements.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from disentanglement.reference import eval_mode

#: The per-token and per-example fields of ``token_weighting.TokenWeighting``.
WEIGHTING_FIELDS = (
    "token_weights",
    "inverse_token_weights",
    "aligned_base_token_nll",
    "example_base_loss",
    "token_weighted_base_loss",
    "inverse_token_weighted_base_loss",
    "token_concentration_factor",
    "inverse_token_base_scale_factor",
)

#: The six reconstruction terms of docs/design.md section 4, in order.
ALL_TERMS = (
    "reconstruction_loss",
    "sequence_reconstruction_loss",
    "token_weighted_reconstruction_loss",
    "normalized_concentration_corrected_token_weighted_reconstruction_loss",
    "normalized_inverse_surprisal_token_weighted_reconstruction_loss",
    "zfree_relative_reconstruction_loss",
)


# -- token weights (docs/design.md section 3, section 8's signal and interpolation) ------------------------------
def loop_weighting(b, m, alpha: float, eps: float = 1e-6, *, signal=None, lam: float = 1.0) -> dict:
    """The bundle of docs/design.md section 3 (and section 8's options), per example and per position.

    Shares of the signal (the reference surprisal ``b`` unless ``signal`` is given) floored at ``eps``
    before the power, mixed with uniform by ``lam``; the statistics use the unfloored ``b``.
    ``b``, ``m`` (and ``signal``) are nested lists ``[B][N]``."""
    out: dict[str, list] = {name: [] for name in WEIGHTING_FIELDS}
    for i, (b_row, m_row) in enumerate(zip(b, m, strict=True)):
        s_row = b_row if signal is None else signal[i]
        n_pos = len(b_row)
        idx = [t for t in range(n_pos) if m_row[t]]
        n_b = len(idx)
        num = {t: max(float(s_row[t]), eps) ** alpha for t in idx}
        num_inv = {t: max(float(s_row[t]), eps) ** (-alpha) for t in idx}
        den, den_inv = sum(num.values()), sum(num_inv.values())
        pi = [(1 - lam) / n_b + lam * num[t] / den if m_row[t] else 0.0 for t in range(n_pos)]
        pi_inv = [num_inv[t] / den_inv if m_row[t] else 0.0 for t in range(n_pos)]
        bb = [float(b_row[t]) if m_row[t] else 0.0 for t in range(n_pos)]
        base = sum(bb) / n_b
        tok = sum(p * x for p, x in zip(pi, bb, strict=True))
        inv = sum(p * x for p, x in zip(pi_inv, bb, strict=True))
        values = dict(
            token_weights=pi,
            inverse_token_weights=pi_inv,
            aligned_base_token_nll=bb,
            example_base_loss=base,
            token_weighted_base_loss=tok,
            inverse_token_weighted_base_loss=inv,
            token_concentration_factor=tok / base if base > 0 else 1.0,
            inverse_token_base_scale_factor=inv / base if base > 0 else 1.0,
        )
        for name in WEIGHTING_FIELDS:
            out[name].append(values[name])
    return out


def loop_align(values: list[list[float]], mask: list[list[int]], offsets: list[int], n_out: int) -> list[list[float]]:
    """Place z-free position t of example b at t + offsets[b] (supervised values only)."""
    out = [[0.0] * n_out for _ in values]
    for bi, row in enumerate(values):
        for t, v in enumerate(row):
            if mask[bi][t]:
                out[bi][t + offsets[bi]] = float(v)
    return out


def loop_entropy(logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """``out[b, t]`` = the entropy of ``softmax(logits[b, t])`` where token ``t + 1`` is supervised, else 0."""
    B, T, _ = logits.shape
    out = torch.zeros(B, T - 1, dtype=torch.float64)
    for b in range(B):
        for t in range(T - 1):
            if token_mask[b, t + 1]:
                p = [math.exp(x) for x in logits[b, t].double().tolist()]
                z = sum(p)
                out[b, t] = -sum(q / z * math.log(q / z) for q in p)
    return out


def manual_zfree_nll(model, input_ids, attention_mask, target_mask) -> torch.Tensor:
    """The z-free reference's NLL ``[B, T-1]`` from the model's own full logits (its standard forward, eval
    mode), one ``F.cross_entropy`` per supervised position, float64; zero where unsupervised."""
    with eval_mode(model), torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.double()
    bsz, seq = input_ids.shape
    out = torch.zeros(bsz, seq - 1, dtype=torch.float64)
    for b in range(bsz):
        for t in range(seq - 1):
            if target_mask[b, t + 1]:
                out[b, t] = F.cross_entropy(logits[b, t].unsqueeze(0), input_ids[b, t + 1].unsqueeze(0))
    return out


# -- the NLL kernel and the six terms (docs/design.md sections 2 and 4) -------------------------------------------
def loop_masked_nll(logits: torch.Tensor, input_ids: torch.Tensor, token_mask: torch.Tensor) -> list[list[float]]:
    """out[b][t] = -log_softmax(logits[b, t])[input_ids[b, t+1]] if token t+1 is supervised, else 0."""
    bsz, seq, vocab = logits.shape
    out = [[0.0] * (seq - 1) for _ in range(bsz)]
    for b in range(bsz):
        for t in range(seq - 1):
            if token_mask[b, t + 1]:
                row = [float(x) for x in logits[b, t]]
                top = max(row)
                lse = top + math.log(sum(math.exp(x - top) for x in row))
                out[b][t] = lse - row[int(input_ids[b, t + 1])]
    return out


def loop_terms(cond_nll, m, b, alpha: float, scale: float, eps: float = 1e-6) -> dict[str, float]:
    """All six terms from conditioned NLL cond_nll, mask m and aligned base NLL b (lists [B][N])."""
    sums = dict.fromkeys(ALL_TERMS, 0.0)
    bsz = len(cond_nll)
    for i in range(bsz):
        n_pos = len(cond_nll[i])
        sup = [t for t in range(n_pos) if m[i][t]]
        n_b = len(sup)
        # token weights from b floored at eps before the power
        num = {t: max(float(b[i][t]), eps) ** alpha for t in sup}
        num_inv = {t: max(float(b[i][t]), eps) ** (-alpha) for t in sup}
        den, den_inv = sum(num.values()), sum(num_inv.values())
        pi = {t: num[t] / den for t in sup}
        pi_inv = {t: num_inv[t] / den_inv for t in sup}
        base = sum(float(b[i][t]) for t in sup) / n_b
        tok_base = sum(pi[t] * float(b[i][t]) for t in sup)
        inv_base = sum(pi_inv[t] * float(b[i][t]) for t in sup)
        kappa = tok_base / base if base > 0 else 1.0
        rho = inv_base / base if base > 0 else 1.0
        seq = sum(float(cond_nll[i][t]) for t in sup)
        tok = sum(pi[t] * float(cond_nll[i][t]) for t in sup)
        inv = sum(pi_inv[t] * float(cond_nll[i][t]) for t in sup)
        sums["reconstruction_loss"] += seq / n_b
        sums["sequence_reconstruction_loss"] += seq
        sums["token_weighted_reconstruction_loss"] += tok
        sums["normalized_concentration_corrected_token_weighted_reconstruction_loss"] += tok / kappa
        sums["normalized_inverse_surprisal_token_weighted_reconstruction_loss"] += inv / rho
        sums["zfree_relative_reconstruction_loss"] += seq / n_b
    out = {k: v / bsz for k, v in sums.items()}
    for term in (
        "normalized_concentration_corrected_token_weighted_reconstruction_loss",
        "normalized_inverse_surprisal_token_weighted_reconstruction_loss",
        "zfree_relative_reconstruction_loss",
    ):
        out[term] /= scale
    return out


# -- the frozen pass's features and the encoder's views (docs/design.md section 7) ---------------------------------------------------------------
def reference_nll_and_entropy(logits, ids, p, r):
    """One example's response NLL and predictive entropy from its full logits ``[T, V]`` (prompt ``p``, response ``r`` tokens)."""
    window = logits[p - 1 : p + r - 1]  # the positions that predict the response tokens
    nll = F.cross_entropy(window, ids[p : p + r], reduction="none")
    log_p = F.log_softmax(window, -1)
    return nll, -(log_p.exp() * log_p).sum(-1)


def loop_attention(query, h, p, r):
    """softmax over the response positions of q . LayerNorm(h_t) / sqrt(H), pooled over h_t, by hand."""
    H = h.shape[-1]
    scores = []
    for t in range(p, p + r):
        x = h[t]
        key = (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-5)
        scores.append(float(sum(float(query[i]) * float(key[i]) for i in range(H))) / math.sqrt(H))
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    pooled = torch.zeros(H, dtype=torch.float64)
    for w, t in zip(weights, range(p, p + r), strict=True):
        pooled += (w / total) * h[t].double()
    return pooled.float()
