"""Model-independent evaluation metrics for the latent of a conditional VAE.

Notation for shapes: ``N`` examples (``B`` for a batch), ``D`` continuous latent dimensions,
``M`` discrete latent slots, ``K`` codes per slot (or importance samples, where stated).
Inputs may be numpy arrays or torch tensors; the importance-weighted bound returns a tensor (a
training loop may differentiate it), the others Python floats, numpy arrays or JSON-able dicts.
All information quantities are in nats (use :func:`nats_to_bits` to convert). The KL divergences
are latent regularisers (``regularizers.py``).
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from sklearn.cluster import KMeans
from sklearn.metrics import (
    adjusted_rand_score,
    completeness_score,
    homogeneity_score,
    normalized_mutual_info_score,
)
from sklearn.metrics.cluster import contingency_matrix

from .regularizers import LOG_2PI, as_tensor


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _python_scalar(v: Any) -> Any:
    """numpy scalar -> Python scalar, so that results are JSON-able."""
    return v.item() if isinstance(v, np.generic) else v


# --------------------------------------------------------------------------- mutual information


def gaussian_mutual_information(
    mu: Any,
    logvar: Any,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    analytic_entropy: bool = False,
    chunk_size: int = 1024,
) -> float:
    """Aggregate-posterior estimate of ``I(x; z)`` for diagonal Gaussian posteriors, nats.

    ``mu``, ``logvar`` are ``[N, D]``, the posteriors ``q(z | x_n)`` of N examples. The
    estimator is that of He et al. (2019, ``calc_mi``):

        I = E_n E_{z ~ q(z|x_n)} [log q(z | x_n) - log q_agg(z)],
        q_agg(z) = (1/N) sum_m q(z | x_m)   (log-sum-exp over m minus log N)

    with ``num_samples`` reparameterised draws per example. By default the first term is
    evaluated on the same draws as the second (a paired Monte Carlo estimate of the same
    quantity, with lower variance: a collapsed encoder gives exactly 0). With
    ``analytic_entropy=True`` the first term is the closed-form negative entropy, exactly
    as in ``calc_mi``. The estimate is at most ``log N``. Draws are scored against the N
    posteriors ``chunk_size`` draws at a time (memory ``chunk_size * N * D``).
    """
    mu = as_tensor(mu).detach().to(torch.float64)
    logvar = as_tensor(logvar).detach().to(torch.float64)
    if mu.dim() != 2 or mu.shape != logvar.shape:
        raise ValueError(f"mu and logvar must both be [N, D], got {tuple(mu.shape)} and {tuple(logvar.shape)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    n, d = mu.shape
    if n == 0:
        raise ValueError("gaussian_mutual_information needs at least one example")
    std = (0.5 * logvar).exp()
    noise = torch.randn((num_samples, n, d), generator=generator, dtype=torch.float64)  # [S, N, D]
    z = (mu + std * noise).reshape(num_samples * n, d)  # [S*N, D], row s*N + n drawn from q(z|x_n)
    inv_var = torch.exp(-logvar)  # [N, D]
    log_norm = -0.5 * (d * LOG_2PI + logvar.sum(dim=-1))  # [N]

    log_q_agg = []
    for start in range(0, z.shape[0], chunk_size):
        zc = z[start : start + chunk_size].unsqueeze(1)  # [C, 1, D]
        log_density = log_norm - 0.5 * ((zc - mu).pow(2) * inv_var).sum(dim=-1)  # [C, N]
        log_q_agg.append(torch.logsumexp(log_density, dim=1) - math.log(n))  # [C]
    mean_log_q_agg = torch.cat(log_q_agg).mean()

    if analytic_entropy:
        mean_log_q = (-0.5 * (d * LOG_2PI + (1.0 + logvar).sum(dim=-1))).mean()
    else:
        mean_log_q = (log_norm - 0.5 * noise.pow(2).sum(dim=-1)).mean()  # log q(z_sn | x_n), [S, N]
    return float(mean_log_q - mean_log_q_agg)


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats along ``axis`` (``0 log 0 = 0``)."""
    p = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return -terms.sum(axis=axis)


