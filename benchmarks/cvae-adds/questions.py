"""DailyDialog's act read from the generated text itself: how often each code's generations ask a question.

    disentangle generate RUN --prompt P1 --prompt P2 ... --mode codes --greedy --json --output gens.json
    python benchmarks/cvae-adds/questions.py gens.json [--data HELDOUT.jsonl]

No detector reads a dialogue act from text (eval reads it with a classifier on frozen features), but one act shows on
the surface: a response labelled ``question`` asks one. Per code of ``gens.json`` (``disentangle generate --json``):
the generations and the share of them with a question mark. With ``--data`` (a labelled JSONL, ``label.act``) it also
prints that share among the real responses of each act, the yardstick: a code that stands for ``question`` should
ask about as often as real questions do, one that stands for another act about as rarely as those; and the act's
NMI with that one bit (asks or not), what a surface rule holds of the act beside what the codes hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from disentanglement.data import DataError, PromptResponse, label_factors, load_jsonl  # noqa: E402
from disentanglement.metrics import label_agreement  # noqa: E402


def asks(text: str) -> bool:
    """Whether a response asks a question (a question mark anywhere in it)."""
    return "?" in text


def share_that_ask(keyed_texts: Iterable[tuple[str, str]]) -> dict[str, tuple[int, float]]:
    """``key -> (texts, share that ask)`` over ``(key, text)`` pairs, the keys in their first order."""
    texts: dict[str, list[str]] = defaultdict(list)
    for key, text in keyed_texts:
        texts[key].append(text)
    return {key: (len(rows), sum(map(asks, rows)) / len(rows)) for key, rows in texts.items()}


def share_by_code(generations: list[dict]) -> dict[str, tuple[int, float]]:
    """``latent -> (generations, share that ask)`` over ``generate --json``'s rows, the latents in their first order."""
    return share_that_ask((row["latent"], row["text"]) for row in generations)


def act(pair: PromptResponse) -> str:
    """The pair's ``act`` label factor; a pair without one is a :class:`DataError` naming its file and line."""
    factors = label_factors(pair.label) or {}
    if "act" not in factors:
        raise DataError(f"{pair.source}: expected a label with an 'act' factor, got {pair.label!r}")
    return factors["act"]


def share_by_act(pairs: Sequence[PromptResponse]) -> dict[str, tuple[int, float]]:
    """``act -> (responses, share that ask)`` over labelled pairs (:func:`load_jsonl`), the acts sorted."""
    return dict(sorted(share_that_ask((act(pair), pair.response) for pair in pairs).items()))


def question_mark_nmi(pairs: Sequence[PromptResponse]) -> float:
    """The NMI of the act with one bit of the response's surface, whether it asks (``eval``'s
    :func:`~disentanglement.metrics.label_agreement`): what a rule with no training and two clusters holds of the act,
    beside the codes'."""
    return label_agreement([asks(pair.response) for pair in pairs], [act(pair) for pair in pairs])["nmi"]


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
        print("\n| real responses: act | responses | share with a question mark |\n| --- | --- | --- |")
        pairs = load_jsonl(args.data)
        for name, (count, share) in share_by_act(pairs).items():
            print(f"| {name} | {count} | {share:.3f} |")
        print(f"\nthe act's NMI with a question mark (asks or not): {question_mark_nmi(pairs):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
