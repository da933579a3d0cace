"""Reading the latent off data and measuring what it does (``disentangle eval``).

Shapes: ``E`` examples of the evaluated set, ``B`` of a batch, ``N`` conditioned positions,
``S`` latents of a prior mixture (codes, code combinations or samples), ``k`` importance samples,
``M`` slots and ``K`` codes (discrete), ``D`` dimensions (continuous), ``U`` KL units (slots or
dimensions). Every quantity is in nats unless its name says bits (``bits = nats / ln 2``).

Per response token ``t`` of an example (docs/design.md section 2): ``b_t`` the z-free reference NLL,
``l_t`` the conditioned decoder's NLL under the posterior latent (argmax code / posterior mean),
``r_t`` the NLL under the prior mixture (:func:`mixture_token_nll`), ``pi_t`` the token weights as
the model is configured (alpha, source, interpolation; with the ``"dynamic"`` source they are shares
of this ``l_t``, so token-weighted figures of different checkpoints weight different tokens).

- z-free gain = ``b_t - l_t`` (positive: the conditioned decoder beats the z-free reference);
  "uniform" averages over every response token of the set, "token-weighted" is
  ``mean_b sum_t pi_t (b_t - l_t)``. The same under prior latents uses ``r_t`` for ``l_t``.
- latent gain = ``r_t - l_t`` (positive: the posterior latent carries information about ``y``
  beyond what latents drawn from the prior give). A learned latent embedding alone beats the
  z-free model (it is a tuned prompt), so only the latent gain says whether ``z`` is used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .config import DEFAULT_SCORING, Scoring
from .cvae_base import CVAEBase, FrozenFeatures, PosteriorSummary, PriorMixture
from .data import Batch, Example, collate, label_factor_names, label_factors, length_order
from .distributed import gather_objects, rank_and_size
from .features import FeatureCache
from .latent_space import LatentSpace, latent_space_of_latents
from .losses import reconstruction_loss_stack
from .metrics import (
    active_units,
    agreement_scores,
    categorical_mutual_information_per_slot,
    code_usage_per_slot,
    factor_agreement,
    gaussian_mutual_information,
    importance_weighted_nll,
    label_agreement,
    nats_to_bits,
    posterior_mean_variance,
)
from .reference import eval_mode
from .token_weighting import TokenWeighting


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
        values = model.posterior_latents(cache.features(batch))
        for key, value in values.items():
            parts.setdefault(key, []).append(value.float().cpu() if value.is_floating_point() else value.cpu())
    return {key: torch.cat(chunks).numpy() for key, chunks in parts.items()}


def latent_assignments(latents: dict[str, np.ndarray], num_clusters: int, seed: int = 0) -> np.ndarray:
    """One cluster id per example: the argmax code (single slot) or code tuple id (several slots);
    k-means of posterior means for the continuous model."""
    return latent_space_of_latents(latents).assignments(latents, num_clusters, seed)


def example_factor_values(examples: Sequence[Example]) -> dict[str, list[str]] | None:
    """Per factor name, the value of every example, in order (a string label is the factor ``"label"``,
    :func:`data.label_factors`); None unless every example has a label. A ``DataError`` names the first
    example whose factor names differ from the others'."""
    if not examples or any(e.label is None for e in examples):
        return None
    names = label_factor_names(examples) or ()
    factors = [label_factors(e.label) or {} for e in examples]
    return {name: [f[name] for f in factors] for name in names}


def label_recovery(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    pad_token_id: int,
    seed: int = 0,
    factor: str | None = None,
) -> dict:
    """Agreement (NMI, ARI, homogeneity, completeness, contingency) between the latent and the labels
    (of ``factor`` when the labels are objects of several named factors)."""
    factors = example_factor_values(examples)
    if factors is None:
        raise ValueError("label_recovery needs a label on every example")
    if factor is None:
        if len(factors) != 1:
            raise ValueError(f"the labels have several factors {sorted(factors)}: name one (factor=...)")
        factor = next(iter(factors))
    if factor not in factors:
        raise ValueError(f"unknown factor {factor!r}; the labels' factors are {sorted(factors)}")
    values = factors[factor]
    latents = posterior_latents(model, examples, cache, pad_token_id)
    assignments = latent_assignments(latents, len(set(values)), seed=seed)
    return label_agreement(assignments, values)