def categorical_mutual_information_per_slot(probs: Any) -> list[float]:
    """``I(x; z_m) = H(mean_n q_m(. | x_n)) - mean_n H(q_m(. | x_n))`` per slot, nats.

    ``probs`` is ``[N, M, K]`` (or ``[N, K]``, one slot); each row a distribution over codes.
    """
    p = _as_numpy(probs).astype(np.float64)
    if p.ndim == 2:
        p = p[:, None, :]
    if p.ndim != 3 or p.shape[0] == 0:
        raise ValueError(f"probs must be [N, K] or [N, M, K] with N >= 1, got shape {p.shape}")
    marginal_entropy = _entropy(p.mean(axis=0))  # [M]
    conditional_entropy = _entropy(p).mean(axis=0)  # [M]
    return [float(v) for v in marginal_entropy - conditional_entropy]


def categorical_mutual_information(probs: Any) -> float:
    """``H(mean_n q) - mean_n H(q_n)`` in nats for ``[N, K]``; summed over slots for ``[N, M, K]``."""
    return float(sum(categorical_mutual_information_per_slot(probs)))


# --------------------------------------------------------------------------- active units


def posterior_mean_variance(mu: Any) -> np.ndarray:
    """Variance across examples of each posterior-mean dimension, ``[D]`` for ``mu`` ``[N, D]``.

    Unbiased (``ddof=1``), as in He et al.'s ``calc_au``; zeros when ``N < 2``.
    """
    m = _as_numpy(mu).astype(np.float64)
    if m.ndim != 2:
        raise ValueError(f"mu must be [N, D], got shape {m.shape}")
    if m.shape[0] < 2:
        return np.zeros(m.shape[1])
    return m.var(axis=0, ddof=1)


def active_units(mu: Any, threshold: float = 0.01) -> int:
    """Number of dimensions with ``Var_n E_q[z_d | x_n] > threshold`` (Burda et al. 2016)."""
    return int((posterior_mean_variance(mu) > threshold).sum())


# --------------------------------------------------------------------------- code usage


def code_usage(codes: Any, codebook_size: int) -> dict[str, Any]:
    """Usage statistics of one slot's codes ``[N]`` (ints in ``[0, codebook_size)``).

    Returns ``histogram`` (K counts), ``entropy`` (nats, of the empirical code distribution),
    ``perplexity`` (``exp(entropy)``: K for uniform usage, 1 for a single code),
    ``dead_codes`` (unused code ids), ``used_codes`` (count), ``codebook_size`` and ``total``.
    """
    c = _as_numpy(codes).reshape(-1)
    if c.size == 0:
        raise ValueError("code_usage needs at least one code")
    if not np.issubdtype(c.dtype, np.integer):
        if not np.all(np.equal(np.mod(c, 1), 0)):
            raise ValueError("codes must be integers")
        c = c.astype(np.int64)
    if c.min() < 0 or c.max() >= codebook_size:
        raise ValueError(f"codes must lie in [0, {codebook_size}), got range [{c.min()}, {c.max()}]")
    hist = np.bincount(c, minlength=codebook_size)
    entropy = float(_entropy(hist / hist.sum()))
    return {
        "histogram": [int(v) for v in hist],
        "entropy": entropy,
        "perplexity": math.exp(entropy),
        "dead_codes": [int(k) for k in np.flatnonzero(hist == 0)],
        "used_codes": int((hist > 0).sum()),
        "codebook_size": int(codebook_size),
        "total": int(hist.sum()),
    }


def code_usage_per_slot(codes: Any, codebook_size: int) -> list[dict[str, Any]]:
    """:func:`code_usage` for each slot of ``codes`` ``[N, M]``; a list of M dicts."""
    c = _as_numpy(codes)
    if c.ndim == 1:
        c = c[:, None]
    if c.ndim != 2:
        raise ValueError(f"codes must be [N, M], got shape {c.shape}")
    return [code_usage(c[:, m], codebook_size) for m in range(c.shape[1])]


# --------------------------------------------------------------------------- clustering vs labels


