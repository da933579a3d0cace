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
type-checked like a config file's. ``--preset NAME`` (or ``preset: NAME`` in the base config, ``preset=NAME`` in
a cell) puts a named recipe (``config.PRESETS``) under the base config's and the cells' own settings.
Layout of the output directory::

    OUT/sweep.json                      the sweep's specification (a rerun must match it)
    OUT/runs/CELL/seed-S/               a run directory (train's), its eval report in eval/sweep_eval.json
    OUT/sweep.csv                       one row per (cell, seed): the cell's settings and every metric
    OUT/sweep.md, OUT/sweep.png         per cell: mean and 95% CI over seeds (Student t) of the headline metrics
    OUT/front.png                       NMI per factor against posterior NLL, one point per run (front.py)
    OUT/kept.json                       per cell, the seed to keep: the highest latent gain (no labels needed)

The seed to keep: seeds of one recipe can end on different partitions (a random start decides which values two
codes share), and a user without labels cannot read NMI. Per cell, ``sweep.md`` and ``kept.json`` name the seed
whose latent gain on the evaluation data is highest (``latent_gain_nats_per_token``: the prior mixture's NLL minus the
posterior's, what the codes tell the decoder beyond the prompt), with its NMI beside the cell's best where the data
has labels (docs/what-the-cvae-adds.md, section 17, measured how often that is the best seed).

Resumable: a (cell, seed) whose evaluation report exists is skipped; one whose training was
interrupted resumes from its last checkpoint. The frozen pass is shared by every cell and seed (and
every other run on the same model and examples) through the feature cache (``feature_store.py``). ``--jobs N`` runs N (cell, seed) runs at once in
separate processes (each with ``max(1, cores // N)`` threads); the results do not depend on N.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fnmatch
import io
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

from .config import (
    FIELDS,
    PRESET_KEY,
    PRESETS,
    ConfigError,
    build_config,
    canonical_field,
    read_config_file,
    unknown_field_message,
)
from .front import front_factors, plot_front
from .safe_io import atomic_write

logger = logging.getLogger(__name__)

#: Metrics summarised in sweep.md and plotted (fnmatch patterns over the flattened eval report).
HEADLINE_METRICS = (
    "factors.*.latent.nmi",
    "factors.*.encoder_kmeans.nmi",
    "factors.*.prior_kmeans.nmi",
    "factors.*.random.nmi",
    "decoder_posterior.factors.*.decoder",
    "label_nmi",
    "latent_gain_nats_per_token",
    "token_weighted_latent_gain_nats_per_token",
    "iw_nll.nats_per_token",
    "kl.total",
    "mutual_information",
)
#: The label-free measure a sweep keeps one seed of each cell by (the latent gain on the evaluation data).
KEEP_BY = "latent_gain_nats_per_token"
#: Fields a sweep sets itself.
RESERVED = ("seed", "output_dir", "resume", "overwrite")
#: What to do instead of setting a reserved field.
RESERVED_HINTS = {
    "seed": "give the seeds with --seeds",
    "output_dir": "give the sweep's directory with --output-dir; each run goes to OUTPUT_DIR/runs/CELL/seed-S",
    "resume": "a sweep resumes an unfinished run by itself when run again",
    "overwrite": "a sweep never overwrites a run: choose another --output-dir",
}


# ------------------------------------------------------------------------------------------------
# the specification


def parse_value(text: str) -> Any:
    """A YAML scalar: ``1`` -> 1, ``0.5`` -> 0.5, ``true`` -> True, ``none`` -> None, else the string."""
    from .config import YamlLoader

    if text.lower() in ("none", "null"):
        return None
    value = yaml.load(text, Loader=YamlLoader)  # numbers as in YAML 1.2, as a config file's: 1_0 is a string
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)", text):
        return float(text)  # YAML 1.1 reads 1e-3 as a string
    return value


def field_name(key: str) -> str:
    """``kl.beta`` or ``beta`` -> ``beta``; a flag's name works too (``token-weighted-reconstruction-weight`` ->
    ``token_weighted_weight``); checked against the config's fields and sections."""
    if key == PRESET_KEY:  # a named recipe (config.PRESETS) under the cell's other settings
        return key
    section, _, spelled = key.rpartition(".")
    name = canonical_field(spelled)  # a field's name or its flag's (token-weighted-reconstruction-weight)
    if name is None:
        raise ConfigError(f"sweep: {unknown_field_message(key)}")
    if section and FIELDS[name][0] != section:
        raise ConfigError(f"sweep: {key!r}: field {name!r} is in section {FIELDS[name][0]!r}, not {section!r}")
    if name in RESERVED:
        raise ConfigError(f"sweep: {name!r} is set by the sweep itself ({RESERVED_HINTS[name]})")
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
    if not text.split():
        raise ConfigError(f"sweep: --cell {text!r} is empty: expected NAME FIELD=VALUE ... (e.g. 'low beta=0.01')")
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
            output_dir=str(spec_run_dir(output_dir, cell, seed)),
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
    for cell_name, cell_values in named.items():  # one field set in two places: neither may silently win
        for name in sorted(set(cell_values) & set(grid)):
            listed = ",".join(map(str, grid[name]))
            raise ConfigError(
                f"sweep: --cell {cell_name!r} sets {name}={cell_values[name]} and --set {name}={listed} sets it "
                "too; give the field in one place (in every cell, or as a --set axis)"
            )
    repeated = sorted({s for s in seeds if list(seeds).count(s) > 1})
    if repeated:
        raise ConfigError(
            f"sweep: --seeds repeats {', '.join(map(str, repeated))}: a seed is one run, and counting it twice "
            "would narrow the interval without a second run; give distinct seeds"
        )
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


def spec_run_dir(output_dir: Path, cell: str, seed: int) -> Path:
    """The run directory of one (cell, seed) (as :meth:`SweepSpec.config` sets it)."""
    return Path(output_dir) / "runs" / cell / f"seed-{seed}"


def run_sweep(
    spec: SweepSpec,
    output_dir: str | Path,
    jobs: int = 1,
    model_factory: Callable[[], tuple[Any, Any]] | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> list[dict[str, Any]]:
    """Run every (cell, seed) not yet done; write sweep.csv, sweep.md, sweep.png; return the CSV rows.
    ``say`` gets a "run k of N" line as each run starts (one process) or finishes (``jobs`` > 1)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"sweep: --output-dir {output_dir} is a file, not a directory; choose a directory")
    check_eval_options(spec)
    output_dir.mkdir(parents=True, exist_ok=True)
    _check_or_write_spec(spec, output_dir / "sweep.json")
    results: dict[tuple[str, int], dict[str, float]] = {}
    total = len(spec.runs())
    if jobs <= 1:
        for k, (cell, seed) in enumerate(spec.runs(), start=1):
            done = (spec_run_dir(output_dir, cell, seed) / "eval" / "sweep_eval.json").is_file()
            say(
                f"sweep: run {k} of {total}: {cell} seed {seed}"
                + (" (done before: its report is read)" if done else "")
            )
            results[cell, seed] = run_one(spec, cell, seed, output_dir, model_factory)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 1) // jobs)
        work = [(spec, cell, seed, output_dir, model_factory, threads) for cell, seed in spec.runs()]
        context = multiprocessing.get_context("spawn")
        say(f"sweep: {total} runs, {jobs} at a time")
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_die_with_parent) as pool:
            for k, (cell, seed, flat) in enumerate(pool.map(_run_in_process, work), start=1):
                say(f"sweep: run {k} of {total} finished: {cell} seed {seed}")
                results[cell, seed] = flat
    rows = []
    for cell, seed in spec.runs():
        row: dict[str, Any] = {"cell": cell, "seed": seed}
        row.update({k: spec.cells[cell].get(k, "") for k in _setting_keys(spec)})
        row.update({k: v for k, v in results[cell, seed].items() if k not in row})  # the report's "seed" is eval's
        rows.append(row)
    write_csv(rows, output_dir / "sweep.csv")
    summary = summarise(rows, list(spec.cells))
    kept = kept_seeds(rows, list(spec.cells))
    atomic_write(output_dir / "sweep.md", summary_markdown(summary, spec) + kept_markdown(kept, rows))
    atomic_write(output_dir / "kept.json", json.dumps(kept, indent=2) + "\n")
    plot_summary(summary, output_dir / "sweep.png", rows)
    plot_front(rows, output_dir / "front.png")  # NMI against posterior NLL, one point per run
    return rows


def check_eval_options(spec: SweepSpec) -> None:
    """``--eval-data`` and ``--eval-max-examples`` before any run trains (a typo must not cost a sweep): the
    data loaded with every cell's keys, as eval will load it; errors name the sweep's flag."""
    from .data import chatterbot_corpus_dir, load_pairs
    from .options import check_at_least
    from .splits import SPLITS

    try:
        check_at_least("--eval-max-examples", spec.eval_max_examples, 1, optional=True)
    except ValueError as exc:
        raise ConfigError(f"sweep: {exc}") from None
    data = spec.eval_data
    if data is None or data in SPLITS:
        return
    try:
        if data == "chatterbot":
            chatterbot_corpus_dir()
            return
        checked = set()
        for cell in spec.cells:
            config = spec.config(cell, spec.seeds[0], Path("."))
            keys = (config.data.prompt_key, config.data.response_key, config.data.label_key)
            if keys not in checked:
                checked.add(keys)
                load_pairs(dataclasses.replace(config.data, data=data))
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"sweep: --eval-data {data}: {exc}") from None


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
    atomic_write(path, json.dumps(current, indent=1, default=str) + "\n")


# ------------------------------------------------------------------------------------------------
# summaries


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    handle = io.StringIO(newline="")
    writer = csv.DictWriter(handle, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, handle.getvalue())


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


def _finite(value: Any) -> float | None:
    return value if isinstance(value, float) and math.isfinite(value) else None


def _compared(rows: Sequence[dict[str, Any]], cell: str) -> list[dict[str, Any]]:
    """The cell's runs that have a finite :data:`KEEP_BY`: the ones the seed to keep is chosen among."""
    return [r for r in rows if r["cell"] == cell and _finite(r.get(KEEP_BY)) is not None]


def kept_seeds(rows: Sequence[dict[str, Any]], cells: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per cell, the seed to keep: the one whose :data:`KEEP_BY` (latent gain on the evaluation data) is highest,
    the lowest seed on a tie; a cell none of whose runs has a finite gain is left out. ``{cell: {"seed": S,
    "run_dir": "runs/CELL/seed-S" (relative to the sweep's directory), KEEP_BY: gain, "seeds": n compared,
    NMI key: that seed's NMI, for each NMI key it scores}}``."""
    kept: dict[str, dict[str, Any]] = {}
    for cell in cells:
        compared = _compared(rows, cell)
        if not compared:
            continue
        row = max(compared, key=lambda r: (r[KEEP_BY], -r["seed"]))
        kept[cell] = {
            "seed": row["seed"],
            "run_dir": spec_run_dir(Path(), cell, row["seed"]).as_posix(),
            KEEP_BY: row[KEEP_BY],
            "seeds": len(compared),
            **{k: row[k] for _, k in front_factors([row]) if _finite(row[k]) is not None},
        }
    return kept


def kept_markdown(kept: dict[str, dict[str, Any]], rows: Sequence[dict[str, Any]]) -> str:
    """sweep.md's section on the seed to keep: per cell, the seed, its latent gain and, per NMI key, its NMI beside
    the best NMI among the same runs (those with a gain)."""
    if not kept:
        return ""
    # (factor name, NMI key): factors.F.latent.nmi, else a string label's label_nmi (its twin factors.label's)
    factors = front_factors([r for cell in kept for r in _compared(rows, cell)])
    keys = [key for _, key in factors]
    lines = [
        "",
        "## The seed to keep",
        "",
        f"Per cell, the seed whose latent gain on the evaluation data is highest ({KEEP_BY}: the prior mixture's "
        "NLL minus the posterior's, what the codes tell the decoder beyond the prompt), which needs no labels; its "
        "run directory is in kept.json. Where the data has labels, its NMI stands beside the best of the cell's "
        "seeds. Measured (docs/what-the-cvae-adds.md, section 17): with a decoder that trains (LoRA or whole), the "
        "seed of the highest gain held the hidden factor best in every group of seeds; with the frozen decoder in "
        "4 of 10.",
        "",
        "| "
        + " | ".join(["cell", "seed to keep", "latent gain"])
        + "".join(
            f" | NMI with {'the label' if key == 'label_nmi' else name} (the best seed's)" for name, key in factors
        )
        + " |",
        "| " + " | ".join(["---", "---:", "---:", *("---" for _ in keys)]) + " |",
    ]
    for cell, pick in kept.items():
        entries = []
        for key in keys:
            scored = [r for r in _compared(rows, cell) if _finite(r.get(key)) is not None]
            if key not in pick or not scored:
                entries.append("-")
                continue
            best = max(scored, key=lambda r: (r[key], -r["seed"]))
            entries.append(f"{pick[key]:.3f} ({best[key]:.3f}, seed {best['seed']})")
        cells = [cell, f"{pick['seed']} of {pick['seeds']}", f"{pick[KEEP_BY]:.4f}", *entries]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: The baselines drawn in a factor's NMI panel beside the latent: (key part, legend name, marker).
SWEEP_BASELINES = (
    ("encoder_kmeans", "k-means of its own features", "s"),
    ("prior_kmeans", "k-means of the prompt's features", "^"),
    ("random", "random", "v"),
)


def metric_range(key: str) -> tuple[float, float]:
    """The values ``key`` can take: NMI in [0, 1]; KL, mutual information and NLL at least 0; else any."""
    if key.endswith("nmi"):
        return 0.0, 1.0
    if key in ("kl.total", "mutual_information") or key.startswith("iw_nll"):
        return 0.0, math.inf
    return -math.inf, math.inf


def summary_panels(keys: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The panels of ``sweep.png``: ``[(title, keys)]``. A factor's latent NMI and its baselines' share one
    panel, ``factor F: NMI``, the latent's key first; ``label_nmi`` is left out when ``factors.label`` has its
    panel (the same number); every other headline metric has its own panel, titled by its key."""
    panels: dict[str, list[str]] = {}
    factors = {k.split(".")[1] for k in keys if k.startswith("factors.") and k.endswith(".latent.nmi")}
    for key in keys:
        parts = key.split(".")
        if key.startswith("factors.") and parts[1] in factors and key.endswith(".nmi"):
            panels.setdefault(f"factor {parts[1]}: NMI", []).append(key)
        elif key == "label_nmi" and "label" in factors:
            continue
        else:
            panels[key] = [key]
    for found in panels.values():
        found.sort(key=lambda k: 0 if k.endswith(".latent.nmi") else 1)
    return list(panels.items())


def _clipped_error(mean: float, half: float, low: float, high: float) -> tuple[float, float]:
    """The interval's distances below and above ``mean``, cut at the metric's range (no interval: 0, 0)."""
    if math.isnan(half) or math.isnan(mean):
        return 0.0, 0.0
    return mean - max(low, mean - half), min(high, mean + half) - mean


def plot_summary(
    summary: dict[str, dict[str, tuple[float, float, int]]],
    path: Path,
    rows: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """``sweep.png``: one panel per headline metric (a factor's NMI and its baselines together,
    :func:`summary_panels`), the cells down the side. Each cell's mean with its 95% interval cut at the
    metric's range (:func:`metric_range`: an NMI interval never leaves [0, 1]), and with ``rows`` (the
    per-seed results of :func:`run_sweep`) every seed's value as a small point. In a factor's panel the
    latent comes first (circles, the first error bar of the axes), then its baselines, each a marker of its
    own, slightly below the cell's row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = list(summary)
    panels = summary_panels(list(next(iter(summary.values()), {})))
    cols = min(3, max(1, len(panels)))
    nrows = max(1, math.ceil(len(panels) / cols))
    figure = Figure(figsize=(5 * cols, 0.8 + (0.45 * len(cells) + 1.3) * nrows), layout="constrained")
    FigureCanvasAgg(figure)
    for i, (title, keys) in enumerate(panels):
        axis = figure.add_subplot(nrows, cols, i + 1)
        for j, key in enumerate(keys):
            low, high = metric_range(key)
            offset = 0.0 if j == 0 else 0.12 * j
            name, marker = "latent", "o"
            for part, label, shape in SWEEP_BASELINES:
                if f".{part}." in key:
                    name, marker = label, shape
            ys = [c + offset for c in range(len(cells))]
            means = [summary[c][key][0] for c in cells]
            errors = [_clipped_error(*summary[c][key][:2], low, high) for c in cells]
            colour = f"C{j}"
            axis.errorbar(
                means,
                ys,
                xerr=[[e[0] for e in errors], [e[1] for e in errors]],
                fmt=marker,
                capsize=3,
                color=colour,
                label=name if len(keys) > 1 else None,
            )
            if rows is not None:
                xs, seed_ys = [], []
                for c, cell in enumerate(cells):
                    for row in rows:
                        if row.get("cell") == cell and isinstance(row.get(key), float) and math.isfinite(row[key]):
                            xs.append(row[key])
                            seed_ys.append(c + offset)
                axis.scatter(xs, seed_ys, s=12, marker="x", color=colour, alpha=0.6, linewidths=1)
        axis.set_yticks(range(len(cells)), cells, fontsize=7)
        axis.set_ylim(len(cells) - 0.5, -0.5)  # the first cell on top
        low, high = metric_range(keys[0])
        if math.isfinite(low) and math.isfinite(high):
            axis.set_xlim(low - 0.03 * (high - low), high + 0.03 * (high - low))
        axis.set_title(title, fontsize=9)
        axis.grid(axis="x", alpha=0.3)
        if len(keys) > 1:
            axis.legend(fontsize=6)
    from .report import save_figure

    save_figure(figure, path, dpi=110)
    return path


# ------------------------------------------------------------------------------------------------
# command line


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``disentangle sweep`` (``cli.SUBCOMMANDS``; its help is this module's docstring)."""
    parser.add_argument("--config", help="base config file (YAML or JSON)")
    parser.add_argument(
        "--preset",
        metavar="PRESET",
        help=f"a named recipe under the base config and the cells (one of {', '.join(PRESETS)}; "
        "as train's --preset; a cell may set preset=NAME too)",
    )
    parser.add_argument("--output-dir", required=True, help="the sweep's directory")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2", help="a grid axis (repeat)")
    parser.add_argument("--cell", action="append", default=[], metavar="'NAME F=V ...'", help="a named cell (repeat)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--eval-data", help="evaluation data: validation (default), train, chatterbot or a .jsonl file")
    parser.add_argument("--eval-max-examples", type=int, help="evaluate at most this many examples")
    parser.add_argument("--jobs", type=int, default=1, help="(cell, seed) runs at once, in separate processes")
    parser.set_defaults(func=_sweep_main)


def without_reserved(base: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(base without the fields the sweep sets itself, those fields' values in base)``: a base config may set
    ``seed`` or ``output_dir`` (``configs/default.yaml`` does); the sweep overrides them."""
    return {k: v for k, v in base.items() if k not in RESERVED}, {k: v for k, v in base.items() if k in RESERVED}


def _sweep_main(args: argparse.Namespace) -> int:
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as exc:
        raise ConfigError(f"--seeds {args.seeds!r}: expected comma-separated integers") from exc
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    base = read_config_file(args.config) if args.config else {}
    base, overridden = without_reserved(base)
    if overridden:
        print(
            f"sweep: the base config {args.config} sets {', '.join(f'{k}={v!r}' for k, v in overridden.items())}; "
            "the sweep sets these itself (--seeds, --output-dir): overriding them"
        )
    if args.preset is not None:
        base[PRESET_KEY] = args.preset  # the flag's preset replaces the file's; the file's fields stay on top
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
    print(f"seed to keep per cell: {out / 'kept.json'}")
    return 0
