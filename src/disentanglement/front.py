"""The front of what a latent captures against what it costs the likelihood: one point per (cell, seed) run of a
sweep, NMI of its codes with a factor on one axis and the posterior NLL (nats per response token, under the
posterior latent) on the other, one marker per cell; one panel per labelled factor. ``disentangle sweep``
draws it into ``OUT/front.png``; for a finished sweep::

    python -m disentanglement.front OUT        (reads OUT/sweep.csv, writes OUT/front.png)

A recipe that keeps the likelihood and takes the factor sits at the top left (high NMI, low NLL).
"""

from __future__ import annotations

import csv
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NLL_KEY = "posterior_nll_nats_per_token"
ZFREE_KEY = "zfree_nll_nats_per_token"
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


def front_factors(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(factor name, NMI key)`` of every factor the rows score (``factors.F.latent.nmi``), else the
    single label (``label_nmi``); in first-seen order."""
    keys: list[tuple[str, str]] = []
    for row in rows:
        for key in row:
            match = re.fullmatch(r"factors\.(.+)\.latent\.nmi", key)
            if match and (match.group(1), key) not in keys:
                keys.append((match.group(1), key))
    if not keys and any("label_nmi" in row for row in rows):
        keys.append(("label", "label_nmi"))
    return keys


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def front_points(rows: Sequence[dict[str, Any]], nmi_key: str) -> dict[str, list[tuple[float, float]]]:
    """Per cell (first-seen order), the ``(posterior NLL, NMI)`` of each of its runs that has both."""
    points: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        nll, nmi = _number(row.get(NLL_KEY)), _number(row.get(nmi_key))
        cell = str(row.get("cell", "run"))
        points.setdefault(cell, [])
        if nll is not None and nmi is not None:
            points[cell].append((nll, nmi))
    return points


def plot_front(rows: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Draw the front of ``rows`` (sweep.csv's rows: ``cell``, the NMI keys, :data:`NLL_KEY`) into ``path``;
    None (nothing written) when no row has an NMI and a posterior NLL. The z-free NLL (the mean over the
    rows) is a dotted vertical line: a point right of it is worse than no latent at all."""
    factors = [(name, key) for name, key in front_factors(rows) if any(front_points(rows, key).values())]
    if not factors:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.2 * len(factors), 4.2))
    FigureCanvasAgg(figure)
    zfree = [v for v in (_number(r.get(ZFREE_KEY)) for r in rows) if v is not None]
    for i, (name, key) in enumerate(factors):
        axis = figure.add_subplot(1, len(factors), i + 1)
        for j, (cell, points) in enumerate(front_points(rows, key).items()):
            if points:
                xs, ys = zip(*points, strict=True)
                axis.scatter(xs, ys, marker=MARKERS[j % len(MARKERS)], label=cell, alpha=0.8)
        if zfree:
            axis.axvline(sum(zfree) / len(zfree), linestyle=":", color="grey", label="z-free NLL")
        axis.set_xlabel("posterior NLL (nats/token)")
        axis.set_ylabel(f"NMI with {name}")
        axis.set_ylim(-0.03, 1.03)
        axis.set_title(f"factor {name}: one point per run", fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    from .report import save_figure

    return save_figure(figure, Path(path), dpi=110)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(newline="") as handle:
        return list(csv.DictReader(handle))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m disentanglement.front SWEEP_DIR", file=sys.stderr)
        return 2
    table = Path(args[0]) / "sweep.csv"
    if not table.is_file():
        print(f"front: error: {table} does not exist (run the sweep first)", file=sys.stderr)
        return 2
    out = plot_front(read_rows(table), Path(args[0]) / "front.png")
    if out is None:
        print(f"front: error: no row of {table} has an NMI and {NLL_KEY}", file=sys.stderr)
        return 2
    print(f"front: {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
