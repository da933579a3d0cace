"""DailyDialog's act read from the generated text itself: how often each code's generations ask a question.

    disentangle generate RUN --prompt P1 --prompt P2 ... --mode codes --greedy --json --output gens.json
    python benchmarks/cvae-adds/questions.py gens.json [--data HELDOUT.jsonl]

No detector reads a dialogue act from text (eval reads it with a classifier on frozen features), but one act shows on
the surface: a response labelled ``question`` asks one. Per code of ``gens.json`` (``disentangle generate --json``):
the generations and the share of them with a question mark. With ``--data`` (a labelled JSONL, ``label.act``) it also
prints that share among the real responses of each act, the yardstick: a code that stands for ``question`` should
ask about as often as real questions do, one that stands for another act about as rarely as those.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def asks(text: str) -> bool:
    """Whether a response asks a question (a question mark anywhere in it)."""
    return "?" in text


def share_by_code(generations: list[dict]) -> dict[str, tuple[int, float]]:
    """``latent -> (generations, share that ask)``, the latents in their first order."""
    texts: dict[str, list[str]] = defaultdict(list)
    for row in generations:
        texts[row["latent"]].append(row["text"])
    return {latent: (len(rows), sum(map(asks, rows)) / len(rows)) for latent, rows in texts.items()}


def share_by_act(rows: list[dict]) -> dict[str, tuple[int, float]]:
    """``act -> (responses, share that ask)`` over labelled rows, the acts sorted."""
    texts: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        texts[row["label"]["act"]].append(row["response"])
    return {act: (len(texts[act]), sum(map(asks, texts[act])) / len(texts[act])) for act in sorted(texts)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("generations", type=Path, help="the JSON of disentangle generate --json --output")
    parser.add_argument(
        "--data", type=Path, default=None, help="labelled JSONL (label.act): the real responses' shares"
    )
    args = parser.parse_args(argv)
    generations = json.loads(args.generations.read_text())["generations"]
    print("| code | generations | share with a question mark |\n| --- | --- | --- |")
    for latent, (count, share) in share_by_code(generations).items():
        print(f"| {latent} | {count} | {share:.3f} |")
    if args.data is not None:
        rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
        print("\n| real responses: act | responses | share with a question mark |\n| --- | --- | --- |")
        for act, (count, share) in share_by_act(rows).items():
            print(f"| {act} | {count} | {share:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