def label_agreement(assignments: Any, labels: Any) -> dict[str, Any]:
    """Agreement of a clustering ``assignments`` ``[N]`` with reference ``labels`` ``[N]``.

    ``labels`` may be strings. Returns ``nmi`` (normalized mutual information, arithmetic
    mean), ``ari`` (adjusted Rand index), ``homogeneity`` (each cluster holds one label),
    ``completeness`` (each label falls in one cluster), and ``contingency``:
    ``{"rows": assignment values, "columns": label values, "counts": [[...]]}``, rows and
    columns sorted, ``counts[i][j]`` the number of examples with assignment ``rows[i]`` and
    label ``columns[j]``. Invariant to renaming the cluster ids.
    """
    a = _as_numpy(assignments).reshape(-1)
    y = _as_numpy(labels).reshape(-1)
    if a.shape != y.shape:
        raise ValueError(f"assignments ({a.size}) and labels ({y.size}) must have the same length")
    if a.size == 0:
        raise ValueError("label_agreement needs at least one example")
    counts = contingency_matrix(a, y)
    return {
        "nmi": float(normalized_mutual_info_score(y, a)),
        "ari": float(adjusted_rand_score(y, a)),
        "homogeneity": float(homogeneity_score(y, a)),
        "completeness": float(completeness_score(y, a)),
        "contingency": {
            "rows": [_python_scalar(v) for v in np.unique(a)],
            "columns": [_python_scalar(v) for v in np.unique(y)],
            "counts": [[int(v) for v in row] for row in counts],
        },
    }


def kmeans_assignments(x: Any, num_clusters: int, seed: int = 0) -> np.ndarray:
    """Cluster ids ``[N]`` from scikit-learn KMeans (``n_init=10``) on ``x`` ``[N, D]``.

    Deterministic given ``seed``.
    """
    data = _as_numpy(x).astype(np.float64)
    if data.ndim != 2:
        raise ValueError(f"x must be [N, D], got shape {data.shape}")
    if not 1 <= num_clusters <= data.shape[0]:
        raise ValueError(f"num_clusters must be in [1, N={data.shape[0]}], got {num_clusters}")
    km = KMeans(n_clusters=num_clusters, n_init=10, random_state=seed)
    return km.fit_predict(data).astype(np.int64)


#: The four agreement numbers of :func:`label_agreement` that every factor reports, in table order.
AGREEMENT_METRICS = ("nmi", "ari", "homogeneity", "completeness")

#: The baselines of :func:`factor_agreement`, in table order.
FACTOR_BASELINES = ("encoder_kmeans", "prior_kmeans", "random")


def agreement_scores(assignments: Any, labels: Any) -> dict[str, float]:
    """``{nmi, ari, homogeneity, completeness}`` of :func:`label_agreement` (without the contingency)."""
    full = label_agreement(assignments, labels)
    return {key: full[key] for key in AGREEMENT_METRICS}


def random_assignments(assignments: Any, permutations: int = 20, seed: int = 0) -> np.ndarray:
    """``permutations`` seeded random permutations of ``assignments`` ``[N]``, ``[permutations, N]``:
    random clusterings with exactly the cluster sizes of ``assignments``."""
    if permutations < 1:
        raise ValueError(f"permutations must be >= 1, got {permutations}")
    a = _as_numpy(assignments).reshape(-1)
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(a) for _ in range(permutations)])


def random_assignment_agreement(
    assignments: Any, labels: Any, permutations: int = 20, seed: int = 0
) -> dict[str, float]:
    """The chance level of ``assignments``: mean :func:`agreement_scores` over the clusterings of
    :func:`random_assignments` (the same cluster sizes, assigned at random)."""
    totals = dict.fromkeys(AGREEMENT_METRICS, 0.0)
    shuffled = random_assignments(assignments, permutations, seed)
    for row in shuffled:
        for key, value in agreement_scores(row, labels).items():
            totals[key] += value
    return {key: value / len(shuffled) for key, value in totals.items()}


