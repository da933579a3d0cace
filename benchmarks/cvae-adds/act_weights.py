"""Where term 3's weights fall in each value of a label: per value (DailyDialog's act, say), the share of a
response's weight ``pi_t`` on its first word, on its question marks, on its end tokens and on the rest, beside the
share each part has of the response's tokens (what ``1/n`` gives it: the uniform bag-of-words loss), section 36.

    python benchmarks/cvae-adds/act_weights.py RUN --data dd-eval.jsonl --factor act --examples 300
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from disentanglement.inspection import token_values  # noqa: E402
from disentanglement.runs import load_checkpoint, load_examples  # noqa: E402

PARTS = ("first word", "question mark", "end", "rest")


def token_parts(tokens: list[str], specials: set[str]) -> list[str]:
    """Each response token's part: ``end`` (a special token or whitespace alone), ``question mark`` (holds a "?"),
    ``first word`` (the first token that is neither), else ``rest``."""
    parts, seen_word = [], False
    for token in tokens:
        if token in specials or not token.replace("Ċ", "").replace("Ġ", "").strip():
            parts.append("end")
        elif "?" in token:
            parts.append("question mark")
        elif not seen_word:
            parts.append("first word")
        else:
            parts.append("rest")
        seen_word = seen_word or parts[-1] in ("first word", "question mark")
    return parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run")
    parser.add_argument("--data", required=True)
    parser.add_argument("--factor", default="act")
    parser.add_argument("--examples", type=int, default=300)
    args = parser.parse_args(argv)
    model, tokenizer, config, _, _, _ = load_checkpoint(args.run, device="cpu")
    examples, _ = load_examples(args.data, config, tokenizer)
    specials = set(tokenizer.all_special_tokens)
    weight, share, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for example in examples[: args.examples]:
        value = example.label[args.factor]
        tokens, values, _ = token_values(model, tokenizer, example)
        count[value] += 1
        for part, pi in zip(token_parts(tokens, specials), values["token_weight"], strict=True):
            weight[value, part] += pi
            share[value, part] += 1 / len(tokens)
    print(f"{args.run}: term 3's weight pi_t / the share of the tokens, per part of a response, mean per example")
    print(f"| {args.factor} | examples | " + " | ".join(PARTS) + " |")
    print("| --- " * (2 + len(PARTS)) + "|")
    for value in sorted(count):
        n = count[value]
        cells = [f"{weight[value, p] / n:.3f} / {share[value, p] / n:.3f}" for p in PARTS]
        print(f"| {value} | {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
