"""Rendering of evaluation results: token heat-map pages, training curves, plots, summaries.

Nothing here needs a model: every function takes plain lists, dicts and numbers (the
output of :mod:`disentanglement.metrics` and of the trainer's metrics log). Plots use
matplotlib's Agg canvas directly (no pyplot state, no display needed).
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .safe_io import atomic_write, write_json

# Quantities that are centred on zero and drawn on a blue-white-red scale even when the
# values passed happen to be non-negative. Any quantity with a negative value is too.
DEFAULT_SIGNED_KEYS = ("gain",)
SCHEDULE_KEYS = ("temperature", "beta", "lr", "learning_rate")


# --------------------------------------------------------------------------- token heat map


def _finite_or_none(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _clean_values(tokens: Sequence[str], values: Mapping[str, Sequence[Any]]) -> dict[str, list[float | None]]:
    """Values as JSON-able lists (non-finite -> None), checked against the token count."""
    if not values:
        raise ValueError("values must hold at least one quantity")
    out: dict[str, list[float | None]] = {}
    for key, seq in values.items():
        vals = [_finite_or_none(v) for v in (seq.tolist() if hasattr(seq, "tolist") else seq)]
        if len(vals) != len(tokens):
            raise ValueError(f"values[{key!r}] has {len(vals)} entries, expected one per token ({len(tokens)})")
        out[str(key)] = vals
    return out


def colour_scale(vals: Sequence[float | None], signed: bool) -> dict[str, Any]:
    """The colour scale of one quantity over ``vals`` (None: no value), as :func:`colour` reads it: ``min``,
    ``max``, ``signed`` (asked for, or a negative value) and ``ref``, the value drawn in full colour."""
    finite = [v for v in vals if v is not None]
    lo = min(finite) if finite else 0.0
    hi = max(finite) if finite else 0.0
    signed = signed or lo < 0
    ref = max(abs(lo), abs(hi)) if signed else max(hi, 0.0)
    return {"min": lo, "max": hi, "signed": signed, "ref": ref}


def legend_ends(scale: Mapping[str, Any]) -> tuple[float, float]:
    """The values at the legend's two ends, the values :func:`colour` draws in its end colours: ``0`` (white)
    and ``ref`` (red) for a non-negative quantity, ``-ref`` (blue) and ``ref`` (red) for a signed one. (Not the
    data's minimum: a token at the minimum is coloured by ``min / ref``, white only when the minimum is 0.)"""
    ref = float(scale["ref"])
    return (-ref if scale["signed"] else 0.0, ref)


def legend_html(scale: Mapping[str, Any]) -> str:
    """The colour legend of a token page: a swatch and the value at each end of the gradient bar (both the
    colours of :func:`colour` at those values), and the data's range beside it. Ids ``legend-lo-swatch``,
    ``legend-min``, ``legend-bar``, ``legend-max``, ``legend-hi-swatch``, ``legend-range`` (the pages' script
    updates them, :data:`TOKEN_COLOUR_JS`'s ``legend``)."""
    lo, hi = legend_ends(scale)
    gradient = (
        "linear-gradient(to right, rgb(0,0,255), #fff, rgb(255,0,0))"
        if scale["signed"]
        else "linear-gradient(to right, #fff, rgb(255,0,0))"
    )
    return (
        f'<span class="legend"><span class="swatch" id="legend-lo-swatch" style="background-color:{colour(lo, scale)}">'
        f'</span><span id="legend-min">{format_value(lo)}</span>'
        f'<span class="bar" id="legend-bar" style="background:{gradient}"></span>'
        f'<span id="legend-max">{format_value(hi)}</span>'
        f'<span class="swatch" id="legend-hi-swatch" style="background-color:{colour(hi, scale)}"></span>'
        f'<span id="legend-range" class="range">(tokens range {format_value(scale["min"])} to '
        f"{format_value(scale['max'])})</span></span>"
    )


def colour(v: float | None, scale: Mapping[str, Any]) -> str:
    """Background colour: white->red by v/max, or blue-white-red by v/max|v| when signed."""
    if v is None:
        return "#e6e6e6"
    ref = scale["ref"]
    s = 0.0 if ref <= 0 else max(-1.0, min(1.0, v / ref))
    if not scale["signed"]:
        s = max(s, 0.0)
    fade = round(255 * (1.0 - abs(s)))
    return f"rgb(255,{fade},{fade})" if s >= 0 else f"rgb({fade},{fade},255)"


def _attr_name(key: str, used: set[str]) -> str:
    base = "data-" + (re.sub(r"[^a-z0-9_-]+", "-", key.lower()).strip("-") or "value")
    name, i = base, 1
    while name in used or name in ("data-i", "data-token"):
        i += 1
        name = f"{base}-{i}"
    used.add(name)
    return name


def token_text_html(token: str) -> str:
    """Escaped token text with visible line breaks (``\\n`` -> ``↵`` + ``<br>``)."""
    text = html.escape(token.replace("\r", "\u240d"), quote=True)
    return text.replace("\n", "\u21b5<br>")


def format_value(v: float | None) -> str:
    """A token value as the pages show it: four significant digits, ``n/a`` for None."""
    return "n/a" if v is None else f"{v:.4g}"


def save_figure(fig: Any, path: str | Path, **kwargs: Any) -> Path:
    """``fig.savefig`` into memory, then :func:`safe_io.atomic_write` (never through a symbolic link)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png", **kwargs)
    return atomic_write(path, buffer.getvalue())


def json_for_script(obj: Any) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>`` and ``&`` as ``\\u`` escapes (so no ``</``)."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; }
table.meta { border-collapse: collapse; margin-bottom: 1em; font-size: 0.9em; }
table.meta td, table.meta th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
.controls { margin: 0.5em 0 1em 0; }
.legend { display: inline-flex; align-items: center; gap: 0.4em; margin-left: 1.5em; font-size: 0.9em; }
.legend .bar { display: inline-block; width: 12em; height: 0.9em; border: 1px solid #999; }
.legend .swatch { display: inline-block; width: 0.9em; height: 0.9em; border: 1px solid #999; }
.legend .range { color: #666; }
#tokens { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; line-height: 1.7;
  border: 1px solid #ddd; padding: 0.8em; word-break: break-word; }
span.tok { border-radius: 2px; padding: 0 0.5px; }
span.tok:hover { outline: 1px solid #333; }
"""

#: The token colouring of :func:`colour` in JavaScript (blue-white-red on a quantity's scale), shared by the
#: inspect page and the explorer page.
TOKEN_COLOUR_JS = """  function colour(v, sc) {
    if (v === null || v === undefined) { return "#e6e6e6"; }
    var s = sc.ref <= 0 ? 0 : Math.max(-1, Math.min(1, v / sc.ref));
    if (!sc.signed) { s = Math.max(s, 0); }
    var f = Math.round(255 * (1 - Math.abs(s)));
    return s >= 0 ? "rgb(255," + f + "," + f + ")" : "rgb(" + f + "," + f + ",255)";
  }
  function fmt(v) { return v === null ? "n/a" : Number(v.toPrecision(4)).toString(); }
  function legend(sc) {
    var lo = sc.signed ? -sc.ref : 0, hi = sc.ref;
    document.getElementById("legend-min").textContent = fmt(lo);
    document.getElementById("legend-max").textContent = fmt(hi);
    document.getElementById("legend-lo-swatch").style.backgroundColor = colour(lo, sc);
    document.getElementById("legend-hi-swatch").style.backgroundColor = colour(hi, sc);
    document.getElementById("legend-range").textContent = "(tokens range " + fmt(sc.min) + " to " + fmt(sc.max) + ")";
    document.getElementById("legend-bar").style.background = sc.signed
      ? "linear-gradient(to right, rgb(0,0,255), #fff, rgb(255,0,0))"
      : "linear-gradient(to right, #fff, rgb(255,0,0))";
  }
"""

_JS = (
    """
(function () {
  var data = JSON.parse(document.getElementById("token-data").textContent);
  var select = document.getElementById("quantity");
  var spans = document.querySelectorAll("#tokens span.tok");
"""
    + TOKEN_COLOUR_JS
    + """  function update() {
    var key = select.value, vals = data.values[key], sc = data.scales[key];
    for (var i = 0; i < spans.length; i++) {
      spans[i].style.backgroundColor = colour(vals[Number(spans[i].getAttribute("data-i"))], sc);
    }
    legend(sc);
  }
  select.addEventListener("change", update);
  update();
})();
"""
)


def render_token_html(
    tokens: Sequence[str],
    values: Mapping[str, Sequence[float]],
    title: str,
    meta: Mapping[str, Any] | None = None,
    default: str | None = None,
    signed_keys: Iterable[str] = DEFAULT_SIGNED_KEYS,
) -> str:
    """A self-contained HTML5 page colouring each token by a selectable per-token quantity.

    ``tokens`` are the decoded tokens in order (``[T]``); ``values`` maps a quantity name
    (e.g. ``zfree_surprisal``, ``token_weight``, ``conditioned_nll``, ``gain``) to ``T``
    numbers; non-finite numbers are shown as "n/a" (grey). ``default`` is the quantity
    selected on load (the first key when None). Non-negative quantities go white -> red by
    ``value / max``; quantities in ``signed_keys`` or with any negative value go
    blue-white-red around 0 by ``value / max|value|``. Every token is one
    ``<span class="tok">`` with ``data-i`` (its index), ``data-token`` and one ``data-*``
    attribute per quantity, and a tooltip; the values are also embedded as JSON in
    ``<script type="application/json" id="token-data">``. No network resources are used. The legend's ends
    are labelled with the values drawn in their colours (:func:`legend_html`): 0 and the maximum, or
    minus and plus the largest magnitude when signed; the data's range is shown beside it.
    """
    tokens = [str(t) for t in tokens]
    vals = _clean_values(tokens, values)
    keys = list(vals)
    if default is None:
        default = keys[0]
    if default not in vals:
        raise ValueError(f"default {default!r} is not one of the quantities {keys}")
    signed = set(signed_keys)
    scales = {k: colour_scale(v, k in signed) for k, v in vals.items()}
    used: set[str] = set()
    attr = {k: _attr_name(k, used) for k in keys}
    esc = html.escape

    spans = []
    for i, tok in enumerate(tokens):
        tip = "\n".join([f"#{i} {tok!r}"] + [f"{k}: {format_value(vals[k][i])}" for k in keys])
        data_attrs = " ".join(f'{attr[k]}="{format_value(vals[k][i])}"' for k in keys)
        style = f"background-color:{colour(vals[default][i], scales[default])}"
        spans.append(
            f'<span class="tok" data-i="{i}" data-token="{esc(tok)}" {data_attrs} '
            f'title="{esc(tip)}" style="{style}">{token_text_html(tok)}</span>'
        )

    options = "".join(f'<option value="{esc(k)}"{" selected" if k == default else ""}>{esc(k)}</option>' for k in keys)
    meta_rows = "".join(
        f"<tr><th>{esc(str(k))}</th><td>{esc(v if isinstance(v, str) else json.dumps(v, default=str))}</td></tr>"
        for k, v in (meta or {}).items()
    )
    meta_html = f'<table class="meta">{meta_rows}</table>' if meta_rows else ""
    payload = {
        "title": title,
        "meta": dict(meta or {}),
        "tokens": tokens,
        "values": vals,
        "default": default,
        "scales": scales,
    }
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{esc(title)}</h1>\n{meta_html}\n"
        '<div class="controls"><label for="quantity">Colour by: </label>'
        f'<select id="quantity">{options}</select>'
        f"{legend_html(scales[default])}</div>\n"
        f'<div id="tokens">{"".join(spans)}</div>\n'
        f'<script type="application/json" id="token-data">{json_for_script(payload)}</script>\n'
        f"<script>{_JS}</script>\n</body>\n</html>\n"
    )


