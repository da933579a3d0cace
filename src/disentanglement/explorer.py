"""The corpus explorer (``disentangle inspect RUN --explore``): one self-contained HTML page per run.

    disentangle inspect RUN --explore [--output PAGE.html] [--data validation|train|chatterbot|FILE.jsonl]
        [--explore-examples 3] [--explore-prompts 3 | --explore-prompt TEXT ...] [--explore-tokens 16]
        [--clusters N] [--max-examples N]

At its top the page shows the run's verdict on that data (``verdict.verdict_lines``, as ``eval`` prints it:
code usage or active units, latent gain, each factor's NMI beside its best baseline, then collapsed / matches
clustering of its own features / beats every baseline). Below it, one section per **group** of the data:

- discrete latents: per slot, every code of the codebook (a code no example takes is shown too, empty);
  an example belongs to code ``k`` of slot ``m`` when its argmax code there is ``k``
  (``encode.encode_examples``' ``codes``);
- continuous latents: every cluster of a seeded k-means of the posterior means ``mu``
  (``metrics.kmeans_assignments``) with ``--clusters`` clusters (default: as many as the first label
  factor has values, else 8; at most the number of examples).

Per group: its share of the data (per slot, the shares sum to 1), the mean KL and latent gain of its
examples, its label distribution per factor (a string label is the factor ``label``; unlabelled examples
are counted apart) beside each value's base rate (its share of all the page's data: the share a group shows
by chance), its most confident examples (discrete: the highest posterior probability of the code,
as ``latent_file.code_examples``; continuous: the nearest posterior means to the cluster's centroid), each with
its response tokens coloured as ``inspect`` colours one example (:func:`inspection.token_values`; a
selector switches the quantity: z-free surprisal ``b_t``, token weight ``pi_t``, gain ``b_t - l_t``, latent
gain ``prior_nll - l_t``, ...), and greedy generations under the group's latent for a few prompts (discrete:
the code in its slot, the other slots at the group's most common codes; continuous: the centroid).

Nothing on the page comes from the network; every text (prompts, responses, labels, token strings) is
HTML-escaped and the embedded data is JSON with ``<``, ``>`` and ``&`` escaped (``report.json_for_script``).

The page is built in two steps: :func:`explore` computes a plain, JSON-able dict (no model in it), and
:func:`render_explorer_html` turns such a dict into the page, so the page's content is testable by hand.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import runs
from .config import DEFAULT_SCORING, Scoring
from .data import label_factors
from .latent_space import latent_space_of
from .options import check_at_least
from .report import (
    TOKEN_COLOUR_JS,
    colour,
    colour_scale,
    format_value,
    json_for_script,
    legend_html,
    token_text_html,
)

if TYPE_CHECKING:
    from .config import RunConfig
    from .cvae_base import CVAEBase
    from .data import Example

#: The quantities the selector offers, in order (those of ``inspection.QUANTITIES``), with their legend text.
QUANTITY_LABELS = {
    "zfree_surprisal": "z-free surprisal b_t (nats)",
    "token_weight": "token weight pi_t",
    "gain": "gain b_t - l_t (z-free NLL minus posterior NLL)",
    "latent_gain": "latent gain prior NLL - l_t",
    "conditioned_nll": "posterior NLL l_t (nats)",
    "prior_nll": "prior-mixture NLL (nats)",
    "inverse_token_weight": "inverse token weight pi_inv_t",
}
DEFAULT_QUANTITY = "zfree_surprisal"
#: Quantities drawn blue-white-red around 0.
SIGNED_QUANTITIES = ("gain", "latent_gain")
#: Clusters of a continuous latent when the data has no labels and ``--clusters`` is not given.
DEFAULT_CLUSTERS = 8


# --------------------------------------------------------------------------- groups (pure)


def label_distribution(labels: Sequence[Any]) -> dict[str, Any]:
    """``{"examples", "labelled", "factors": {name: [{"value", "count", "share"}, ...]}}`` of ``labels``
    (as loaded: strings, objects of factors, or None). Shares are over the labelled examples; values
    sorted by count (descending), then by value."""
    counts: dict[str, Counter] = {}
    labelled = 0
    for label in labels:
        factors = label_factors(label)
        if factors is None:
            continue
        labelled += 1
        for name, value in factors.items():
            counts.setdefault(str(name), Counter())[str(value)] += 1
    return {
        "examples": len(labels),
        "labelled": labelled,
        "factors": {
            name: [
                {"value": value, "count": n, "share": n / labelled}
                for value, n in sorted(counter.items(), key=lambda t: (-t[1], t[0]))
            ]
            for name, counter in counts.items()
        },
    }


def discrete_groups(rows: Sequence[Mapping[str, Any]], codebook_size: int, count: int) -> list[dict[str, Any]]:
    """One group per (slot, code), slot-major, every code of ``[0, codebook_size)`` included.

    ``rows`` are rows of ``encode.encode_examples`` (``codes`` ``[M]``, ``posterior`` ``[M][K]``). Each group:
    ``{"slot", "code", "members"`` (row indices, in order), ``"share"`` (members / rows), ``"top"`` (the
    ``count`` members with the highest ``posterior[slot][code]``, ties in row order), ``"confidence"`` (their
    probabilities), ``"codes"`` (the latent generated under: ``code`` in ``slot``, the members' most common
    code in each other slot, or the data's when the group is empty)}``.
    """
    if not rows:
        raise ValueError("the explorer needs at least one example")
    M = len(rows[0]["codes"])
    overall = [_most_common([int(r["codes"][m]) for r in rows]) for m in range(M)]
    groups = []
    for slot in range(M):
        for code in range(codebook_size):
            members = [i for i, r in enumerate(rows) if int(r["codes"][slot]) == code]
            ranked = sorted(members, key=lambda i: (-float(rows[i]["posterior"][slot][code]), i))[:count]
            codes = [
                code if m == slot else _most_common_or([int(rows[i]["codes"][m]) for i in members], overall[m])
                for m in range(M)
            ]
            groups.append(
                {
                    "slot": slot,
                    "code": code,
                    "members": members,
                    "share": len(members) / len(rows),
                    "top": ranked,
                    "confidence": [float(rows[i]["posterior"][slot][code]) for i in ranked],
                    "codes": codes,
                }
            )
    return groups


def _most_common(values: Sequence[int]) -> int | None:
    """The most common value (the smallest on ties), None for no values."""
    if not values:
        return None
    counts = Counter(values)
    return min(counts, key=lambda v: (-counts[v], v))


def _most_common_or(values: Sequence[int], default: int) -> int:
    """:func:`_most_common` of ``values``, ``default`` when there are none (code 0 is a code, not "none")."""
    found = _most_common(values)
    return default if found is None else found


def cluster_groups(mu: Sequence[Sequence[float]], num_clusters: int, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """One group per k-means cluster of the posterior means ``mu`` ``[E, D]`` (seeded, as eval's).

    Each group: ``{"cluster", "members", "share", "top"`` (the ``count`` members nearest the centroid),
    ``"confidence"`` (their negated Euclidean distance to it, so higher is more typical),
    ``"centroid"`` (the members' mean ``mu``, the latent generated under)}``.
    """
    import numpy as np

    from .metrics import kmeans_assignments

    x = np.asarray(mu, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"mu must be [E, D] with E >= 1, got shape {x.shape}")
    ids = kmeans_assignments(x, num_clusters, seed=seed)
    groups = []
    for cluster in range(num_clusters):
        members = [int(i) for i in np.flatnonzero(ids == cluster)]
        centroid = x[members].mean(0) if members else x.mean(0)
        distance = np.linalg.norm(x[members] - centroid, axis=1) if members else np.zeros(0)
        ranked = sorted(range(len(members)), key=lambda j: (float(distance[j]), members[j]))[:count]
        groups.append(
            {
                "cluster": cluster,
                "members": members,
                "share": len(members) / x.shape[0],
                "top": [members[j] for j in ranked],
                "confidence": [-float(distance[j]) for j in ranked],
                "centroid": [float(v) for v in centroid],
            }
        )
    return groups


def default_clusters(labels: Sequence[Any], examples: int) -> int:
    """``--clusters`` when not given: as many as the first label factor has values (labelled data), else
    :data:`DEFAULT_CLUSTERS`; at most ``examples``."""
    first = next((label_factors(label) for label in labels if label is not None), None)
    if first:
        name = next(iter(first))
        values = {str((label_factors(label) or {}).get(name)) for label in labels if label is not None}
        wanted = len(values)
    else:
        wanted = DEFAULT_CLUSTERS
    return max(1, min(wanted, examples))


# --------------------------------------------------------------------------- computing the page's data


def _check_options(examples: int, prompts: int, tokens: int, clusters: int | None) -> None:
    check_at_least("--explore-examples", examples, 1)
    check_at_least("--explore-prompts", prompts, 0)
    check_at_least("--explore-tokens", tokens, 1)
    check_at_least("--clusters", clusters, 1, optional=True)


def explore(
    model: CVAEBase,
    tokenizer: Any,
    config: RunConfig,
    examples: Sequence[Example],
    pairs: Sequence[Any],
    *,
    examples_per_group: int = 3,
    prompts: Sequence[str] | None = None,
    num_prompts: int = 3,
    max_new_tokens: int = 16,
    clusters: int | None = None,
    scoring: Scoring = DEFAULT_SCORING,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = False,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The explorer's data (a JSON-able dict, the input of :func:`render_explorer_html`).

    ``examples`` and ``pairs`` (their raw texts, ``encode.raw_pairs``) are in the same order. ``prompts``
    are the prompts generated for; when None, the first ``num_prompts`` distinct prompts of ``pairs``.
    Generation is greedy, ``max_new_tokens`` tokens at most. ``scoring``: the prior mixture's samples
    (default :class:`config.Scoring`; one posterior sample). Deterministic given ``seed``.
    """
    from .inspection import QUANTITIES
    from .verdict import verdict_lines

    _check_options(examples_per_group, num_prompts, max_new_tokens, clusters)
    if not examples or len(pairs) != len(examples):
        raise ValueError(f"{len(pairs)} pairs for {len(examples)} examples; the explorer needs one pair per example")
    rows, report, judged = _encode_and_judge(model, tokenizer, examples, pairs, scoring, batch_size, seed, progress)
    space = model.latent_space
    labels = [r["label"] for r in rows]
    groups = space.explorer_groups(rows, examples_per_group, clusters, seed)
    if prompts is None:
        prompts = list(dict.fromkeys(p.prompt for p in pairs))[:num_prompts]
    prompts = [str(p) for p in prompts]
    latents = [g["generate_under"] for g in groups]
    generations = _generate_for_groups(
        model, tokenizer, config, prompts, latents, max_new_tokens, batch_size, seed, progress
    )
    shown, page_examples = _page_examples(model, tokenizer, examples, rows, groups, scoring, seed)
    out_groups = [
        _page_group(g, rows, labels, shown, prompts, generations[index * len(prompts) : (index + 1) * len(prompts)])
        for index, g in enumerate(groups)
    ]
    return {
        "title": "Corpus explorer",
        "meta": dict(meta or {}),
        "latent": space.kind,
        "examples_total": len(rows),
        "verdict": {"verdict": judged["verdict"], "reason": judged["reason"], "lines": verdict_lines(report, judged)},
        "labels": label_distribution(labels),
        "quantities": [q for q in QUANTITY_LABELS if q in QUANTITIES],
        "default": DEFAULT_QUANTITY,
        "groups": out_groups,
        "examples": page_examples,
        "generation": {"greedy": True, "max_new_tokens": max_new_tokens, "prompts": prompts},
    }


def _encode_and_judge(
    model: CVAEBase,
    tokenizer: Any,
    examples: Sequence[Example],
    pairs: Sequence[Any],
    scoring: Scoring,
    batch_size: int,
    seed: int,
    progress: bool,
) -> tuple[list[dict[str, Any]], dict, dict]:
    """The explorer's encode rows of ``examples`` (one posterior sample) and the validation verdict on them:
    ``(rows, report, judged)``, one frozen pass shared."""
    from .encode import encode_examples
    from .features import build_feature_cache
    from .verdict import validation_verdict

    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, batch_size, progress=progress)
    rows = encode_examples(
        model,
        examples,
        cache,
        tokenizer.pad_token_id,
        pairs=pairs,
        scoring=dataclasses.replace(scoring, iw_samples=1),
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
    # eval's scoring (its importance samples too), so that the verdict's numbers are eval's on the same data
    verdict_scoring = dataclasses.replace(scoring, iw_samples=DEFAULT_SCORING.iw_samples)
    report, judged = validation_verdict(
        model,
        examples,
        cache,
        tokenizer.pad_token_id,
        seed=seed,
        batch_size=batch_size,
        scoring=verdict_scoring,
        progress=progress,
    )
    return rows, report, judged


def _generate_for_groups(
    model: CVAEBase,
    tokenizer: Any,
    config: RunConfig,
    prompts: list[str],
    latents: list[Any],
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    progress: bool,
) -> list[str]:
    """Greedy responses to every prompt under every group's latent, group-major (none without prompts)."""
    import torch

    from .encode import latent_vector
    from .generation import SamplingOptions, encode_prompts, generate_texts

    if not prompts:
        return []
    device = next(model.parameters()).device
    sampling = SamplingOptions(greedy=True, max_new_tokens=max_new_tokens, seed=seed)
    prompt_ids = encode_prompts(prompts, tokenizer, config.data)
    vectors = torch.stack([latent_vector(model, latent) for latent in latents])  # [G, L]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        return generate_texts(
            model,
            tokenizer,
            [ids for _ in latents for ids in prompt_ids],
            vectors.repeat_interleave(len(prompts), dim=0),
            sampling,
            batch_size=batch_size,
            progress=progress,
        )


def _page_examples(
    model: CVAEBase,
    tokenizer: Any,
    examples: Sequence[Example],
    rows: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    scoring: Scoring,
    seed: int,
) -> tuple[dict[int, int], list[dict[str, Any]]]:
    """The examples the groups show, each once, with its per-token quantities: ``(shown, page_examples)``,
    ``shown`` mapping a row index to its position in ``page_examples``."""
    from .inspection import QUANTITIES, token_values

    shown: dict[int, int] = {}  # row index -> position in the page's examples
    page_examples: list[dict[str, Any]] = []
    for g in groups:
        for i in g["top"]:
            if i in shown:
                continue
            tokens, values, _ = token_values(model, tokenizer, examples[i], scoring=scoring, seed=seed)
            shown[i] = len(page_examples)
            page_examples.append(
                {
                    "row": i,
                    "source": rows[i]["source"],
                    "prompt": rows[i]["prompt"],
                    "response": rows[i]["response"],
                    "label": rows[i]["label"],
                    "tokens": tokens,
                    "values": {q: values[q] for q in QUANTITIES},
                }
            )
    return shown, page_examples


def _page_group(
    g: dict[str, Any],
    rows: list[dict[str, Any]],
    labels: list[Any],
    shown: dict[int, int],
    prompts: list[str],
    generations: list[str],
) -> dict[str, Any]:
    """One group of the page: its members' statistics and labels, its examples and its ``generations``
    (one per prompt)."""
    members = g["members"]
    return {
        "id": g["id"],
        "title": g["title"],
        "slot": g.get("slot"),
        "code": g.get("code"),
        "cluster": g.get("cluster"),
        "count": len(members),
        "share": g["share"],
        "mean_kl": _mean([rows[i]["kl"] for i in members]),
        "mean_latent_gain": _mean([rows[i]["latent_gain_nats_per_token"] for i in members]),
        "labels": label_distribution([labels[i] for i in members]),
        "latent": g["latent"],
        "examples": [{"example": shown[i], "confidence": c} for i, c in zip(g["top"], g["confidence"], strict=True)],
        "generations": [{"prompt": p, "text": generations[j]} for j, p in enumerate(prompts)],
    }


def _mean(values: Sequence[float]) -> float | None:
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(finite) / len(finite) if finite else None


# --------------------------------------------------------------------------- rendering (pure)


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em; color: #222; max-width: 80em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin: 0 0 0.4em 0; } h3 { font-size: 1em; margin: 0.8em 0 0.3em 0; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.3em 0; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
.controls { position: sticky; top: 0; background: #fff; padding: 0.5em 0; border-bottom: 1px solid #ddd; z-index: 1; }
.legend { display: inline-flex; align-items: center; gap: 0.4em; margin-left: 1.5em; font-size: 0.9em; }
.legend .bar { display: inline-block; width: 12em; height: 0.9em; border: 1px solid #999; }
.legend .swatch { display: inline-block; width: 0.9em; height: 0.9em; border: 1px solid #999; }
.legend .range { color: #666; }
section.group { border: 1px solid #bbb; border-radius: 4px; padding: 0.8em; margin: 1em 0; }
section.group.empty { opacity: 0.75; }
.sharebar { display: inline-block; height: 0.8em; background: #4a7bd0; vertical-align: middle; }
.stats { font-size: 0.9em; color: #444; }
.example { margin: 0.5em 0; }
.example .head { font-size: 0.85em; color: #555; }
.tokens { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; line-height: 1.7;
  border: 1px solid #ddd; padding: 0.4em; word-break: break-word; }
span.tok { border-radius: 2px; padding: 0 0.5px; }
span.tok:hover { outline: 1px solid #333; }
.verdict { border: 2px solid #4a7bd0; border-radius: 4px; padding: 0.3em 0.8em; margin: 0.5em 0 1em 0; }
.verdict ul { margin: 0.2em 0; font-size: 0.9em; }
td.base-rate { color: #666; }
.gen { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; }
"""

_JS = (
    """
(function () {
  var data = JSON.parse(document.getElementById("explorer-data").textContent);
  var select = document.getElementById("quantity");
  var spans = document.querySelectorAll("span.tok");
"""
    + TOKEN_COLOUR_JS
    + """  function update() {
    var key = select.value, sc = data.scales[key];
    for (var i = 0; i < spans.length; i++) {
      var e = Number(spans[i].getAttribute("data-e")), t = Number(spans[i].getAttribute("data-i"));
      spans[i].style.backgroundColor = colour(data.values[e][key][t], sc);
    }
    legend(sc);
    document.body.setAttribute("data-quantity", key);
  }
  select.addEventListener("change", update);
  update();
})();
"""
)


def _esc(value: Any) -> str:
    """Any value as escaped text (strings as they are, the rest as JSON)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return html.escape(text, quote=True)


def _number(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _scales(page: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """One colour scale per quantity over every token on the page, so that colours compare across examples."""
    scales = {}
    for q in page["quantities"]:
        values = [v for e in page["examples"] for v in e["values"][q]]
        values = [float(v) if v is not None and math.isfinite(float(v)) else None for v in values]
        scales[q] = colour_scale(values, q in SIGNED_QUANTITIES)
    return scales


def _clean(values: Sequence[Any]) -> list[float | None]:
    return [float(v) if v is not None and math.isfinite(float(v)) else None for v in values]


def base_rates(page: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per factor, each value's share of the whole page's labelled data (``page["labels"]``; empty for a page
    without it): the share a group would show by chance."""
    overall = page.get("labels") or {"factors": {}}
    return {name: {v["value"]: v["share"] for v in values} for name, values in overall["factors"].items()}


def _base_rate(rates: Mapping[str, Mapping[str, float]], name: str, value: str) -> str:
    rate = rates.get(name, {}).get(value)
    return "" if rate is None else f" (base rate {rate:.2f})"


def _label_html(labels: Mapping[str, Any], rates: Mapping[str, Mapping[str, float]] | None = None) -> str:
    if not labels["factors"]:
        return '<p class="stats">no labels</p>'
    rates = rates or {}
    parts = []
    unlabelled = labels["examples"] - labels["labelled"]
    for name, values in labels["factors"].items():
        with_rates = name in rates
        rows = "".join(
            f"<tr><td>{_esc(v['value'])}</td><td>{v['count']}</td><td>{v['share']:.3f} "
            f'<span class="sharebar" style="width:{6 * v["share"]:.2f}em"></span></td>'
            + (f'<td class="base-rate">{rates[name].get(v["value"], 0.0):.3f}</td>' if with_rates else "")
            + "</tr>"
            for v in values
        )
        head = "<tr><th>value</th><th>examples</th><th>share</th>" + (
            "<th>base rate (all data)</th></tr>" if with_rates else "</tr>"
        )
        parts.append(
            f'<table class="labels" data-factor="{_esc(name)}"><tr><th colspan="{4 if with_rates else 3}">'
            f"factor {_esc(name)}</th></tr>{head}{rows}</table>"
        )
    note = f'<p class="stats">{unlabelled} unlabelled</p>' if unlabelled else ""
    return '<div class="label-tables">' + "".join(parts) + "</div>" + note


def _example_html(index: int, example: Mapping[str, Any], confidence: float, page: Mapping[str, Any], scales) -> str:
    default = page["default"]
    values = _clean(example["values"][default])
    spans = []
    for t, token in enumerate(example["tokens"]):
        tip = "\n".join(
            [f"#{t} {token!r}"]
            + [f"{q}: {format_value(_clean([example['values'][q][t]])[0])}" for q in page["quantities"]]
        )
        style = f"background-color:{colour(values[t], scales[default])}"
        spans.append(
            f'<span class="tok" data-e="{index}" data-i="{t}" title="{_esc(tip)}" style="{style}">'
            f"{token_text_html(str(token))}</span>"
        )
    what = latent_space_of(page["latent"]).confidence
    label = "" if example["label"] is None else f" · label {_esc(example['label'])}"
    return (
        f'<div class="example" data-example="{index}"><div class="head">{_esc(example["source"])}{label} · '
        f"{what} {confidence:.3f}</div>"
        f'<div class="head">prompt: <span class="prompt">{_esc(example["prompt"] or "")}</span></div>'
        f'<div class="tokens">{"".join(spans)}</div></div>'
    )


def _group_html(group: Mapping[str, Any], page: Mapping[str, Any], scales) -> str:
    examples = "".join(
        _example_html(e["example"], page["examples"][e["example"]], e["confidence"], page, scales)
        for e in group["examples"]
    )
    if not examples:
        examples = '<p class="stats">no example of the data is in this group</p>'
    generations = "".join(
        f'<tr><td class="gen">{_esc(g["prompt"])}</td><td class="gen generation">{_esc(g["text"])}</td></tr>'
        for g in group["generations"]
    )
    generated = (
        f"<table><tr><th>prompt</th><th>generated under this latent</th></tr>{generations}</table>"
        if generations
        else '<p class="stats">no prompts</p>'
    )
    empty = " empty" if group["count"] == 0 else ""
    return (
        f'<section class="group{empty}" id="group-{_esc(group["id"])}" data-group="{_esc(group["id"])}" '
        f'data-share="{group["share"]:.6f}">'
        f"<h2>{_esc(group['title'])}</h2>"
        f'<p class="stats">share {group["share"]:.3f} ({group["count"]} of {page["examples_total"]} examples) '
        f'<span class="sharebar" style="width:{10 * group["share"]:.2f}em"></span> · mean KL '
        f"{_number(group['mean_kl'])} nats · mean latent gain {_number(group['mean_latent_gain'], 4)} nats/token · "
        f"latent {_esc(group['latent'])}</p>"
        f"<h3>Labels</h3>{_label_html(group['labels'], base_rates(page))}"
        f"<h3>Most confident examples</h3>{examples}"
        f"<h3>Generations (greedy, at most {page['generation']['max_new_tokens']} tokens)</h3>{generated}"
        "</section>"
    )


def _overview_html(page: Mapping[str, Any]) -> str:
    rows = []
    rates = base_rates(page)
    for g in page["groups"]:
        top = []
        for name, values in g["labels"]["factors"].items():
            if values:
                value = values[0]["value"]
                top.append(f"{name}={value} {values[0]['share']:.2f}{_base_rate(rates, name, value)}")
        rows.append(
            f'<tr><td><a href="#group-{_esc(g["id"])}">{_esc(g["title"])}</a></td><td>{g["count"]}</td>'
            f'<td>{g["share"]:.3f} <span class="sharebar" style="width:{10 * g["share"]:.2f}em"></span></td>'
            f"<td>{_esc(', '.join(top))}</td></tr>"
        )
    return (
        '<table class="overview"><tr><th>group</th><th>examples</th><th>share</th><th>most common label</th></tr>'
        + "".join(rows)
        + "</table>"
    )


def _verdict_html(page: Mapping[str, Any]) -> str:
    """The verdict block at the top of the page (``verdict.verdict_lines``: usage, latent gain, each factor's
    NMI beside its best baseline, the verdict); empty for a page without one."""
    verdict = page.get("verdict")
    if not verdict:
        return ""
    details = "".join(f"<li>{_esc(line)}</li>" for line in verdict["lines"][:-1])
    return (
        f'<div class="verdict" id="verdict" data-verdict="{_esc(verdict["verdict"])}">'
        f"<p><b>verdict: {_esc(verdict['verdict'])}</b> ({_esc(verdict['reason'])})</p><ul>{details}</ul></div>"
    )


def render_explorer_html(page: Mapping[str, Any]) -> str:
    """The explorer page of :func:`explore`'s dict: self-contained HTML5 (inline CSS and JS, no network).

    Every token is a ``<span class="tok" data-e=E data-i=T>`` (example ``E`` of ``page["examples"]``, token
    ``T``) coloured by the selected quantity (``<select id="quantity">``; one scale per quantity over the
    whole page); every group a ``<section class="group" data-group=ID data-share=S>``.
    """
    scales = _scales(page)
    default = page["default"]
    if default not in page["quantities"]:
        raise ValueError(f"default {default!r} is not one of the quantities {page['quantities']}")
    options = "".join(
        f'<option value="{_esc(q)}"{" selected" if q == default else ""}>{_esc(QUANTITY_LABELS.get(q, q))}</option>'
        for q in page["quantities"]
    )
    meta = dict(page["meta"], latent=page["latent"], examples=page["examples_total"])
    meta_rows = "".join(f"<tr><th>{_esc(str(k))}</th><td>{_esc(v)}</td></tr>" for k, v in meta.items())
    payload = {
        "scales": scales,
        "values": [{q: _clean(e["values"][q]) for q in page["quantities"]} for e in page["examples"]],
    }
    sections = "".join(_group_html(g, page, scales) for g in page["groups"])
    title = _esc(page["title"])
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{title}</h1>\n{_verdict_html(page)}\n"
        f'<table class="meta">{meta_rows}</table>\n'
        '<div class="controls"><label for="quantity">Colour tokens by: </label>'
        f'<select id="quantity">{options}</select>'
        f"{legend_html(scales[default])}</div>\n"
        f"{_overview_html(page)}\n{sections}\n"
        f'<script type="application/json" id="explorer-data">{json_for_script(payload)}</script>\n'
        f"<script>{_JS}</script>\n</body>\n</html>\n"
    )


def write_explorer(path: str | Path, page: Mapping[str, Any], root: str | Path | None = None) -> Path:
    """Write :func:`render_explorer_html` of ``page`` to ``path`` (its folder made, every folder below
    ``root`` a real one), durably replaced, never through a symbolic link."""
    from .safe_io import atomic_write

    return atomic_write(path, render_explorer_html(page).encode("utf-8"), root)


# --------------------------------------------------------------------------- the command


def run_explore(
    checkpoint: str | Path,
    *,
    data: str | None = None,
    output: str | Path | None = None,
    examples_per_group: int = 3,
    prompts: Sequence[str] | None = None,
    num_prompts: int = 3,
    max_new_tokens: int = 16,
    clusters: int | None = None,
    max_examples: int | None = None,
    scoring: Scoring = DEFAULT_SCORING,
    seed: int = 0,
    batch_size: int = 16,
    device: str = "auto",
    progress: bool = True,
    model_and_tokenizer=None,
) -> Path:
    """Write the explorer page of ``data`` (as ``eval``'s ``--data``; default the run's validation split)
    to ``output`` (default ``RUN/inspect/explorer.html``). Options, ``data`` and ``output`` are checked
    before the model loads. Returns the path written."""
    from .encode import raw_pairs

    _check_options(examples_per_group, num_prompts, max_new_tokens, clusters)
    check_at_least("--max-examples", max_examples, 1, optional=True)
    check_at_least("--batch-size", batch_size, 1)
    if prompts is not None and any(not str(p).strip() for p in prompts):
        raise ValueError("--explore-prompt must not be empty")
    runs.check_data_option(checkpoint, data)
    run_dir = runs.resolve_run(checkpoint)[1]
    target = Path(output) if output is not None else run_dir / "inspect" / "explorer.html"
    runs.check_writable_target(target, "--output")
    if output is None:  # RUN/inspect must be a real folder of the run, not a link to elsewhere
        from .safe_io import ensure_dir

        ensure_dir(target.parent, run_dir)
    model, tokenizer, config, state, checkpoint_dir, _ = runs.load_checkpoint(checkpoint, model_and_tokenizer, device)
    examples, description = runs.load_examples(data, config, tokenizer, max_examples, seed)
    pairs = raw_pairs(data, config, examples)
    meta = {"checkpoint": str(checkpoint_dir), "step": state.get("step"), "data": description}
    page = explore(
        model,
        tokenizer,
        config,
        examples,
        pairs,
        examples_per_group=examples_per_group,
        prompts=prompts,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        clusters=clusters,
        scoring=scoring,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
        meta=meta,
    )
    return write_explorer(target, page, root=run_dir if output is None else None)
