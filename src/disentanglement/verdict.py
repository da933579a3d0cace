"""One verdict after every run: did the latent collapse, or learn, and does it beat clustering?

``train`` prints it at its end (on the validation split), ``eval`` in its console output and the
explorer page at its top. It reads an evaluation report (:func:`evaluation.evaluate`'s keys, or a dict
with the same keys built by hand):

- ``latent``: ``"discrete"`` or ``"continuous"``;
- discrete: ``code_usage`` (per slot ``{"used_codes", "codebook_size", "perplexity"}``);
  continuous: ``active_units`` and ``posterior_mean_variance`` (one number per dimension);
- ``latent_gain_nats_per_token`` and, when present, ``token_weighted_latent_gain_nats_per_token``
  (prior-mixture NLL minus posterior-latent NLL: whether the decoder uses ``z``);
- with labels, ``factors``: per factor ``{"latent", "encoder_kmeans", "prior_kmeans", "random"}``, each
  ``{"nmi", ...}`` (:func:`evaluation.factor_agreements`).

The thresholds and the verdicts are defined once, in :func:`judge`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .latent_space import latent_space_of_report

#: A latent gain (nats per token) at or below this is "no gain": the decoder does not use ``z``.
GAIN_EPSILON = 1e-3
#: Two NMIs closer than this "match"; a latent "beats" a baseline by at least this much.
NMI_MARGIN = 0.05

COLLAPSED = "collapsed"
MATCHES = "matches clustering of its own features"
BEATS = "beats every baseline"
BELOW = "no better than a baseline"
UNLABELLED = "uses its latent (no labels: no baselines to compare)"
#: Every verdict :func:`judge` gives.
VERDICTS = (COLLAPSED, MATCHES, BEATS, BELOW, UNLABELLED)

#: The baselines of a factor entry, in the order shown, with their names.
BASELINES = {
    "encoder_kmeans": "k-means of its own features",
    "prior_kmeans": "k-means of the prompt's features",
    "random": "random",
}


def _usage(report: Mapping[str, Any]) -> dict[str, Any]:
    """``{"kind": "codes", "used": [per slot], "of": [per slot]}`` or ``{"kind": "units", "active", "of"}``."""
    return latent_space_of_report(report).usage_from_report(report)


def latent_gain(report: Mapping[str, Any]) -> float:
    """The larger of the uniform and the token-weighted latent gain (nats per token): a latent that helps
    the tokens its objective weights is used even when the uniform average over every token is flat."""
    gains = [report["latent_gain_nats_per_token"]]
    if report.get("token_weighted_latent_gain_nats_per_token") is not None:
        gains.append(report["token_weighted_latent_gain_nats_per_token"])
    return float(max(gains))


def factor_comparison(entry: Mapping[str, Any]) -> dict[str, Any]:
    """One factor's latent NMI, its own view's k-means NMI and its best baseline (name and NMI)."""
    baselines = {name: float(entry[name]["nmi"]) for name in BASELINES if name in entry}
    best = max(baselines, key=lambda name: baselines[name])
    return {
        "nmi": float(entry["latent"]["nmi"]),
        "own_kmeans": baselines.get("encoder_kmeans"),
        "best_baseline": best,
        "best_baseline_nmi": baselines[best],
        "baselines": baselines,
    }


def judge(report: Mapping[str, Any], gain_epsilon: float = GAIN_EPSILON, margin: float = NMI_MARGIN) -> dict[str, Any]:
    """The verdict of an evaluation report (keys in the module docstring), and why.

    In this order, the first that holds:

    1. ``collapsed``: the latent carries nothing the decoder uses. Discrete: every slot uses one code
       (or none); continuous: 0 active units (no dimension's posterior mean varies by more than 0.01
       over the data); or either family: the latent gain (the larger of the uniform and the
       token-weighted, :func:`latent_gain`) is at most ``gain_epsilon`` (1e-3 nats per token). A high
       NMI beside a collapsed latent only says that the codes (or k-means of the posterior means)
       follow the encoder's features; the decoder does not use them.
    2. ``uses its latent (no labels: ...)``: not collapsed, and no labelled factors to compare.
    3. ``beats every baseline``: for the factor the latent took (its highest NMI; ties: the first) the
       latent's NMI is above every baseline's (k-means of the encoder's own frozen features, k-means of
       the prompt's features, random) by at least ``margin`` (0.05). Only that factor: a latent that takes
       factor A worse than clustering does and carries a trace of factor B (NMI 0.09 against 0.00) has not
       beaten clustering.
    4. ``matches clustering of its own features``: else, for the factor with the highest latent NMI,
       that NMI is within ``margin`` of k-means of the encoder's own features (the latent found what
       clustering its input finds without training).
    5. ``no better than a baseline``: else (the latent is below k-means of its own features by more than
       the margin, or above it but not above another baseline by the margin).

    Returns ``{"verdict", "reason", "usage", "latent_gain", "factors"}``: ``factors`` maps each factor to
    :func:`factor_comparison` plus ``"beats"`` (bool); ``reason`` is one sentence with the numbers.
    """
    usage = _usage(report)
    gain = latent_gain(report)
    factors = {}
    for name, entry in (report.get("factors") or {}).items():
        comparison = factor_comparison(entry)
        comparison["beats"] = comparison["nmi"] >= comparison["best_baseline_nmi"] + margin
        factors[name] = comparison
    out: dict[str, Any] = {"usage": usage, "latent_gain": gain, "factors": factors, "margin": margin}

    if usage["kind"] == "codes":
        dead = all(used <= 1 for used in usage["used"])
        why_dead = "one code used in every slot" if dead else ""
    else:
        dead = usage["active"] == 0
        why_dead = "0 active units" if dead else ""
    if dead or gain <= gain_epsilon:
        reasons = [why_dead] if why_dead else []
        if gain <= gain_epsilon:
            reasons.append(f"latent gain {gain:+.4f} <= {gain_epsilon:g} nats/token: the decoder does not use z")
        best = _best_factor(factors)
        if best is not None:
            f = factors[best]
            reasons.append(
                f"the NMI {f['nmi']:.2f} with {best} reflects the encoder's features, which the decoder does "
                f"not use (k-means of its own features {f['own_kmeans']:.2f})"
                if f["own_kmeans"] is not None
                else f"the NMI {f['nmi']:.2f} with {best} is not used by the decoder"
            )
        return dict(out, verdict=COLLAPSED, reason="; ".join(reasons))
    if not factors:
        return dict(out, verdict=UNLABELLED, reason=f"latent gain {gain:+.4f} nats/token; the data has no labels")
    name = _best_factor(factors)
    f = factors[name]
    if f["beats"]:
        reason = (
            f"factor {name}: NMI {f['nmi']:.2f} against its best baseline, {BASELINES[f['best_baseline']]} "
            f"{f['best_baseline_nmi']:.2f} (margin {margin:g})"
        )
        return dict(out, verdict=BEATS, reason=reason)
    own = f["own_kmeans"]
    if own is not None and abs(f["nmi"] - own) <= margin:
        reason = f"factor {name}: NMI {f['nmi']:.2f}, k-means of its own features {own:.2f} (within {margin:g})"
        return dict(out, verdict=MATCHES, reason=reason)
    reason = (
        f"factor {name}: NMI {f['nmi']:.2f}, not above {BASELINES[f['best_baseline']]} "
        f"{f['best_baseline_nmi']:.2f} by {margin:g}"
    )
    return dict(out, verdict=BELOW, reason=reason)


def _best_factor(factors: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The factor with the highest latent NMI (the first on ties), None without factors."""
    if not factors:
        return None
    return max(factors, key=lambda name: factors[name]["nmi"])


