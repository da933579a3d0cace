"""``disentangle sweep``: one base config, a grid of settings and named cells, several seeds; train and
evaluate every (cell, seed), then report each metric's mean and 95% confidence interval over seeds.

    disentangle sweep --config base.yaml --output-dir runs/sweep --seeds 0,1,2 --eval-data heldout.jsonl \\
        --set reconstruction.token_weight_alpha=0.5,1,2 \\
        --cell "raw reconstruction_weight=1 token_weighted_weight=0" \\
        --cell "term3 reconstruction_weight=0 token_weighted_weight=1"

Cells are the named ``--cell`` settings (``NAME FIELD=VALUE ...``; none: one cell, the base) crossed
with the grid of every ``--set FIELD=V1,V2,...`` (the product of all of them; a ``--set`` with one
value sets that field in every cell). ``FIELD`` is a config
field name, optionally with its section (``kl.beta``); values are read as YAML scalars and
type-checked like a config file's. Layout of the output directory::

    OUT/sweep.json                      the sweep's specification (a rerun must match it)
    OUT/runs/CELL/seed-S/               a run directory (train's), its eval report in eval/sweep_eval.json
    OUT/feature_cache/seed-S/           the frozen pass, shared by the cells of one seed
    OUT/sweep.csv                       one row per (cell, seed): the cell's settings and every metric
    OUT/sweep.md, OUT/sweep.png         per cell: mean and 95% CI over seeds (Student t) of the headline metrics
    OUT/front.png                       NMI per factor against posterior NLL, one point per run (front.py)

Resumable: a (cell, seed) whose evaluation report exists is skipped; one whose training was
interrupted resumes from its last checkpoint. ``--jobs N`` runs N (cell, seed) runs at once in
separate processes (each with ``max(1, cores // N)`` threads); the results do not depend on N.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fnmatch
import itertools
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config import FIELDS, ConfigError, build_config, read_config_file

logger = logging.getLogger(__name__)

#: Metrics summarised in sweep.md and plotted (fnmatch patterns over the flattened eval report).
HEADLINE_METRICS = (
    "factors.*.latent.nmi",
    "factors.*.encoder_kmeans.nmi",
    "factors.*.prior_kmeans.nmi",
    "factors.*.random.nmi",
    "label_nmi",
    "latent_gain_nats_per_token",
    "token_weighted_latent_gain_nats_per_token",
    "iw_nll.nats_per_token",
    "kl.total",
    "mutual_information",
)
#: Fields a sweep sets itself.
RESERVED = ("seed", "output_dir", "resume", "overwrite", "feature_cache_dir")


# ------------------------------------------------------------------------------------------------
# the specification


def parse_value(text: str) -> Any:
    """A YAML scalar: ``1`` -> 1, ``0.5`` -> 0.5, ``true`` -> True, ``none`` -> None, else the string."""
    if text.lower() in ("none", "null"):
        return None
    value = yaml.safe_load(text)
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)", text):
        return float(text)  # YAML 1.1 reads 1e-3 as a string
    return value


def field_name(key: str) -> str:
    """``kl.beta`` or ``beta`` -> ``beta`` (checked against the config's fields and sections)."""
    section, _, name = key.rpartition(".")
    if name not in FIELDS:
        raise ConfigError(f"sweep: unknown config field {key!r}")
    if section and FIELDS[name][0] != section:
        raise ConfigError(f"sweep: {key!r}: field {name!r} is in section {FIELDS[name][0]!r}, not {section!r}")
    if name in RESERVED:
        raise ConfigError(f"sweep: {name!r} is set by the sweep itself (use --seeds for the seed)")
    return name


def parse_grid(sets: Sequence[str]) -> dict[str, list[Any]]:
    """``["kl.beta=0.1,0.2"]`` -> ``{"beta": [0.1, 0.2]}``."""
    grid: dict[str, list[Any]] = {}
    for item in sets:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ConfigError(f"sweep: --set {item!r}: expected FIELD=V1,V2,...")
        name = field_name(key.strip())
        if name in grid:
            raise ConfigError(f"sweep: --set gives {name!r} twice")
        grid[name] = [parse_value(v.strip()) for v in values.split(",")]
    return grid


def parse_cell(text: str) -> tuple[str, dict[str, Any]]:
    """``"term3 reconstruction_weight=0 token_weighted_weight=1"`` -> ``("term3", {...})``."""
    name, *assignments = text.split()
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name) or "=" in name:
        raise ConfigError(f"sweep: --cell {text!r}: expected NAME FIELD=VALUE ... (NAME of letters, digits, _.+-)")
    values: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep:
            raise ConfigError(f"sweep: --cell {text!r}: {assignment!r} is not FIELD=VALUE")
        values[field_name(key)] = parse_value(value)
    return name, values


