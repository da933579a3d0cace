"""The run's pictures as a user sees them (issue 23): panel counts, titles, axis ranges and tick labels of the
matplotlib figures the plotting functions save, on the metrics logs of the tiny trained runs of ``conftest.py``
and on constructed inputs."""

from __future__ import annotations

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