def usage_line(usage: Mapping[str, Any]) -> str:
    """``code usage: slot 0 4/4 codes, ...`` or ``active units: 3/4``."""
    if usage["kind"] == "codes":
        slots = ", ".join(
            f"slot {m} {used}/{of}" for m, (used, of) in enumerate(zip(usage["used"], usage["of"], strict=True))
        )
        return f"code usage:  {slots} codes used"
    of = f"/{usage['of']}" if usage.get("of") else ""
    return f"active units: {usage['active']}{of} dimensions"


def verdict_lines(report: Mapping[str, Any], result: Mapping[str, Any] | None = None) -> list[str]:
    """The console lines of a verdict: usage, latent gain, each factor's NMI beside its best baseline,
    then ``verdict: <verdict> (<reason>)`` (``result``: :func:`judge` of ``report``, computed if None)."""
    result = judge(report) if result is None else result
    lines = [
        usage_line(result["usage"]),
        f"latent gain: {report['latent_gain_nats_per_token']:+.4f} nats/token (posterior against prior latents"
        + (
            f"; token-weighted {report['token_weighted_latent_gain_nats_per_token']:+.4f})"
            if report.get("token_weighted_latent_gain_nats_per_token") is not None
            else ")"
        ),
    ]
    for name, f in result["factors"].items():
        own = ""
        if f["own_kmeans"] is not None and f["best_baseline"] != "encoder_kmeans":
            own = f"; k-means of its own features {f['own_kmeans']:.2f}"
        lines.append(
            f"factor {name}: NMI {f['nmi']:.2f} beside best baseline {BASELINES[f['best_baseline']]} "
            f"{f['best_baseline_nmi']:.2f}{own}"
        )
    lines.append(f"verdict: {result['verdict']} ({result['reason']})")
    return lines


def validation_verdict(
    model,
    examples,
    cache,
    pad_token_id: int,
    *,
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = False,
    scoring: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(report, judge(report))`` of ``model`` on ``examples``: :func:`evaluation.evaluate` with ``scoring``
    (default :class:`config.Scoring`, ``eval``'s), so that with ``eval``'s ``--seed`` and ``--batch-size``
    (0 and 16 by default) the numbers are the ones ``eval`` prints for the same data."""
    from .config import DEFAULT_SCORING
    from .evaluation import evaluate

    report = evaluate(
        model,
        examples,
        cache,
        pad_token_id,
        scoring=DEFAULT_SCORING if scoring is None else scoring,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
    return report, judge(report)


def train_verdict(result: Any, config: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """:func:`validation_verdict` of a finished ``trainer.train`` run (``result``, a ``TrainResult``) on its
    validation split with ``eval``'s defaults (seed, batch size, scoring: ``disentangle eval RUN`` prints the
    same numbers), reusing the run's frozen pass when it made one; None without validation examples."""
    from .features import build_feature_cache
    from .options import EvalOptions

    data = getattr(result, "data", None)  # a stand-in result without data (tests) has nothing to judge
    validation = getattr(data, "validation", None)
    if not validation or getattr(result, "pad_token_id", None) is None:
        return None
    defaults = EvalOptions()
    progress = bool(config.train.progress)
    if result.cache is not None and len(result.cache) == len(result.data.train) + len(validation):
        cache = result.cache.subset(len(result.data.train), len(result.cache))
    else:
        cache = build_feature_cache(
            result.model, validation, result.pad_token_id, defaults.batch_size, progress=progress
        )
    return validation_verdict(
        result.model,
        validation,
        cache,
        result.pad_token_id,
        seed=defaults.seed,
        batch_size=defaults.batch_size,
        progress=progress,
        scoring=defaults.scoring(),
    )