@dataclass
class SweepSpec:
    """What a sweep runs: the base config's values, the cells (name -> settings) and the seeds."""

    base: dict[str, Any]
    cells: dict[str, dict[str, Any]]
    seeds: list[int]
    eval_data: str | None = None
    eval_max_examples: int | None = None
    eval_options: dict[str, Any] = field(default_factory=dict)

    def runs(self) -> list[tuple[str, int]]:
        return [(cell, seed) for cell in self.cells for seed in self.seeds]

    def config(self, cell: str, seed: int, output_dir: Path):
        values = dict(self.base, **self.cells[cell])
        values.update(
            seed=seed,
            output_dir=str(output_dir / "runs" / cell / f"seed-{seed}"),
            feature_cache_dir=str(output_dir / "feature_cache" / f"seed-{seed}"),
            progress=False,
        )
        return build_config(values)


def build_spec(
    base: dict[str, Any],
    cells: Sequence[str] = (),
    sets: Sequence[str] = (),
    seeds: Sequence[int] = (0,),
    **eval_settings: Any,
) -> SweepSpec:
    """Cells = named cells (or the base alone) x the grid; every cell's config is validated here."""
    named = dict(parse_cell(c) for c in cells) if cells else {"base": {}}
    if cells and len(named) != len(cells):
        raise ConfigError("sweep: two --cell options have the same name")
    grid = parse_grid(sets)
    base = dict(base, **{k: v[0] for k, v in grid.items() if len(v) == 1})  # one value: a setting of every cell
    grid = {k: v for k, v in grid.items() if len(v) > 1}
    combined: dict[str, dict[str, Any]] = {}
    for cell_name, cell_values in named.items():
        for combo in itertools.product(*grid.values()):
            values = dict(cell_values, **dict(zip(grid, combo, strict=True)))
            suffix = "".join(f",{k}={_slug(v)}" for k, v in zip(grid, combo, strict=True))
            combined[cell_name + suffix] = values
    if not seeds:
        raise ConfigError("sweep: --seeds needs at least one seed")
    spec = SweepSpec(dict(base), combined, list(seeds), **eval_settings)
    for cell in spec.cells:
        try:
            spec.config(cell, spec.seeds[0], Path("."))
        except ConfigError as exc:
            raise ConfigError(f"sweep: cell {cell!r}: {exc}") from exc
    return spec


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(value))


# ------------------------------------------------------------------------------------------------
# running


