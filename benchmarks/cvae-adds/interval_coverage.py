"""How often does a read-back's 95 % interval cover the read-back over new prompts? docs/what-the-cvae-adds.md, s. 44.

    python benchmarks/cvae-adds/interval_coverage.py [--trials 1000]

A simulated read-back: ``P`` prompts, each with its own share of right generations drawn around a mean (a normal
of the given spread, clipped to [0, 1]: some prompts are harder than others), ``n`` generations a prompt, each
right at its prompt's share. The quantity an eval estimates is the share over new prompts (the clipped normal's
mean). Per setting, the share of trials whose interval covers it, for the three intervals eval could give:
Wilson's (every generation an independent draw), the prompts resampled alone (a one-stage bootstrap), and
``controllability.share_interval`` (the prompts resampled, then the generations within each drawn prompt), eval's
``accuracy_interval_by_prompt``. A nominal 95 % interval should cover about 0.95 of the trials.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from disentanglement.controllability import share_interval  # noqa: E402

#: (prompts, generations a prompt, mean share, spread of the prompts' shares): eval's held-out synthetic sets have
#: eight prompts (five codes, one to five draws), chatterbot-style's evals 24 or 72 prompts of eight codes
SETTINGS = ((8, 25, 0.9, 0.0), (8, 25, 0.9, 0.08), (8, 5, 0.9, 0.05), (4, 16, 0.8, 0.1), (24, 8, 0.95, 0.04))


def one_stage(hits: np.ndarray, prompts: np.ndarray, rng: np.random.Generator, resamples: int) -> list[float]:
    """The percentile interval with the prompts resampled and each drawn prompt's generations kept as they were."""
    count = prompts.max() + 1
    right, n = np.bincount(prompts, hits, count), np.bincount(prompts, minlength=count)
    draws = rng.multinomial(count, np.full(count, 1 / count), size=resamples)
    return list(np.percentile((draws @ right) / (draws @ n), [2.5, 97.5]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--resamples", type=int, default=1000)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print("| prompts | generations a prompt | mean share | spread | Wilson | prompts alone | two-stage (eval's) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for prompts_n, per_prompt, mean, spread in SETTINGS:
        truth = np.clip(np.random.default_rng(9).normal(mean, spread, 200_000), 0, 1).mean()
        covered = np.zeros(3)
        for trial in range(args.trials):
            shares = np.clip(rng.normal(mean, spread, prompts_n), 0, 1)
            prompts = np.repeat(np.arange(prompts_n), per_prompt)
            hits = rng.random(len(prompts)) < shares[prompts]
            wilson = binomtest(int(hits.sum()), len(hits)).proportion_ci(method="wilson")
            intervals = (
                (wilson.low, wilson.high),
                one_stage(hits, prompts, rng, args.resamples),
                share_interval(hits, prompts, resamples=args.resamples, seed=trial),
            )
            covered += [low <= truth <= high for low, high in intervals]
        cells = " | ".join(f"{c / args.trials:.3f}" for c in covered)
        print(f"| {prompts_n} | {per_prompt} | {mean} | {spread} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
