"""The thesis tables of docs/results.md from finished sweep runs: one row per (data set, cell) over every seed found.

A sweep writes each run's eval report to ``OUT/runs/CELL/seed-S/eval/sweep_eval.json``; docs/results.md's
rows come from several sweep directories (one per batch of cells run). This reads every such report under
the given roots, names its data set by the run's training file (``data.data`` of its ``config.yaml``,
``runs/thesis/data/two-factor-train.jsonl`` -> ``two-factor``), and prints per data set a Markdown table:
per factor, the latent's NMI as mean ± the 95% Student-t half-width over seeds with the per-seed values,
the latent gain, the per-token NLL of the held-out responses under the posterior latent per seed (and
under the z-free model), the baselines (k-means of the encoder features, of the prompt-only features,
random), and the decoder dtype the runs used. The same (data set, cell, seed) found in two directories counts once
(and must agree).

    .venv/bin/python benchmarks/thesis/table.py runs/thesis
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from disentanglement.sweep import mean_and_interval


def find_runs(roots: list[Path]) -> dict[tuple[str, str], dict[int, dict]]:
    """``{(data set, cell): {seed: {"report", "dtype", "path"}}}`` of every finished sweep run under ``roots``."""
    found: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for root in roots:
        for report_path in sorted(root.glob("**/runs/*/seed-*/eval/sweep_eval.json")):
            run_dir = report_path.parent.parent
            config = yaml.safe_load((run_dir / "config.yaml").read_text())
            data_set = Path(config["data"]["data"]).name.removesuffix(".jsonl").removesuffix("-train")
            cell, seed = run_dir.parent.name, int(run_dir.name.removeprefix("seed-"))
            report = json.loads(report_path.read_text())
            earlier = found[data_set, cell].get(seed)
            if earlier is not None:
                if earlier["report"].get("factors") != report.get("factors"):
                    raise SystemExit(f"{report_path} and {earlier['path']}: the same run with different results")
                continue
            found[data_set, cell][seed] = {"report": report, "dtype": config["model"]["dtype"], "path": report_path}
    return found


def _cell(values: list[float], with_seeds: bool = True) -> str:
    mean, half, n = mean_and_interval(values)
    text = f"{mean:.3f}" if n < 2 else f"{mean:.3f} ± {half:.3f}"
    if with_seeds and n > 1:
        text += " (" + ", ".join(f"{v:.2f}" for v in values) + ")"
    return text


def table(data_set: str, cells: dict[str, dict[int, dict]]) -> str:
    factors = sorted({f for runs in cells.values() for r in runs.values() for f in r["report"].get("factors", {})})
    head = ["cell", "seeds", "dtype"] + [f"NMI {f}" for f in factors] + ["latent gain", "posterior NLL (z-free)"]
    head += [f"encoder k-means {'/'.join(factors)}", f"prior k-means {'/'.join(factors)}", "random"]
    lines = [f"### {data_set}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for cell, runs in sorted(cells.items()):
        seeds = sorted(runs)
        reports = [runs[s]["report"] for s in seeds]

        def metric(factor: str, source: str, reports: list[dict] = reports) -> list[float]:
            return [r["factors"][factor][source]["nmi"] for r in reports]

        row = [cell, ",".join(map(str, seeds)), "/".join(sorted({runs[s]["dtype"] for s in seeds}))]
        row += [_cell(metric(f, "latent")) for f in factors]
        row.append(_cell([r["latent_gain_nats_per_token"] for r in reports], with_seeds=False))
        posterior = [r["posterior_nll_nats_per_token"] for r in reports]
        zfree = mean_and_interval([r["zfree_nll_nats_per_token"] for r in reports])[0]
        row.append(", ".join(f"{v:.2f}" for v in posterior) + f" ({zfree:.2f})")
        for source in ("encoder_kmeans", "prior_kmeans"):
            row.append(" / ".join(f"{mean_and_interval(metric(f, source))[0]:.3f}" for f in factors))
        row.append(f"{mean_and_interval(metric(factors[0], 'random'))[0]:.3f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("roots", nargs="+", type=Path, help="folders holding sweep output directories")
    args = parser.parse_args(argv)
    found = find_runs(args.roots)
    by_set: dict[str, dict[str, dict[int, dict]]] = defaultdict(dict)
    for (data_set, cell), runs in found.items():
        by_set[data_set][cell] = runs
    for data_set in sorted(by_set):
        print(table(data_set, by_set[data_set]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