def flatten_report(report: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every finite number of an eval report, keyed by its dotted path (lists and contingencies are left out)."""
    out: dict[str, float] = {}
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_report(value, name + "."))
        elif isinstance(value, bool) or isinstance(value, int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


def run_one(
    spec: SweepSpec,
    cell: str,
    seed: int,
    output_dir: Path,
    model_factory: Callable[[], tuple[Any, Any]] | None = None,
    threads: int | None = None,
) -> dict[str, float]:
    """Train (or resume, or skip when done) and evaluate one (cell, seed); returns its flattened report."""
    from .checkpoints import latest_checkpoint
    from .commands import run_eval
    from .trainer import train

    if threads:
        import torch

        torch.set_num_threads(threads)
    config = spec.config(cell, seed, output_dir)
    run_dir = Path(config.train.output_dir)
    report_path = run_dir / "eval" / "sweep_eval.json"
    if report_path.is_file():
        return flatten_report(json.loads(report_path.read_text()))
    last = latest_checkpoint(run_dir)
    done = last is not None and json.loads((last / "trainer_state.json").read_text())["step"] >= config.train.max_steps
    if not done:
        resume = "auto" if run_dir.is_dir() and any(run_dir.iterdir()) else None
        logger.info("sweep: training %s seed %d%s", cell, seed, " (resuming)" if resume else "")
        train(
            dataclasses.replace(config, train=dataclasses.replace(config.train, resume=resume)),
            model_factory() if model_factory else None,
        )
    logger.info("sweep: evaluating %s seed %d", cell, seed)
    report, _, _ = run_eval(
        run_dir,
        data=spec.eval_data,
        output=report_path,
        max_examples=spec.eval_max_examples,
        seed=0,
        device=config.train.device,
        progress=False,
        model_and_tokenizer=model_factory() if model_factory else None,
        **spec.eval_options,
    )
    return flatten_report(report)


def _die_with_parent() -> None:
    """Worker initializer: on Linux, end the worker when the sweep's process ends (no orphaned runs)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _run_in_process(args: tuple) -> tuple[str, int, dict[str, float]]:
    spec, cell, seed, output_dir, model_factory, threads = args
    logging.basicConfig(level=logging.WARNING)
    return cell, seed, run_one(spec, cell, seed, output_dir, model_factory, threads)


def run_sweep(
    spec: SweepSpec,
    output_dir: str | Path,
    jobs: int = 1,
    model_factory: Callable[[], tuple[Any, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run every (cell, seed) not yet done; write sweep.csv, sweep.md, sweep.png; return the CSV rows."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    _check_or_write_spec(spec, output_dir / "sweep.json")
    results: dict[tuple[str, int], dict[str, float]] = {}
    if jobs <= 1:
        for cell, seed in spec.runs():
            results[cell, seed] = run_one(spec, cell, seed, output_dir, model_factory)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 1) // jobs)
        work = [(spec, cell, seed, output_dir, model_factory, threads) for cell, seed in spec.runs()]
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_die_with_parent) as pool:
            for cell, seed, flat in pool.map(_run_in_process, work):
                results[cell, seed] = flat
    rows = []
    for cell, seed in spec.runs():
        row: dict[str, Any] = {"cell": cell, "seed": seed}
        row.update({k: spec.cells[cell].get(k, "") for k in _setting_keys(spec)})
        row.update({k: v for k, v in results[cell, seed].items() if k not in row})  # the report's "seed" is eval's
        rows.append(row)
    write_csv(rows, output_dir / "sweep.csv")
    summary = summarise(rows, list(spec.cells))
    (output_dir / "sweep.md").write_text(summary_markdown(summary, spec))
    plot_summary(summary, output_dir / "sweep.png")
    from .front import plot_front

    plot_front(rows, output_dir / "front.png")  # NMI against posterior NLL, one point per run
    return rows


def _setting_keys(spec: SweepSpec) -> list[str]:
    return sorted({k for values in spec.cells.values() for k in values})


def _check_or_write_spec(spec: SweepSpec, path: Path) -> None:
    """A rerun into the same directory must be the same sweep (cells may be added, seeds too)."""
    current = dataclasses.asdict(spec)
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored["base"] != current["base"]:
            raise ConfigError(
                f"{path}: this directory holds a sweep of another base config; choose another --output-dir"
            )
        clash = [c for c in stored["cells"] if c in current["cells"] and stored["cells"][c] != current["cells"][c]]
        if clash:
            raise ConfigError(f"{path}: cells {clash} had other settings in the earlier sweep; rename them")
    path.write_text(json.dumps(current, indent=1, default=str) + "\n")


# ------------------------------------------------------------------------------------------------
# summaries


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def mean_and_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, int]:
    """``(mean, half-width of the Student-t confidence interval, n)``; the half-width is nan for n < 2."""
    from scipy import stats

    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n), n


def headline_keys(rows: Sequence[dict[str, Any]]) -> list[str]:
    present = {k for row in rows for k, v in row.items() if isinstance(v, float)}
    keys: list[str] = []
    for pattern in HEADLINE_METRICS:
        keys.extend(sorted(k for k in present if fnmatch.fnmatchcase(k, pattern) and k not in keys))
    return keys


