"""Does the seed with the highest latent gain hold the factor best? docs/what-the-cvae-adds.md, section 17.

    python benchmarks/cvae-adds/seed_choice.py OUT/evals/*.json

Groups eval reports (``disentangle eval``'s JSON, run.py's ``NAME-seed-S.json``; guided re-evaluations are left
out) by their run's name, one group per (set, recipe); in each group of two seeds or more, ranks the seeds by
``latent_gain_nats_per_token`` (the prior mixture's NLL minus the posterior's, measured without labels) and prints,
per factor, each seed's NMI, the seed ``disentangle sweep`` keeps (``sweep.kept_seeds``: the highest gain),
whether its NMI is the best one (a tie counts), and, with three seeds or more, the rank correlation (Spearman) of
gain and NMI over the group's seeds. Reports without a finite gain are left out.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from disentanglement.front import front_factors  # noqa: E402
from disentanglement.sweep import KEEP_BY, flatten_report, kept_seeds  # noqa: E402


def groups(paths: list[Path]) -> dict[str, list[dict]]:
    """``{run name: [flattened report with "cell" and "seed"]}`` of the plain (not guided) reports."""
    found: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        match = re.fullmatch(r"(.+)-seed-(\d+)\.json", path.name)
        if match is None:
            raise SystemExit(f"{path}: expected a report named NAME-seed-S.json (run.py's)")
        row = flatten_report(json.loads(path.read_text()))
        row.update(cell=match.group(1), seed=int(match.group(2)))
        found[match.group(1)].append(row)
    return {name: sorted(rows, key=lambda r: r["seed"]) for name, rows in sorted(found.items())}


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv if "-guided-" not in Path(p).name]
    for name, rows in groups(paths).items():
        rows = [r for r in rows if KEEP_BY in r]  # flatten_report leaves out a gain that is not finite
        if len(rows) < 2:
            continue
        keep = kept_seeds(rows, [name])[name]["seed"]
        print(f"{name}: keeps seed {keep} of {len(rows)}")
        for factor, key in sorted(front_factors(rows), key=lambda pair: pair[1]):
            scored = sorted((r for r in rows if key in r), key=lambda r: (-r[KEEP_BY], r["seed"]))
            kept = next((r for r in scored if r["seed"] == keep), None)
            if kept is None:
                print(f"  {factor}: the kept seed has no NMI")
                continue
            best = max(scored, key=lambda r: (r[key], -r["seed"]))
            gains, nmis = [r[KEEP_BY] for r in scored], [r[key] for r in scored]
            rho = spearmanr(gains, nmis).statistic if len(scored) > 2 and len(set(nmis)) > 1 else None
            seeds = ", ".join(f"s{r['seed']} {r[KEEP_BY]:+.4f} / {r[key]:.3f}" for r in scored)
            verdict = " = kept" if kept[key] == best[key] else ""
            print(
                f"  {factor}: gain / NMI by gain: {seeds}; kept {kept[key]:.3f}, best {best[key]:.3f} "
                f"(seed {best['seed']}){verdict}, Spearman {'-' if rho is None else f'{rho:+.2f}'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