#: Seeded permutations of the latent's assignment averaged by the ``random`` factor baseline.
RANDOM_PERMUTATIONS = 20


def factor_agreements(
    model: CVAEBase,
    latents: dict[str, np.ndarray],
    factor_values: dict[str, list[str]],
    cache: FeatureCache,
    seed: int = 0,
    permutations: int = RANDOM_PERMUTATIONS,
) -> dict[str, dict]:
    """``{factor: metrics.factor_agreement(...)}`` of the latent's assignment against each factor.

    The assignment is the argmax code (tuple) for the discrete model, the same for every factor;
    k-means of the posterior means with as many clusters as the factor has values (at most ``E``)
    for the continuous one. Baselines, with as many clusters as that assignment: ``encoder_kmeans``
    (k-means of ``cache.encoder_features``, the frozen view the encoder reads, or with ``encoder_lora_layers``
    starts from),
    ``prior_kmeans`` (of ``cache.prior_features``, the prompt-only features) and ``random``. With
    several slots each factor also gets ``latent_per_slot``, the four numbers of each slot's code.
    """
    E = len(next(iter(factor_values.values())))
    kmeans_features = {
        "encoder_kmeans": cache.encoder_features.float().numpy(),
        "prior_kmeans": cache.prior_features.float().numpy(),
    }
    kmeans_cache: dict[tuple[str, int], np.ndarray] = {}
    out: dict[str, dict] = {}
    for name, values in factor_values.items():
        assignments = latent_assignments(latents, min(len(set(values)), E), seed=seed)
        entry = factor_agreement(assignments, values, kmeans_features, seed, permutations, kmeans_cache)
        per_slot = model.latent_space.slot_assignments(latents)
        if per_slot:
            entry["latent_per_slot"] = [agreement_scores(slot, values) for slot in per_slot]
        out[name] = entry
    return out


# --------------------------------------------------------------------------- the posterior


__all__ = ["PosteriorSummary", "PriorMixture"]  # built by the families (cvae_base); read here


def posterior_summary(model: CVAEBase, features: FrozenFeatures) -> PosteriorSummary:
    """The posterior and prior of a batch (per-example KL, never the batch-averaged variant): the
    family's ``model.posterior_summary``."""
    return model.posterior_summary(features)


# --------------------------------------------------------------------------- decoding under latents


def conditioned_nll(model: CVAEBase, batch: Batch, vector: torch.Tensor) -> torch.Tensor:
    """``l_t`` under latent ``vector`` ``[B, L]``: ``[B, N]`` float, zero off the response."""
    token_nll, _ = model.conditioned_token_nll(batch, vector)
    return token_nll.float()


def batch_weighting(
    model: CVAEBase,
    batch: Batch,
    features: FrozenFeatures,
    token_nll: torch.Tensor | None = None,
    alpha: float | None = None,
) -> TokenWeighting:
    """Token weights as configured (or at ``alpha``), aligned to the conditioned positions ``[B, N]``.

    ``token_nll`` (``[B, N]``, the decoder's ``l_t``) is needed by the ``"dynamic"`` source only.
    """
    offsets, target = model.alignment_offsets(batch), model.conditioned_target_mask(batch)
    return model.token_weighting(batch, features, offsets, target, token_nll, alpha)


