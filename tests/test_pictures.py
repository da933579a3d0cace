"""The run's pictures as a user sees them (issue 23): panel counts, titles, axis ranges and tick labels of the
matplotlib figures the plotting functions save, on the metrics logs of the tiny trained runs of ``conftest.py``
and on constructed inputs."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest

from disentanglement import report as R
from helpers import capture_figures, line_series

DISCRETE_PANELS = [
    "objective (nats)",
    "reconstruction terms 1-6",
    "KL (nats) and beta",
    "codes",
    "learning rates and gradient norm",
    "validation",
]
CONTINUOUS_PANELS = [title if title != "codes" else "posterior" for title in DISCRETE_PANELS]


def titled(figure) -> list:
    """The figure's panels (a right-hand twin axis has no title of its own)."""
    return [ax for ax in figure.axes if ax.get_title()]


def assert_reads(figure) -> None:
    """Every title drawn whole inside the figure, and no offset on any axis ("1e-5+9.915e-1")."""
    canvas = figure.canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    box = figure.bbox
    for ax in figure.axes:
        if ax.get_title():
            extent = ax.title.get_window_extent(renderer)
            assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and extent.y1 <= box.y1, ax.get_title()
        for axis in (ax.xaxis, ax.yaxis):
            assert axis.get_offset_text().get_text() == "", (ax.get_title(), axis.get_offset_text().get_text())


@pytest.mark.parametrize("family", ["discrete", "continuous"])
def test_training_curves_of_a_tiny_run_have_at_most_eight_panels_in_order(family, request, tmp_path):
    run = request.getfixturevalue(f"{family}_run")
    metrics = R.read_metrics_jsonl(run.run_dir / "metrics.jsonl")
    keys = {k for record in metrics for k in record}
    assert len(keys) > 20  # a real log: 39 panels (61 for continuous) before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with capture_figures() as figures:
            R.plot_training_curves(metrics, tmp_path)
    figure = figures["training_curves.png"]
    assert len(figure.axes) <= 8
    panels = titled(figure)
    assert [ax.get_title() for ax in panels] == (DISCRETE_PANELS if family == "discrete" else CONTINUOUS_PANELS)
    assert_reads(figure)
    by_title = {ax.get_title(): ax for ax in panels}
    # the loss first; the six terms in their order, named by number
    assert [line.get_label() for line in by_title["objective (nats)"].get_lines()][0] == "loss"
    terms = [line.get_label() for line in by_title["reconstruction terms 1-6"].get_lines()]
    assert [t.split()[0] for t in terms] == ["1", "2", "3", "4", "5", "6"]
    # validation: lines with markers through every validation step, beside the training loss
    validation = by_title["validation"]
    evaluated = [float(r["step"]) for r in metrics if "val_loss" in r]
    assert len(evaluated) >= 2
    val_loss = next(line for line in validation.get_lines() if line.get_label() == "val_loss")
    assert val_loss.get_marker() == "o" and list(val_loss.get_xdata()) == evaluated
    assert "loss (training)" in [line.get_label() for line in validation.get_lines()]


def test_no_offset_on_nearly_constant_curves(tmp_path):
    metrics = [{"step": s, "loss": 0.9915 + 1e-6 * (s % 3), "grad_norm": 1.0 + 1e-7 * s} for s in range(1, 30)]
    with capture_figures() as figures:
        R.plot_training_curves(metrics, tmp_path)
    assert_reads(figures["training_curves.png"])  # matplotlib's default would label "1e-6+9.915e-1"


def kl_metrics(units: int, steps: int = 12) -> list[dict]:
    """A continuous log with ``units`` dimensions, unit d at ``(d + 1) * step / 100`` nats."""
    return [
        {
            "step": s,
            "loss": 1.0,
            "kl": sum((d + 1) * s / 100 for d in range(units)),
            **{f"kl_unit_{d}": (d + 1) * s / 100 for d in range(units)},
            **{f"kl_objective_unit_{d}": (d + 1) * s / 100 for d in range(units)},
        }
        for s in range(1, steps + 1)
    ]


