"""How often does a 95 % interval cover its quantity over new prompts? docs/what-the-cvae-adds.md, s. 44 and 45.

    python benchmarks/cvae-adds/interval_coverage.py [--trials 1000]

A simulated read-back: ``P`` prompts, each with its own share of right generations drawn around a mean (a normal
of the given spread, clipped to [0, 1]: some prompts are harder than others), ``n`` generations a prompt, each
right at its prompt's share. The quantity an eval estimates is the share over new prompts (the clipped normal's
mean). Per setting, the share of trials whose interval covers it, for the three intervals eval could give:
Wilson's (every generation an independent draw), the prompts resampled alone (a one-stage bootstrap), and
``controllability.share_interval`` (the prompts resampled, then the generations within each drawn prompt), eval's
``accuracy_interval_by_prompt``. A nominal 95 % interval should cover about 0.95 of the trials.

Then the same for the fluency ratio (the generations' pooled z-free NLL per token over the same prompts' real
responses'): each prompt's difficulty a log-normal around 3.3 nats a token, each generation and each real response
(8-30 tokens) a log-normal spread around it; the quantity is the ratio of the pooled NLLs over new prompts. The
intervals: the prompts resampled alone (eval's before section 45) and ``nll_ratio_interval`` (the prompts, then the
generations within each drawn prompt; eval's ``zfree_nll_ratio_interval_same_prompts``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from disentanglement.controllability import nll_ratio_interval, share_interval  # noqa: E402

#: (prompts, generations a prompt, mean share, spread of the prompts' shares): eval's held-out synthetic sets have
#: eight prompts (five codes, one to five draws), chatterbot-style's evals 24 or 72 prompts of eight codes
SETTINGS = ((8, 25, 0.9, 0.0), (8, 25, 0.9, 0.08), (8, 5, 0.9, 0.05), (4, 16, 0.8, 0.1), (24, 8, 0.95, 0.04))
#: (prompts, generations a prompt, real responses a prompt, spread of the prompts' difficulty, spread of a
#: generation's and of a real response's NLL per token around it, the generations' NLL over the real responses'):
#: held-out style-in-content has eight prompts of 25 real responses each, chatterbot-style's evals 24-72 of one
RATIO_SETTINGS = ((8, 25, 25, 0.2, 0.15, 0.95), (8, 25, 1, 0.2, 0.15, 0.95), (8, 5, 1, 0.1, 0.3, 0.95),
                  (24, 8, 1, 0.2, 0.15, 1.05), (24, 8, 1, 0.1, 0.3, 1.05), (24, 8, 3, 0.1, 0.3, 1.05),
                  (72, 8, 1, 0.2, 0.15, 1.0))  # fmt: skip


def one_stage(hits: np.ndarray, prompts: np.ndarray, rng: np.random.Generator, resamples: int) -> list[float]:
    """The percentile interval with the prompts resampled and each drawn prompt's generations kept as they were."""
    count = prompts.max() + 1
    right, n = np.bincount(prompts, hits, count), np.bincount(prompts, minlength=count)
    draws = rng.multinomial(count, np.full(count, 1 / count), size=resamples)
    return list(np.percentile((draws @ right) / (draws @ n), [2.5, 97.5]))


def ratio_rows(rng: np.random.Generator, prompts: int, per_prompt: int, real: int, spread: float, noise: float,
               ratio: float):  # fmt: skip
    """``(generated, real)`` rows as ``nll_ratio_interval`` takes them: ``(nll_sums, token_counts, prompt)``."""
    difficulty = np.exp(rng.normal(np.log(3.3), spread, prompts))
    prompt, real_prompt = np.repeat(np.arange(prompts), per_prompt), np.repeat(np.arange(prompts), real)
    tokens, real_tokens = rng.integers(8, 31, len(prompt)), rng.integers(8, 31, len(real_prompt))
    nll = tokens * ratio * difficulty[prompt] * np.exp(rng.normal(0, noise, len(prompt)))
    real_nll = real_tokens * difficulty[real_prompt] * np.exp(rng.normal(0, noise, len(real_prompt)))
    return (nll, tokens, prompt), (real_nll, real_tokens, real_prompt)


def ratio_one_stage(generated, real, rng: np.random.Generator, resamples: int) -> list[float]:
    """The ratio's percentile interval with the prompts resampled (their real responses with them) and each drawn
    prompt's rows kept as they were."""
    sums = [np.stack([np.bincount(p, n), np.bincount(p, t)], axis=1) for n, t, p in (generated, real)]
    draws = rng.multinomial(len(sums[0]), np.full(len(sums[0]), 1 / len(sums[0])), size=resamples)
    (g, r) = (draws @ one for one in sums)
    return list(np.percentile(g[:, 0] / g[:, 1] / (r[:, 0] / r[:, 1]), [2.5, 97.5]))


def ratio_truth(spread: float, noise: float, ratio: float) -> float:
    """The pooled ratio over 200,000 new prompts, one generation each."""
    generated, real = ratio_rows(np.random.default_rng(9), 200_000, 1, 1, spread, noise, ratio)
    return float(generated[0].sum() / generated[1].sum() / (real[0].sum() / real[1].sum()))


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
    print("\n| prompts | generations a prompt | real responses a prompt | spread of the prompts | of a response "
          "| ratio | prompts alone | two-stage (eval's) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for prompts_n, per_prompt, real_n, spread, noise, ratio in RATIO_SETTINGS:
        truth = ratio_truth(spread, noise, ratio)
        covered = np.zeros(2)
        for trial in range(args.trials):
            generated, real = ratio_rows(rng, prompts_n, per_prompt, real_n, spread, noise, ratio)
            intervals = (
                ratio_one_stage(generated, real, rng, args.resamples),
                nll_ratio_interval(generated, real, paired=True, resamples=args.resamples, seed=trial),
            )
            covered += [low <= truth <= high for low, high in intervals]
        cells = " | ".join(f"{c / args.trials:.3f}" for c in covered)
        print(f"| {prompts_n} | {per_prompt} | {real_n} | {spread} | {noise} | {truth:.3f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
