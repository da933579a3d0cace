"""sweep's front.png (front.py): one point per run at (posterior NLL, NMI), one marker per cell, one panel per
factor; checked on hand-made rows and on a real tiny sweep's output."""

from __future__ import annotations

import csv

import pytest

from disentanglement import front
from helpers import capture_figures, visible_axes

ROWS = [
    {
        "cell": "term3",
        "seed": 0,
        "factors.A.latent.nmi": 1.0,
        "factors.B.latent.nmi": 0.01,
        "posterior_nll_nats_per_token": 0.9,
        "zfree_nll_nats_per_token": 3.9,
    },
    {
        "cell": "term3",
        "seed": 1,
        "factors.A.latent.nmi": 0.6,
        "factors.B.latent.nmi": 0.1,
        "posterior_nll_nats_per_token": 1.3,
        "zfree_nll_nats_per_token": 3.9,
    },
    {
        "cell": "terms13",
        "seed": 0,
        "factors.A.latent.nmi": 1.0,
        "factors.B.latent.nmi": 0.02,
        "posterior_nll_nats_per_token": 0.1,
        "zfree_nll_nats_per_token": 3.9,
    },
    {"cell": "broken", "seed": 0, "factors.A.latent.nmi": "", "posterior_nll_nats_per_token": "nan"},
]


def test_front_draws_one_point_per_run_and_a_marker_per_cell(tmp_path):
    assert front.front_factors(ROWS) == [("A", "factors.A.latent.nmi"), ("B", "factors.B.latent.nmi")]
    assert front.front_points(ROWS, "factors.A.latent.nmi") == {
        "term3": [(0.9, 1.0), (1.3, 0.6)],
        "terms13": [(0.1, 1.0)],
        "broken": [],  # a run without both numbers is left out
    }
    with capture_figures() as figures:
        path = front.plot_front(ROWS, tmp_path / "front.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    panels = visible_axes(figures["front.png"])
    assert [ax.get_ylabel() for ax in panels] == ["NMI with A", "NMI with B"]
    for ax, key in zip(panels, ("factors.A.latent.nmi", "factors.B.latent.nmi"), strict=True):
        drawn = {c.get_label(): [tuple(p) for p in c.get_offsets().tolist()] for c in ax.collections}
        expected = {cell: pts for cell, pts in front.front_points(ROWS, key).items() if pts}
        assert drawn == {k: [pytest.approx(p) for p in v] for k, v in expected.items()}
        markers = {c.get_label(): c.get_paths()[0].vertices.tobytes() for c in ax.collections}
        assert len(set(markers.values())) == len(markers)  # each cell its own marker
        (line,) = ax.get_lines()
        assert list(line.get_xdata()) == [3.9, 3.9] and line.get_label() == "z-free NLL"


def test_a_single_label_and_nothing_to_draw(tmp_path):
    rows = [{"cell": "a", "label_nmi": 0.5, "posterior_nll_nats_per_token": 2.0}]
    assert front.front_factors(rows) == [("label", "label_nmi")]
    assert front.plot_front(rows, tmp_path / "f.png").is_file()
    assert front.plot_front([{"cell": "a", "kl": 1.0}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_command_on_a_sweep_folder(tmp_path, capsys):
    with (tmp_path / "sweep.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS[:3])
    assert front.main([str(tmp_path)]) == 0 and (tmp_path / "front.png").is_file()
    assert front.main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