def summarise(rows: Sequence[dict[str, Any]], cells: Sequence[str]) -> dict[str, dict[str, tuple[float, float, int]]]:
    """``{cell: {metric: (mean, CI half-width, n)}}`` over the seeds of each cell, for the headline metrics."""
    keys = headline_keys(rows)
    return {
        cell: {
            key: mean_and_interval([r[key] for r in rows if r["cell"] == cell and isinstance(r.get(key), float)])
            for key in keys
        }
        for cell in cells
    }


def _format(mean: float, half: float, n: int) -> str:
    if n == 0 or math.isnan(mean):
        return "-"
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}"


def summary_markdown(summary: dict[str, dict[str, tuple[float, float, int]]], spec: SweepSpec) -> str:
    keys = list(next(iter(summary.values()), {}))
    lines = [
        "# Sweep",
        "",
        f"Seeds: {', '.join(map(str, spec.seeds))}; evaluation data: {spec.eval_data or 'validation'}. "
        "Each entry is the mean over seeds ± the half-width of its 95% confidence interval (Student t).",
        "",
        "| cell | settings | " + " | ".join(keys) + " |",
        "| --- | --- | " + " | ".join("---" for _ in keys) + " |",
    ]
    for cell, metrics in summary.items():
        settings = ", ".join(f"{k}={v}" for k, v in spec.cells[cell].items()) or "base"
        lines.append(f"| {cell} | {settings} | " + " | ".join(_format(*metrics[k]) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def plot_summary(summary: dict[str, dict[str, tuple[float, float, int]]], path: Path) -> Path:
    """One panel per headline metric: each cell's mean with its 95% interval."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = list(summary)
    keys = list(next(iter(summary.values()), {}))
    cols = min(3, max(1, len(keys)))
    rows = max(1, math.ceil(len(keys) / cols))
    figure = Figure(figsize=(5 * cols, 0.5 + 0.35 * len(cells) * rows + 1.2 * rows))
    FigureCanvasAgg(figure)
    for i, key in enumerate(keys):
        axis = figure.add_subplot(rows, cols, i + 1)
        means = [summary[c][key][0] for c in cells]
        halves = [0.0 if math.isnan(summary[c][key][1]) else summary[c][key][1] for c in cells]
        axis.errorbar(means, range(len(cells)), xerr=halves, fmt="o", capsize=3)
        axis.set_yticks(range(len(cells)), cells, fontsize=7)
        axis.invert_yaxis()
        axis.set_title(key, fontsize=8)
        axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


# ------------------------------------------------------------------------------------------------
# command line


def add_sweep_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="train and evaluate a grid of settings over seeds; report means with 95%% intervals",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--config", help="base config file (YAML or JSON)")
    parser.add_argument("--output-dir", required=True, help="the sweep's directory")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2", help="a grid axis (repeat)")
    parser.add_argument("--cell", action="append", default=[], metavar="'NAME F=V ...'", help="a named cell (repeat)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--eval-data", help="evaluation data: validation (default), train, chatterbot or a .jsonl file")
    parser.add_argument("--eval-max-examples", type=int, help="evaluate at most this many examples")
    parser.add_argument("--jobs", type=int, default=1, help="(cell, seed) runs at once, in separate processes")
    parser.set_defaults(func=_sweep_main)


def _sweep_main(args: argparse.Namespace) -> int:
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as exc:
        raise ConfigError(f"--seeds {args.seeds!r}: expected comma-separated integers") from exc
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    base = read_config_file(args.config) if args.config else {}
    for name in RESERVED:
        if name in base:
            raise ConfigError(f"sweep: the base config sets {name!r}, which the sweep sets itself; remove it")
    spec = build_spec(
        base, args.cell, args.set, seeds, eval_data=args.eval_data, eval_max_examples=args.eval_max_examples
    )
    print(f"sweep: {len(spec.cells)} cells x {len(spec.seeds)} seeds = {len(spec.runs())} runs into {args.output_dir}")
    run_sweep(spec, args.output_dir, jobs=args.jobs)
    out = Path(args.output_dir)
    print((out / "sweep.md").read_text())
    print(f"table: {out / 'sweep.csv'}\nsummary: {out / 'sweep.md'}\nplot: {out / 'sweep.png'}")
    if (out / "front.png").is_file():
        print(f"front: {out / 'front.png'}")
    return 0