def mixture_token_nll(token_nll: torch.Tensor, log_weights: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of the mixture ``sum_s w_s p(y | x, z_s)``, ``[B, N]``.

    ``token_nll`` is ``[S, B, N]`` (``l_t`` under each latent, zero off the response),
    ``log_weights`` ``[S, B]`` (normalised), ``target_mask`` ``[B, N]``. Token ``t`` gets the
    mixture's own next-token NLL ``-log sum_s w_{s,t} p(y_t | x, y_<t, z_s)``, with
    ``w_{s,t}`` proportional to ``w_s p(y_<t | x, z_s)`` (the chain rule of the mixture), so the
    tokens of an example sum exactly to the sequence NLL ``-log sum_s w_s p(y | x, z_s)``.
    """
    nll = token_nll.double() * target_mask.double()
    after = nll.cumsum(-1)  # [S, B, N], -log p(y_<=t | z_s)
    before = after - nll  # -log p(y_<t | z_s)
    log_w = log_weights.double().unsqueeze(-1)  # [S, B, 1]
    per_token = torch.logsumexp(log_w - before, 0) - torch.logsumexp(log_w - after, 0)  # [B, N]
    return (per_token * target_mask.double()).to(token_nll.dtype)


# --------------------------------------------------------------------------- scoring a batch


@dataclass
class BatchScores:
    """Token-level and per-example scores of one batch (see the module docstring)."""

    target: torch.Tensor  # [B, N], m_t on the conditioned layout
    zfree_nll: torch.Tensor  # [B, N], b_t
    posterior_nll: torch.Tensor  # [B, N], l_t under the posterior latent
    prior_nll: torch.Tensor  # [B, N], r_t under the prior mixture
    weighting: TokenWeighting
    summary: PosteriorSummary
    mixture: PriorMixture
    reconstruction_terms: dict[str, float]
    iw_log_weights: torch.Tensor  # [k, B]
    iw_sequence_nll: torch.Tensor  # [k, B]
    iw_exact: bool
    decoder_codes: torch.Tensor | None = None  # [B, M], the exact mixture's: the argmax of the decoder's posterior
    decoder_map_nll: torch.Tensor | None = None  # [B], sum_t l_t under the mixture's likeliest latent given y
    best_code_nll: torch.Tensor | None = None  # [B], sum_t l_t under the mixture's latent of lowest NLL


@torch.no_grad()
def score_batch(
    model: CVAEBase,
    batch: Batch,
    features: FrozenFeatures,
    scoring: Scoring = DEFAULT_SCORING,
) -> BatchScores:
    """Everything :func:`evaluate` and the token report need of one batch, in one place (``scoring``:
    default :class:`config.Scoring`)."""
    summary = model.posterior_summary(features)
    mixture = model.prior_mixture(features, scoring.prior_samples, scoring.exact_limit, summary)
    # The prior mixture's latents first: the posterior's (and the exact bound's) rows are then found among
    # them where the mixture enumerates every code, and not decoded again.
    with model.reusing_decodes(batch):
        per_latent = torch.stack([conditioned_nll(model, batch, vector) for vector in mixture.vectors])  # [S, B, N]
        posterior, target = model.conditioned_token_nll(batch, summary.vector)  # [B, N] each
        iw_log_w, iw_seq, exact = model.importance_samples(batch, summary, scoring.iw_samples)
    posterior, target = posterior.float(), target.float()
    weighting = batch_weighting(model, batch, features, posterior)
    stack = reconstruction_loss_stack(
        posterior, target, weighting, model.reconstruction_cfg, model.zfree_reference_scale
    )
    prior = mixture_token_nll(per_latent, mixture.log_weights, target)
    decoder_codes = decoder_map_nll = best_code_nll = None
    if mixture.codes is not None:  # every code decoded already: the decoder's own posterior of the codes
        sequence_nll = per_latent.double().sum(-1)  # [S, B]
        decoder_codes = mixture.decoder_posterior(sequence_nll, model.codebook_size).argmax(-1)
        # the joint argmax of p(k | x) p(y | x, k) over the code combinations (one slot: decoder_codes), and its NLL
        likeliest = (mixture.log_weights.double() - sequence_nll).argmax(0)  # [B]
        decoder_map_nll = sequence_nll.gather(0, likeliest.unsqueeze(0)).squeeze(0)
        best_code_nll = sequence_nll.min(0).values  # whatever the prior: the most any hard code can gain
    return BatchScores(
        target=target,
        zfree_nll=weighting.aligned_base_token_nll.float() * target,
        posterior_nll=posterior * target,
        prior_nll=prior,
        weighting=weighting,
        summary=summary,
        mixture=mixture,
        reconstruction_terms={k: float(v) for k, v in stack.terms.items()},
        iw_log_weights=iw_log_w,
        iw_sequence_nll=iw_seq,
        iw_exact=exact,
        decoder_codes=decoder_codes,
        decoder_map_nll=decoder_map_nll,
        best_code_nll=best_code_nll,
    )


# --------------------------------------------------------------------------- the report


def _both_units(report: dict, name: str, nats: float) -> None:
    report[f"{name}_nats_per_token"] = nats
    report[f"{name}_bits_per_token"] = float(nats_to_bits(nats))


@dataclass
class BatchRecords:
    """One batch's per-example records (``columns``, one row per example) and its batch-level numbers.

    Columns (``[B]`` float64 unless stated): ``index`` (the example's position in the evaluated set,
    int), ``tokens`` (response tokens), ``zfree`` / ``posterior`` / ``prior`` (``sum_t b_t``,
    ``sum_t l_t``, ``sum_t r_t``), ``tw_zfree`` / ``tw_posterior`` / ``tw_prior`` (the same weighted
    by ``pi_t``), ``decoder_map`` / ``best_code`` (``sum_t l_t`` under the decoder's likeliest latent / the latent of
    lowest NLL, where the prior mixture is exact over the codes), ``iw_nll`` (the importance-weighted bound),
    ``reconstruction`` (``sum_t l_t`` averaged over the importance samples), ``kl`` ``[B, U]``, and the posterior:
    discrete ``codes`` ``[B, M]`` (int) and ``probs`` ``[B, M, K]``, continuous ``mu`` and ``logvar``
    ``[B, D]``.
    """

    columns: dict[str, np.ndarray]
    reconstruction_terms: dict[str, float]  # the batch means of the six terms
    mixture_method: str
    mixture_size: int
    iw_exact: bool

    @property
    def size(self) -> int:
        return len(self.columns["index"])


def batch_records(scores: BatchScores, indices: Sequence[int], space: LatentSpace) -> BatchRecords:
    """The per-example records of a scored batch whose rows are the examples ``indices``; the posterior's
    columns are those of the model's latent ``space``."""

    def column(values: torch.Tensor) -> np.ndarray:
        return values.cpu().numpy().astype(np.float64)

    pi = scores.weighting.token_weights.double()
    nll = {
        "zfree": scores.zfree_nll.double(),
        "posterior": scores.posterior_nll.double(),
        "prior": scores.prior_nll.double(),
    }
    columns = {"index": np.asarray(indices, dtype=np.int64), "tokens": column(scores.target.sum(-1))}
    columns.update({name: column(values.sum(-1)) for name, values in nll.items()})
    columns.update({f"tw_{name}": column((pi * values).sum(-1)) for name, values in nll.items()})
    columns["iw_nll"] = column(importance_weighted_nll(scores.iw_log_weights))
    columns["reconstruction"] = column(scores.iw_sequence_nll.mean(0))
    summary = scores.summary
    columns["kl"] = column(summary.kl_per_unit.double())
    columns.update(space.record_columns(summary))
    if scores.decoder_codes is not None:
        columns["decoder_codes"] = scores.decoder_codes.cpu().numpy().astype(np.int64)
        columns["decoder_map"] = column(scores.decoder_map_nll)
        columns["best_code"] = column(scores.best_code_nll)
    return BatchRecords(
        columns,
        scores.reconstruction_terms,
        scores.mixture.method,
        scores.mixture.size,
        scores.iw_exact,
    )


def concatenate_records(batches: Sequence[BatchRecords]) -> dict[str, np.ndarray]:
    """The batches' columns concatenated once, rows in the order of the evaluated set (by ``index``)."""
    columns = {name: np.concatenate([batch.columns[name] for batch in batches]) for name in batches[0].columns}
    order = np.argsort(columns["index"], kind="stable")
    return {name: values[order] for name, values in columns.items()}


def nll_and_gain_report(columns: dict[str, np.ndarray]) -> dict:
    """Mean per-token NLLs of the z-free reference, posterior and prior latents, and the gains between them."""
    total_tokens = float(columns["tokens"].sum())
    report: dict = {}
    for name in ("zfree", "posterior", "prior"):
        _both_units(report, f"{name}_nll", float(columns[name].sum() / total_tokens))
    for prefix, worse, better in (
        ("zfree_", "zfree", "posterior"),
        ("prior_zfree_", "zfree", "prior"),
        ("latent_", "prior", "posterior"),
    ):
        _both_units(report, f"{prefix}gain", float((columns[worse] - columns[better]).sum() / total_tokens))
        weighted = float((columns[f"tw_{worse}"] - columns[f"tw_{better}"]).mean())
        _both_units(report, f"token_weighted_{prefix}gain", weighted)
    report["latent_gain_nats_per_example"] = float((columns["prior"] - columns["posterior"]).mean())
    return report


def mean_reconstruction_terms(batches: Sequence[BatchRecords]) -> dict[str, float]:
    """Each term's batch means averaged over the examples (weighted by batch size)."""
    sums: dict[str, float] = {}
    for batch in batches:
        for key, value in batch.reconstruction_terms.items():
            sums[key] = sums.get(key, 0.0) + value * batch.size
    examples = sum(batch.size for batch in batches)
    return {key: value / examples for key, value in sums.items()}


def bound_report(columns: dict[str, np.ndarray], iw_samples: int, iw_exact: bool) -> dict:
    """``elbo``, ``negative_elbo_nats_per_token`` and ``iw_nll`` (see :func:`evaluate`)."""
    total_tokens = float(columns["tokens"].sum())
    kl_total = columns["kl"].sum(1)  # [E]
    reconstruction, iw_nll = columns["reconstruction"], columns["iw_nll"]
    iw_per_token = float(iw_nll.sum() / total_tokens)
    return {
        "elbo": float((-reconstruction - kl_total).mean()),
        "negative_elbo_nats_per_token": float((reconstruction + kl_total).sum() / total_tokens),
        "iw_nll": {
            "samples": 1 if iw_exact else iw_samples,
            "exact": iw_exact,
            "nats_per_example": float(iw_nll.mean()),
            "nats_per_token": iw_per_token,
            "bits_per_token": float(nats_to_bits(iw_per_token)),
            "perplexity": math.exp(iw_per_token),
        },
    }


def kl_report(kl: np.ndarray, unit: str) -> dict:
    """``{total, <unit>}`` of the per-example KL ``[E, U]``: the mean total and the mean per unit."""
    return {"total": float(kl.sum(1).mean()), unit: [float(v) for v in kl.mean(0)]}


@torch.no_grad()
def evaluate(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    pad_token_id: int,
    *,
    scoring: Scoring = DEFAULT_SCORING,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    state=None,
) -> dict:
    """The evaluation report of a trained CVAE on ``examples`` (a JSON-able dict): :func:`evaluate_records`'s
    report, without its per-example records."""
    return evaluate_records(
        model, examples, cache, pad_token_id, scoring=scoring, batch_size=batch_size, seed=seed, progress=progress,
        state=state,
    )[0]  # fmt: skip


@torch.no_grad()
def evaluate_records(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    pad_token_id: int,
    *,
    scoring: Scoring = DEFAULT_SCORING,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    state=None,
) -> tuple[dict, dict[str, np.ndarray]]:
    """The evaluation report of a trained CVAE on ``examples`` (a JSON-able dict), and the per-example records
    it was computed from (:func:`concatenate_records`, in the order of ``examples``: e.g. ``codes`` and, where
    the prior mixture is exact over the codes, ``decoder_codes``, which ``eval --generation`` reads back by).

    With several processes (``state``, accelerate's ``PartialState``) the batches are shared out among
    them and their per-example records gathered (:func:`score_examples`); every process then computes
    the whole report.

    ``cache`` holds the frozen-pass features of ``examples`` (same indexing); ``scoring`` (default
    :class:`config.Scoring`) the samples of the IW bound and the prior mixture. Deterministic given
    ``seed`` (prior and importance samples, k-means); the caller's random state is left untouched.

    Keys (``*`` = ``nats_per_token`` and ``bits_per_token``; "uniform" over every response token of
    the set, ``token_weighted_`` = ``mean_b sum_t pi_t (...)`` with the configured weights):

    - ``zfree_nll_*``, ``posterior_nll_*``, ``prior_nll_*``: mean per-token NLL of the z-free
      reference, of the decoder under the posterior latent, and under the prior mixture;
    - ``zfree_gain_*`` / ``token_weighted_zfree_gain_*``: z-free minus posterior-latent NLL;
      ``prior_zfree_gain_*`` / ``token_weighted_prior_zfree_gain_*``: z-free minus prior-mixture NLL;
    - ``latent_gain_*`` / ``token_weighted_latent_gain_*``: prior-mixture minus posterior-latent NLL;
      ``latent_gain_nats_per_example`` is the same summed over each example's response (a
      per-token gain is at most about ``I(x; z) / n_b``, small for long responses even when the
      latent is fully used); ``prior_mixture`` says how the prior was represented (exact over
      codes, or samples). The token-weighted variant uses the mixture's per-token NLL of
      :func:`mixture_token_nll`;
    - ``reconstruction_terms``: the six terms of docs/design.md section 4 under the posterior latent;
    - ``elbo`` (nats per example: ``-(sum_t l_t) - KL``, the reconstruction averaged over the
      importance samples), ``negative_elbo_nats_per_token``;
    - ``iw_nll``: ``{samples, exact, nats_per_example, nats_per_token, bits_per_token, perplexity}``,
      the importance-weighted bound on ``-log p(y | x)`` (exact for the "nearest" assignment);
    - ``kl``: ``{total, per_slot | per_dimension}``, per-example KL(q || p) averaged;
    - ``mutual_information`` (aggregate-posterior estimator, nats; discrete also
      ``mutual_information_per_slot``);
    - continuous: ``active_units`` (variance of the posterior mean > 0.01),
      ``posterior_mean_variance``; discrete: ``code_usage`` (per slot), ``code_perplexity``
      (per slot), ``dead_codes`` (per slot);
    - with a label on every example (and at least two examples): ``factors``, for each named
      factor of the labels (a string label is the factor ``"label"``) the agreement of the latent's
      assignment with it beside three baselines (:func:`factor_agreements`):
      ``{"values", "clusters", "latent", "encoder_kmeans", "prior_kmeans", "random",
      "latent_beats_baselines", "contingency"}`` (several slots: also ``latent_per_slot``), each
      of ``latent`` and the baselines ``{nmi, ari, homogeneity, completeness}``;
      ``factor_random_permutations`` (permutations averaged by ``random``); ``label_assignment``;
    - discrete, where the prior mixture is exact over the codes: ``decoder_posterior``, the decoder's own
      likeliest code ``argmax_k p(k | x) p(y | x, k)`` against the encoder's (:func:`decoder_posterior_report`),
      and the latent gain under the decoder's likeliest latent and under the best one (:func:`decoder_map_gain`);
    - with a string label on every example, as well: ``label_nmi``, ``label_ari``,
      ``label_homogeneity``, ``label_completeness`` and ``label_contingency`` between the argmax
      codes (the code tuple with several slots; continuous: k-means of the posterior means with as
      many clusters as labels) and the labels (equal to ``factors["label"]``); several slots also
      ``label_agreement_per_slot``.
    """
    if not examples:
        raise ValueError("evaluate needs at least one example")
    if len(cache) != len(examples):
        raise ValueError(f"the feature cache holds {len(cache)} examples, but {len(examples)} were given")
    factor_values = example_factor_values(examples) if len(examples) >= 2 else None  # checks the factor names
    batches = score_examples(model, examples, cache, pad_token_id, scoring, batch_size, seed, progress, state=state)
    columns = concatenate_records(batches)
    last = batches[-1]
    space = model.latent_space
    report = _report_header(model, space.kind, len(examples), columns, seed)
    report.update(nll_and_gain_report(columns))
    report["prior_mixture"] = {"method": last.mixture_method, "latents": last.mixture_size}
    report["reconstruction_terms"] = mean_reconstruction_terms(batches)
    report.update(bound_report(columns, scoring.iw_samples, last.iw_exact))
    report["kl"] = kl_report(columns["kl"], space.kl_units)
    report.update(space.latent_report(columns, seed))
    latents = {space.latent_key: columns[space.latent_key]}
    report.update(label_report(model, latents, examples, factor_values, cache, seed))
    if "decoder_codes" in columns:
        report["decoder_posterior"] = decoder_posterior_report(
            columns["codes"], columns["decoder_codes"], factor_values
        )
        report["decoder_posterior"].update(decoder_map_gain(columns))
    return report, columns


def decoder_posterior_report(
    codes: np.ndarray, decoder_codes: np.ndarray, factor_values: dict[str, list[str]] | None
) -> dict:
    """How the encoder's codes ``[E, M]`` stand to the decoder's own posterior's argmax ``[E, M]``
    (``r ∝ p(k | x) p(y | x, k)``, from the exact prior mixture's decodes): ``agreement`` (the share of
    examples whose every slot's code is the decoder's), and with labels, per factor, the NMI of the decoder's
    codes (the code tuple with several slots) with the factor beside the encoder's, on the same data."""
    report: dict = {"agreement": float((codes == decoder_codes).all(-1).mean())}
    if factor_values is not None:
        tuples = {"encoder": codes, "decoder": decoder_codes}
        ids = {name: np.unique(value, axis=0, return_inverse=True)[1].reshape(-1) for name, value in tuples.items()}
        report["factors"] = {
            factor: {name: label_agreement(assignment, values)["nmi"] for name, assignment in ids.items()}
            for factor, values in factor_values.items()
        }
    return report


def decoder_map_gain(columns: dict[str, np.ndarray]) -> dict:
    """The latent gain (prior-mixture minus a latent's NLL, nats per token over the set and per example) under two
    latents other than the encoder's, both among those the exact prior mixture decodes:

    - ``latent_gain_*``: the decoder's own likeliest code combination, the joint argmax of
      ``log p(k | x) - NLL(y | x, k)``, the hard code of highest ELBO (with several slots it can differ from
      ``decoder_codes``, each slot's marginal argmax);
    - ``best_latent_gain_*``: the combination of lowest NLL, the most any hard code, so any encoder, can gain with
      this decoder (with a uniform prior the same as the first).

    Where the encoder's latent gain is well below ``best_latent_gain``, the encoder limits the gain (it picks codes
    the decoder does not find likeliest); where the two are close, the decoder does (however the codes are picked,
    it draws no more from them)."""
    tokens = columns["tokens"].sum()
    report = {}
    for prefix, column in (("", "decoder_map"), ("best_", "best_code")):
        gains = columns["prior"] - columns[column]
        report[f"{prefix}latent_gain_nats_per_token"] = float(gains.sum() / tokens)
        report[f"{prefix}latent_gain_nats_per_example"] = float(gains.mean())
    return report


def _report_header(model: CVAEBase, latent: str, examples: int, columns: dict[str, np.ndarray], seed: int) -> dict:
    """The eval report's first fields: the family, the data's size, the seed and the token weighting."""
    cfg = model.reconstruction_cfg
    return {
        "latent": latent,
        "examples": examples,
        "response_tokens": int(columns["tokens"].sum()),
        "seed": seed,
        "token_weight_alpha": float(cfg.token_weight_alpha),
        "token_weight_source": cfg.token_weight_source,
        "token_weight_interpolation": float(cfg.token_weight_interpolation),
        "zfree_reference_scale": model.zfree_reference_scale,
    }


def score_examples(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache,
    pad_token_id: int,
    scoring: Scoring,
    batch_size: int,
    seed: int,
    progress: bool,
    state=None,
) -> list[BatchRecords]:
    """:func:`score_batch` over ``examples`` in batches of similar length, in eval mode and under
    ``seed`` (the caller's random state and the model's mode are left as they were).

    With ``N`` processes (``state``) process ``r`` scores the batches ``r, r + N, ...`` and every
    process gets all of them back, in order: the same records as one process's where scoring draws
    no random numbers (the "nearest" assignment with the prior mixture exact over codes); where it
    draws some (importance or prior samples), each process draws its own from ``seed``, so the
    records are equal in distribution, not number for number."""
    device = next(model.parameters()).device
    rank, size = rank_and_size(state)
    order = length_order(examples)
    batches: list[tuple[int, BatchRecords]] = []
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        starts = list(range(0, len(examples), batch_size))
        for number in tqdm(range(rank, len(starts), size), desc="eval", disable=not progress, unit="batch"):
            chunk = order[starts[number] : starts[number] + batch_size]
            batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
            scores = score_batch(model, batch, cache.features(batch), scoring)
            batches.append((number, batch_records(scores, chunk, model.latent_space)))
    if size > 1:
        batches = sorted((pair for part in gather_objects(state, batches) for pair in part), key=lambda pair: pair[0])
    return [records for _, records in batches]


def discrete_latent_report(codes: np.ndarray, probs: np.ndarray) -> dict:
    """Mutual information (total and per slot) and code usage of the codes ``[E, M]`` and posteriors ``[E, M, K]``."""
    mi = categorical_mutual_information_per_slot(probs)
    usage = code_usage_per_slot(codes, probs.shape[-1])
    return {
        "mutual_information": float(sum(mi)),
        "mutual_information_per_slot": mi,
        "code_usage": usage,
        "code_perplexity": [u["perplexity"] for u in usage],
        "dead_codes": [u["dead_codes"] for u in usage],
    }


def continuous_latent_report(mu: np.ndarray, logvar: np.ndarray, seed: int) -> dict:
    """Mutual information, active units and the variance of the posterior means ``[E, D]``."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "mutual_information": gaussian_mutual_information(mu, logvar, generator=generator),
        "active_units": active_units(mu),
        "posterior_mean_variance": [float(v) for v in posterior_mean_variance(mu)],
    }


def label_report(
    model: CVAEBase,
    latents: dict[str, np.ndarray],
    examples: Sequence[Example],
    factor_values: dict[str, list[str]] | None,
    cache: FeatureCache,
    seed: int,
) -> dict:
    """The label and factor keys of :func:`evaluate`'s report (none without a label on every example)."""
    report: dict = {}
    if factor_values is None:
        return report
    labels = [e.label for e in examples]
    has_labels = all(isinstance(label, str) for label in labels)
    space = model.latent_space
    per_slot = space.slot_assignments(latents)
    if has_labels and per_slot:
        report["label_agreement_per_slot"] = [label_agreement(slot, labels) for slot in per_slot]
    report["label_assignment"] = space.assignment
    if has_labels:
        assignments = latent_assignments(latents, min(len(set(labels)), len(examples)), seed=seed)
        agreement = label_agreement(assignments, labels)
        for key in ("nmi", "ari", "homogeneity", "completeness", "contingency"):
            report[f"label_{key}"] = agreement[key]
    report["factors"] = factor_agreements(model, latents, factor_values, cache, seed=seed)
    report["factor_random_permutations"] = RANDOM_PERMUTATIONS
    return report