def write_token_report(
    path_html: str | Path,
    tokens: Sequence[str],
    values: Mapping[str, Sequence[float]],
    title: str,
    meta: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write :func:`render_token_html` to ``path_html`` and a JSON sidecar next to it.

    The sidecar (same stem, ``.json``) holds ``{"title", "meta", "tokens", "values"}`` with
    the same numbers as the page (non-finite values as null). Returns ``(html, json)`` paths.
    """
    path_html = Path(path_html)
    path_html.parent.mkdir(parents=True, exist_ok=True)
    tokens = [str(t) for t in tokens]
    vals = _clean_values(tokens, values)
    atomic_write(path_html, render_token_html(tokens, vals, title, meta))
    path_json = path_html.with_suffix(".json")
    sidecar = {"title": title, "meta": dict(meta or {}), "tokens": tokens, "values": vals}
    write_json(path_json, sidecar, ensure_ascii=False, default=str, indent=1)
    return path_html, path_json


# --------------------------------------------------------------------------- metrics log and plots


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics log, one JSON object per line (blank lines skipped).

    Raises ``ValueError`` naming the file and line number on a malformed line; a partial last line
    (no newline after it: a run killed while writing it) is left out.
    """
    path = Path(path)
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    partial_last = lines[-1] != ""  # a run killed while writing its last line
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if partial_last and lineno == len(lines):
                continue  # the trainer drops it on resume, too
            raise ValueError(f"{path}: line {lineno}: invalid JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {lineno}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def _new_figure(figsize: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _series(metrics: Sequence[Mapping[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Numeric key -> (steps, values), finite values only; keys without any are dropped."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for i, record in enumerate(metrics):
        step = record.get("step", i)
        if not _is_number(step):
            step = i
        for key, v in record.items():
            if key == "step" or not _is_number(v) or not math.isfinite(v):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(float(step))
            ys.append(float(v))
    return series


def _is_schedule_key(key: str) -> bool:
    return re.split(r"[/.]", key.lower())[-1] in SCHEDULE_KEYS


def _grid_figure(series: Mapping[str, tuple[list[float], list[float]]], keys: Sequence[str], path: Path) -> Path:
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = _new_figure((4.2 * ncols, 2.8 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        xs, ys = series[key]
        ax.plot(xs, ys, marker="." if len(xs) < 30 else None, linewidth=1.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        _no_offset(ax)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    save_figure(fig, path, dpi=100)
    return path


#: The six reconstruction terms (docs/design.md section 4, numbered as there) and their short names in the legend.
TERM_LABELS = {
    "reconstruction_loss": "1 token mean",
    "sequence_reconstruction_loss": "2 sequence",
    "token_weighted_reconstruction_loss": "3 token-weighted",
    "normalized_concentration_corrected_token_weighted_reconstruction_loss": "4 concentration-corrected",
    "normalized_inverse_surprisal_token_weighted_reconstruction_loss": "5 inverse-surprisal",
    "zfree_relative_reconstruction_loss": "6 z-free relative",
}
#: The parts of the objective, drawn in its panel.
OBJECTIVE_KEYS = (
    "loss",
    "reconstruction_total",
    "kl_term",
    "divergence_term",
    "codebook_loss",
    "commitment_loss",
    "decoder_posterior_loss",
)
#: The validation numbers drawn (as lines with markers) in the validation panel.
VALIDATION_KEYS = ("val_loss", "val_reconstruction_total", "val_kl")
#: At this many KL units or more, ``kl.png`` draws the largest few as lines and every unit as a heat map.
KL_HEATMAP_UNITS = 8
#: Units drawn as lines above the heat map.
KL_TOP_UNITS = 5
_UNIT_KEY = re.compile(r"kl(_objective)?_unit_(\d+)$")
#: The panels of ``training_curves.png``, in this order (titles; see :func:`training_panels`).
PANEL_TITLES = (
    "objective (nats)",
    "reconstruction terms 1-6",
    "KL (nats) and beta",
    "codes",
    "posterior",
    "learning rates and gradient norm",
    "validation",
    "other",
)


def _panel_of(key: str) -> str | None:
    """The title of the panel ``key`` is drawn in (None: not in ``training_curves.png``)."""
    last = re.split(r"[/.]", key.lower())[-1]
    if _UNIT_KEY.match(key):
        return None  # per unit: kl.png
    if key.startswith("val_"):
        return "validation" if key in VALIDATION_KEYS else None
    if key in OBJECTIVE_KEYS:
        return "objective (nats)"
    if key in TERM_LABELS:
        return "reconstruction terms 1-6"
    if "kl" in key or last in ("beta", "temperature"):
        return "KL (nats) and beta"
    if key.startswith(("codes_used", "code_perplexity", "dead_codes")):
        return "codes"
    if key.startswith("posterior_"):
        return "posterior"
    if last in ("lr", "learning_rate", "grad_norm") or last.startswith("lr_"):
        return "learning rates and gradient norm"
    return "other"


def training_panels(keys: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The panels of ``training_curves.png`` for the metrics log's numeric ``keys``: ``[(title, keys), ...]`` in
    the fixed order of :data:`PANEL_TITLES`, empty panels left out (at most seven, plus beta's right axis):

    the objective and its additive parts; the six reconstruction terms (log scale); KL with beta and
    temperature on a right axis; codes used and code perplexity per slot (discrete); the posterior's spread
    (continuous); learning rates and gradient norm (log scale); validation loss, reconstruction and KL (lines
    with markers, the training loss beside them); anything else. Per-unit KL keys go to ``kl.png``.
    """
    panels: dict[str, list[str]] = {title: [] for title in PANEL_TITLES}
    for key in keys:
        title = _panel_of(key)
        if title is not None:
            panels[title].append(key)
    if panels["validation"] and "loss" in keys:
        panels["validation"].append("loss")
    order = {key: i for i, key in enumerate(("loss", *OBJECTIVE_KEYS[1:], *TERM_LABELS, *VALIDATION_KEYS))}
    return [(title, sorted(found, key=lambda k: order.get(k, len(order)))) for title, found in panels.items() if found]


def _no_offset(ax) -> None:
    """Plain tick labels: no "1e-5+9.915e-1" offset (linear axes; log axes have none)."""
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):
        formatter = axis.get_major_formatter()
        if isinstance(formatter, ScalarFormatter):
            formatter.set_useOffset(False)


def _draw_panel(ax, title: str, keys: Sequence[str], series) -> None:
    right = None
    for key in keys:
        xs, ys = series[key]
        label = TERM_LABELS.get(key, key)
        if title == "KL (nats) and beta" and re.split(r"[/.]", key.lower())[-1] in ("beta", "temperature"):
            if right is None:
                right = ax.twinx()
                right.set_ylabel("beta", fontsize=8)
                right.tick_params(labelsize=7)
            right.plot(xs, ys, linewidth=1.0, linestyle="--", color="#555", label=key)
            continue
        if title == "validation":
            if key == "loss":
                ax.plot(xs, ys, linewidth=0.8, color="#bbb", label="loss (training)")
            else:
                ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.2, label=key)
            continue
        ax.plot(xs, ys, marker="." if len(xs) < 30 else None, linewidth=1.2, label=label)
    values = [y for key in keys for y in series[key][1]]
    if title in ("reconstruction terms 1-6", "learning rates and gradient norm") and values and max(values) > 0:
        ax.set_yscale("log", nonpositive="mask")  # a learning rate of 0 (warm-up start, decay end) is not drawn
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
        _no_offset(right)
    if 1 < len(labels) <= 8 or (right is not None and labels):
        ax.legend(handles, labels, fontsize=7)
    _no_offset(ax)


def _training_figure(series, path: Path) -> Path:
    panels = training_panels(list(series))
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = _new_figure((6.0 * ncols, 3.2 * nrows))
    for i, (title, keys) in enumerate(panels):
        _draw_panel(fig.add_subplot(nrows, ncols, i + 1), title, keys, series)
    save_figure(fig, path, dpi=100)
    return path


def _unit_keys(keys: Sequence[str]) -> list[str]:
    """The per-unit KL keys ``kl_unit_<i>`` (not the objective's, nor validation's), in unit order."""
    found = [(int(m.group(2)), k) for k in keys if (m := _UNIT_KEY.match(k)) and m.group(1) is None]
    return [k for _, k in sorted(found)]


def _kl_figure(series, keys: Sequence[str], path: Path) -> Path | None:
    """``kl.png``: every KL key on one axes, or with :data:`KL_HEATMAP_UNITS` units or more the largest
    :data:`KL_TOP_UNITS` units as lines (by their last value) and a heat map of every unit over the steps."""
    units = _unit_keys(keys)
    if len(units) < KL_HEATMAP_UNITS:
        kl_keys = [k for k in keys if "kl" in k.lower() and not k.startswith("val_") and not _objective_unit(k)]
        if not kl_keys:
            return None
        fig = _new_figure((7.0, 4.0))
        ax = fig.add_subplot()
        for key in kl_keys:
            ax.plot(*series[key], label=key, linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("nats")
        ax.set_title("KL terms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        _no_offset(ax)
        save_figure(fig, path, dpi=100)
        return path
    import numpy as np

    steps = sorted({x for key in units for x in series[key][0]})
    column = {x: j for j, x in enumerate(steps)}
    grid = np.full((len(units), len(steps)), np.nan)
    for i, key in enumerate(units):
        for x, y in zip(*series[key], strict=True):
            grid[i, column[x]] = y
    last = [series[key][1][-1] for key in units]
    top = sorted(range(len(units)), key=lambda i: -last[i])[:KL_TOP_UNITS]
    fig = _new_figure((9.0, 7.0))
    lines, heat = fig.subplots(2, 1)
    for i in top:
        lines.plot(*series[units[i]], linewidth=1.2, label=f"unit {_UNIT_KEY.match(units[i]).group(2)}")
    lines.set_title(f"KL per unit: the {len(top)} largest of {len(units)} (by the last step)", fontsize=10)
    lines.set_xlabel("step", fontsize=8)
    lines.set_ylabel("nats", fontsize=8)
    lines.grid(alpha=0.3)
    lines.legend(fontsize=7)
    _no_offset(lines)
    image = heat.imshow(
        grid,
        aspect="auto",
        cmap="viridis",
        interpolation="nearest",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(units) - 0.5, -0.5),
    )
    fig.colorbar(image, ax=heat, label="nats")
    heat.set_title(f"KL per unit, all {len(units)}", fontsize=10)
    heat.set_xlabel("step", fontsize=8)
    heat.set_ylabel("unit (dimension or slot)", fontsize=8)
    save_figure(fig, path, dpi=100)
    return path


def _objective_unit(key: str) -> bool:
    match = _UNIT_KEY.match(key)
    return match is not None and match.group(1) is not None


def plot_training_curves(metrics: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """Training-curve PNGs from a metrics log (a list of per-step dicts).

    Writes ``training_curves.png`` (at most seven panels in a fixed order, :func:`training_panels`; x = step,
    or the record index when a record has no step; plain tick labels, never an offset), ``kl.png`` (every
    KL key on one axes; with :data:`KL_HEATMAP_UNITS` per-unit keys ``kl_unit_<i>`` or more, the largest
    :data:`KL_TOP_UNITS` as lines above a heat map of all) and ``schedules.png`` (keys named temperature,
    beta, lr or learning_rate, possibly after a ``/`` or ``.`` prefix, one panel each), each only when it has
    something to draw. Non-finite values are skipped; so are keys with no finite value. Returns the paths
    written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    series = _series(metrics)
    written: list[Path] = []
    if not series:
        return written
    keys = list(series)
    if training_panels(keys):
        written.append(_training_figure(series, out_dir / "training_curves.png"))
    kl = _kl_figure(series, keys, out_dir / "kl.png")
    if kl is not None:
        written.append(kl)
    schedule_keys = [k for k in keys if _is_schedule_key(k)]
    if schedule_keys:
        written.append(_grid_figure(series, schedule_keys, out_dir / "schedules.png"))
    return written


def plot_code_usage(usage_per_slot: Sequence[Mapping[str, Any]], out_path: str | Path) -> Path:
    """Bar chart of code counts, one row per slot, from :func:`metrics.code_usage_per_slot` dicts."""
    if not usage_per_slot:
        raise ValueError("usage_per_slot is empty")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    n = len(usage_per_slot)
    fig = _new_figure((8.0, 1.2 + 2.0 * n))
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for m, (ax, usage) in enumerate(zip(axes, usage_per_slot, strict=True)):
        hist = list(usage["histogram"])
        ax.bar(range(len(hist)), hist, width=0.85, color="#4c72b0")
        k = usage.get("codebook_size", len(hist))
        ax.set_title(
            f"slot {m}: perplexity {usage.get('perplexity', float('nan')):.2f}, used {usage.get('used_codes', '?')}/{k}",
            fontsize=9,
        )
        ax.set_ylabel("count", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(-0.6, len(hist) - 0.4)
    axes[-1].set_xlabel("code")
    save_figure(fig, out_path, dpi=100)
    return out_path


def plot_contingency_heatmap(
    contingency: Mapping[str, Any], out_path: str | Path, factor: str = "label", rows_name: str = "code"
) -> Path:
    """Latent x factor heat map of a ``{"rows", "columns", "counts"}`` contingency table, counts annotated.

    The x axis is named after the ``factor`` (its values along it), the y axis after what the rows are,
    ``rows_name``: ``"code"`` (argmax codes), ``"code combination"`` (several slots) or ``"cluster"`` (k-means
    clusters of posterior means, not codes); the title says both."""
    import numpy as np

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    counts = np.asarray(contingency["counts"], dtype=float).reshape(len(contingency["rows"]), -1)
    rows = [str(r) for r in contingency["rows"]]
    cols = [str(c) for c in contingency["columns"]]
    nr, nc = counts.shape
    fig = _new_figure((max(4.0, 1.0 + 0.6 * nc), max(3.0, 1.0 + 0.4 * nr)))
    ax = fig.add_subplot()
    im = ax.imshow(counts, cmap="Blues", aspect="auto")
    fig.colorbar(im, ax=ax, label="count")
    ax.set_xticks(range(nc), cols, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(nr), rows, fontsize=8)
    ax.set_xlabel(factor)
    ax.set_ylabel(rows_name)
    ax.set_title(f"{rows_name} x {factor}", fontsize=10)
    if nr * nc <= 2500:
        top = counts.max() if counts.size else 0.0
        for i in range(nr):
            for j in range(nc):
                colour = "white" if top > 0 and counts[i, j] > 0.6 * top else "black"
                ax.text(j, i, f"{counts[i, j]:g}", ha="center", va="center", fontsize=7, color=colour)
    save_figure(fig, out_path, dpi=100)
    return out_path


# --------------------------------------------------------------------------- markdown summary


def _md_cell(v: Any) -> str:
    if isinstance(v, float):
        text = f"{v:.6g}"
    elif isinstance(v, list | tuple):
        shown = ", ".join(_md_cell(x) for x in v[:20])
        text = f"[{shown}{', ...' if len(v) > 20 else ''}]"
    elif isinstance(v, Mapping):
        text = json.dumps(v, default=str)
    else:
        text = str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def _is_contingency(v: Any) -> bool:
    return isinstance(v, Mapping) and {"rows", "columns", "counts"} <= set(v)


def _md_table(header: Sequence[Any], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _md_contingency(c: Mapping[str, Any]) -> list[str]:
    header = ["code \\ label", *c["columns"]]
    return _md_table(header, ([r, *counts] for r, counts in zip(c["rows"], c["counts"], strict=True)))


#: Rows of a factor's agreement table: (report key, row name).
FACTOR_ROWS = (
    ("latent", "latent"),
    ("encoder_kmeans", "encoder k-means"),
    ("prior_kmeans", "prior k-means"),
    ("random", "random"),
)
#: Columns of a factor's agreement table: (metric key, column name).
FACTOR_COLUMNS = (("nmi", "NMI"), ("ari", "ARI"), ("homogeneity", "homogeneity"), ("completeness", "completeness"))


def _is_factor_table(v: Any) -> bool:
    """Whether ``v`` is an evaluation report's ``factors``: factor name -> ``{"latent", "random", ...}``."""
    return (
        isinstance(v, Mapping)
        and bool(v)
        and all(isinstance(e, Mapping) and {"latent", "random"} <= set(e) for e in v.values())
    )


def _md_factors(factors: Mapping[str, Mapping[str, Any]], level: int) -> list[str]:
    """One agreement table per factor (rows latent / encoder k-means / prior k-means / random,
    columns NMI, ARI, homogeneity, completeness), then its per-slot table and latent x value table."""
    heading = "#" * min(level, 6)
    lines: list[str] = []
    for name, entry in factors.items():
        lines += [f"{heading} factor {name}", ""]
        facts = []
        if "values" in entry:
            facts.append(f"{entry['values']} values")
        if "clusters" in entry:
            facts.append(f"{entry['clusters']} latent clusters (the k-means baselines use as many)")
        if "latent_beats_baselines" in entry:
            beats = "yes" if entry["latent_beats_baselines"] else "no"
            facts.append(f"latent NMI above every baseline's: {beats}")
        if facts:
            lines += ["; ".join(facts) + ".", ""]
        rows = [
            (label, *(entry[key].get(m, "") for m, _ in FACTOR_COLUMNS)) for key, label in FACTOR_ROWS if key in entry
        ]
        lines += _md_table(["assignment", *(c for _, c in FACTOR_COLUMNS)], rows)
        per_slot = entry.get("latent_per_slot")
        if per_slot:
            slot_rows = ([f"slot {m} code", *(s.get(k, "") for k, _ in FACTOR_COLUMNS)] for m, s in enumerate(per_slot))
            lines += _md_table(["assignment", *(c for _, c in FACTOR_COLUMNS)], slot_rows)
        contingency = entry.get("contingency")
        if _is_contingency(contingency):
            header = [f"latent \\ {name}", *contingency["columns"]]
            counts = zip(contingency["rows"], contingency["counts"], strict=True)
            lines += _md_table(header, ([r, *c] for r, c in counts))
    return lines


def _md_section(obj: Mapping[str, Any], level: int) -> list[str]:
    lines: list[str] = []
    scalars = [(k, v) for k, v in obj.items() if _is_scalar(v) or (isinstance(v, list) and all(map(_is_scalar, v)))]
    if scalars:
        lines += _md_table(["key", "value"], scalars)
    heading = "#" * min(level, 6)
    for key, v in obj.items():
        if key == "factors" and _is_factor_table(v):
            lines += [f"{heading} factors", "", *_md_factors(v, level + 1)]
        elif _is_contingency(v):
            lines += [f"{heading} {key}", "", *_md_contingency(v)]
        elif isinstance(v, Mapping):
            lines += [f"{heading} {key}", "", *_md_section(v, level + 1)]
        elif isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            columns = list(dict.fromkeys(k for x in v for k, xv in x.items() if _is_scalar(xv) or isinstance(xv, list)))
            lines += [f"{heading} {key}", ""]
            lines += _md_table(["#", *columns], ([i, *(x.get(c, "") for c in columns)] for i, x in enumerate(v)))
            for i, x in enumerate(v):
                for sub_key, sub in x.items():
                    if isinstance(sub, Mapping):
                        sub_lines = _md_contingency(sub) if _is_contingency(sub) else _md_section(sub, level + 2)
                        lines += [f"{'#' * min(level + 1, 6)} {key}[{i}].{sub_key}", "", *sub_lines]
    return lines


def write_markdown_summary(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write a readable Markdown summary of a nested JSON-able evaluation report.

    Top-level scalars (and lists of scalars) form a key/value table; each nested dict gets a
    heading and its own table (recursively); ``{"rows", "columns", "counts"}`` contingency
    tables become code x label tables; lists of dicts (e.g. per-slot code usage) become one
    table with a row per item. An evaluation report's ``factors`` get one table per factor: rows
    latent, encoder k-means, prior k-means and random, columns NMI, ARI, homogeneity and
    completeness. The title is ``report["title"]`` when present.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    title = report.get("title", "Evaluation summary")
    body = {k: v for k, v in report.items() if k != "title"}
    lines = [f"# {title}", "", *_md_section(body, 2)]
    atomic_write(path, "\n".join(lines).rstrip("\n") + "\n")
    return path