def factor_agreement(
    assignments: Any,
    values: Any,
    kmeans_features: Mapping[str, Any],
    seed: int = 0,
    permutations: int = 20,
    kmeans_cache: dict[tuple[str, int], np.ndarray] | None = None,
) -> dict[str, Any]:
    """Agreement of a latent's clustering ``assignments`` ``[N]`` with one factor's ``values`` ``[N]``,
    beside the same numbers for baselines that involve no training.

    Each entry of ``kmeans_features`` (name -> features ``[N, F]``, e.g. ``"encoder_kmeans"``: the
    frozen encoder features) is clustered by :func:`kmeans_assignments` (seeded) into as many
    clusters as ``assignments`` uses; ``"random"`` is :func:`random_assignment_agreement`. Returns
    ``{"values": distinct factor values, "clusters": clusters of the latent, "latent": {...},
    <each k-means name>: {...}, "random": {...}, "latent_beats_baselines": bool, "contingency"}``,
    each ``{...}`` the four :data:`AGREEMENT_METRICS`; ``latent_beats_baselines`` is whether the
    latent's NMI exceeds every baseline's. ``kmeans_cache`` (keyed by ``(name, clusters)``) lets
    several factors share one clustering.
    """
    a = _as_numpy(assignments).reshape(-1)
    y = _as_numpy(values).reshape(-1)
    full = label_agreement(a, y)
    clusters = int(np.unique(a).size)
    entry: dict[str, Any] = {
        "values": int(np.unique(y).size),
        "clusters": clusters,
        "latent": {key: full[key] for key in AGREEMENT_METRICS},
    }
    cache = kmeans_cache if kmeans_cache is not None else {}
    for name, features in kmeans_features.items():
        if (name, clusters) not in cache:
            cache[(name, clusters)] = kmeans_assignments(features, clusters, seed=seed)
        entry[name] = agreement_scores(cache[(name, clusters)], y)
    entry["random"] = random_assignment_agreement(a, y, permutations, seed)
    baselines = [entry[name]["nmi"] for name in (*kmeans_features, "random")]
    entry["latent_beats_baselines"] = bool(entry["latent"]["nmi"] > max(baselines))
    entry["contingency"] = full["contingency"]
    return entry


# --------------------------------------------------------------------------- text and likelihood


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct-n: unique n-grams / total n-grams over whitespace tokens of all ``texts``.

    n-grams do not cross text boundaries; 0.0 when there are no n-grams.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    total = 0
    unique: set[tuple[str, ...]] = set()
    for text in texts:
        words = text.split()
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        total += len(grams)
        unique.update(grams)
    return len(unique) / total if total else 0.0


#: ``loops``: a run of at most this many words ...
LOOP_MAX_SPAN = 4
#: ... written this many times back to back
LOOP_COPIES = 3


def loops(text: str, max_span: int = LOOP_MAX_SPAN, copies: int = LOOP_COPIES) -> bool:
    """Whether ``text`` repeats itself: some run of 1 to ``max_span`` words occurs ``copies`` times back to back
    ("Over and out Over and out Over and out"), the words compared in lower case with the punctuation around them
    stripped ("Yes. yes, YES!" is one word three times). A generation stuck in a loop, which a z-free NLL below the
    real responses' can hide."""
    if max_span < 1 or copies < 2:
        raise ValueError(f"max_span must be >= 1 and copies >= 2, got {max_span} and {copies}")
    words = [w for w in (w.strip(string.punctuation).lower() for w in text.split()) if w]
    for span in range(1, max_span + 1):
        for start in range(len(words) - span * copies + 1):
            run = words[start : start + span]
            if all(words[start + c * span : start + (c + 1) * span] == run for c in range(1, copies)):
                return True
    return False


def looping_share(texts: Sequence[str]) -> float:
    """The share of ``texts`` that repeat themselves (:func:`loops`); 0.0 when there are none."""
    return sum(loops(t) for t in texts) / len(texts) if texts else 0.0


def nats_to_bits(x: Any) -> Any:
    """Convert nats to bits (divide by ``ln 2``); floats, numpy arrays and tensors alike."""
    return x / math.log(2.0)


def importance_weighted_nll(log_joint_minus_log_q: Any) -> torch.Tensor:
    """IWAE bound on ``-log p(y | x)`` per example, ``[B]``.

    ``log_joint_minus_log_q`` is ``[K, B]``: ``log p(y, z_k | x) - log q(z_k | x, y)`` for K
    posterior samples. Returns ``-(logsumexp_k(.) - log K)``; K = 1 is the (negated) ELBO.
    """
    log_weights = as_tensor(log_joint_minus_log_q)
    if log_weights.dim() != 2 or log_weights.shape[0] < 1:
        raise ValueError(f"log_joint_minus_log_q must be [K, B] with K >= 1, got shape {tuple(log_weights.shape)}")
    return -(torch.logsumexp(log_weights, dim=0) - math.log(log_weights.shape[0]))