def test_kl_at_36_dimensions_is_the_top_dimensions_and_a_heat_map(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "constrained layout not applied"
        with capture_figures() as figures:
            R.plot_training_curves(kl_metrics(36), tmp_path)
    figure = figures["kl.png"]
    lines, heat, colourbar = figure.axes
    assert lines.get_title() == f"KL per unit: the {R.KL_TOP_UNITS} largest of 36 (by the last step)"
    labels = [text.get_text() for text in lines.get_legend().get_texts()]
    assert labels == ["unit 35", "unit 34", "unit 33", "unit 32", "unit 31"]  # no 36-entry legend
    assert line_series(lines)[0] == ([float(s) for s in range(1, 13)], [36 * s / 100 for s in range(1, 13)])
    (image,) = heat.get_images()
    grid = np.asarray(image.get_array())
    assert grid.shape == (36, 12) and grid[4, 2] == pytest.approx(5 * 3 / 100)  # unit 4 at step 3
    assert heat.get_ylabel() == "unit (dimension or slot)" and heat.get_xlabel() == "step"
    assert colourbar.get_ylabel() == "nats"
    assert_reads(figure)
    # the training curves hold no per-unit key
    drawn = {line.get_label() for ax in figures["training_curves.png"].axes for line in ax.get_lines()}
    assert not any("unit" in label for label in drawn)


def test_kl_below_eight_dimensions_stays_one_axes(tmp_path):
    with capture_figures() as figures:
        R.plot_training_curves(kl_metrics(R.KL_HEATMAP_UNITS - 1), tmp_path)
    (ax,) = figures["kl.png"].axes
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["kl"] + [f"kl_unit_{d}" for d in range(7)]  # the objective's copies left out
    with capture_figures() as figures:
        R.plot_training_curves(kl_metrics(R.KL_HEATMAP_UNITS), tmp_path)
    assert len(figures["kl.png"].axes) == 3 and not math.isnan(R.KL_TOP_UNITS)


# --------------------------------------------------------------------------- sweep.png


def test_sweep_png_seeds_clipped_intervals_and_baselines_in_the_latent_s_panel(tmp_path):
    from disentanglement import sweep

    rows = []
    for cell, nmis in (("a", (0.1, 0.9)), ("b", (0.95, 1.0))):
        for seed, nmi in enumerate(nmis):
            rows.append(
                {
                    "cell": cell,
                    "seed": seed,
                    "factors.label.latent.nmi": nmi,
                    "factors.label.encoder_kmeans.nmi": 0.98,
                    "factors.label.prior_kmeans.nmi": 0.05 + 0.01 * seed,
                    "factors.label.random.nmi": 0.02,
                    "label_nmi": nmi,
                    "latent_gain_nats_per_token": 0.01 * (seed + 1),
                }
            )
    summary = sweep.summarise(rows, ["a", "b"])
    mean, half, n = summary["a"]["factors.label.latent.nmi"]
    assert (mean, n) == (pytest.approx(0.5), 2) and half > 5  # two seeds: t(1) makes the interval huge
    with capture_figures() as figures:
        sweep.plot_summary(summary, tmp_path / "sweep.png", rows)
    figure = figures["sweep.png"]
    nmi, gain = figure.axes  # label_nmi is factors.label's latent: not drawn twice
    assert nmi.get_title() == "factor label: NMI" and gain.get_title() == "latent_gain_nats_per_token"
    assert nmi.get_xlim() == pytest.approx((-0.03, 1.03))
    latent, own, prompt, random = nmi.containers  # the latent first, then its baselines, in its own panel
    assert [text.get_text() for text in nmi.get_legend().get_texts()] == [
        "latent",
        "k-means of its own features",
        "k-means of the prompt's features",
        "random",
    ]
    points, _, (bars,) = latent
    assert list(points.get_xdata()) == pytest.approx([0.5, 0.975])
    ends = [x for segment in bars.get_segments() for x in (segment[0][0], segment[1][0])]
    assert min(ends) >= 0.0 and max(ends) <= 1.0  # cut at NMI's range
    assert ends[:2] == pytest.approx([0.0, 1.0])  # cell a: 0.5 +- 5 -> [0, 1]
    own_points = own[0]
    assert list(own_points.get_xdata()) == pytest.approx([0.98, 0.98])
    assert all(y > row for y, row in zip(own_points.get_ydata(), (0, 1), strict=True))  # just below the row
    # every seed drawn: cell a's two seeds at 0.1 and 0.9 on its row
    from matplotlib.collections import PathCollection

    scatters = [c for c in nmi.collections if isinstance(c, PathCollection)]
    assert len(scatters) == 4  # the latent's and each baseline's seeds
    seeds = scatters[0].get_offsets()
    assert sorted(map(tuple, np.asarray(seeds).tolist())) == [(0.1, 0.0), (0.9, 0.0), (0.95, 1.0), (1.0, 1.0)]
    # an unbounded metric keeps its interval whole
    (_, _, (gain_bars,)) = gain.containers[0]
    g_mean, g_half, _ = summary["a"]["latent_gain_nats_per_token"]
    first = gain_bars.get_segments()[0]
    assert (first[0][0], first[1][0]) == pytest.approx((g_mean - g_half, g_mean + g_half))
    assert_reads(figure)


# --------------------------------------------------------------------------- the latent x factor heat map


def test_heat_map_names_the_factor_and_calls_clusters_clusters(continuous_run, tmp_path):
    from disentanglement.features import build_feature_cache
    from disentanglement.inspection import write_run_plots
    from disentanglement.runs import load_examples

    model, tok, config, _ = continuous_run.load()
    examples, _ = load_examples("validation", config, tok)
    examples = [
        dataclasses.replace(e, label={"factor": e.label, "parity": ("even", "odd")[i % 2]})
        for i, e in enumerate(examples)
    ]
    cache = build_feature_cache(model, examples, tok.pad_token_id, progress=False)
    with capture_figures() as figures:
        write_run_plots(tmp_path, model, examples, cache, tok.pad_token_id)
    assert set(figures) == {"code_factor_heatmap.png", "code_parity_heatmap.png"}  # no code usage: continuous
    ax, colourbar = figures["code_parity_heatmap.png"].axes
    assert ax.get_xlabel() == "parity" and ax.get_ylabel() == "cluster (k-means of posterior means)"
    assert ax.get_title() == "cluster (k-means of posterior means) x parity"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["even", "odd"]
    assert colourbar.get_ylabel() == "count"
    assert figures["code_factor_heatmap.png"].axes[0].get_xlabel() == "factor"
    assert_reads(figures["code_parity_heatmap.png"])


def test_heat_map_rows_by_hand(tmp_path):
    from disentanglement.inspection import _rows_name

    assert _rows_name({"codes": np.zeros((3, 1), dtype=int)}) == "code"
    assert _rows_name({"codes": np.zeros((3, 2), dtype=int)}) == "code combination"
    assert _rows_name({"mu": np.zeros((3, 4))}) == "cluster (k-means of posterior means)"
    contingency = {"rows": [0, 1], "columns": ["a", "b"], "counts": [[1, 0], [0, 2]]}
    with capture_figures() as figures:
        R.plot_contingency_heatmap(contingency, tmp_path / "h.png", "style", "code combination")
    ax = figures["h.png"].axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "style",
        "code combination",
        "code combination x style",
    )
