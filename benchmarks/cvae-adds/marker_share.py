"""Where a run's latent helps, token by token: on the style marker or on the rest of the response.

    python benchmarks/cvae-adds/marker_share.py RUN --data HELDOUT.jsonl [--examples 64]

For a run on a set with hidden style markers (``style-in-content``, ``style-in-echo``, ``chatterbot-style``), each
of the first ``--examples`` examples of ``--data`` is scored as ``disentangle inspect`` scores one
(:func:`disentanglement.inspection.token_values`), and its response tokens are split in three (:func:`token_parts`):
the marker's tokens, the end (the end-of-sequence token, where a suffix marker or its absence is decided, and what
the chat template writes after it) and the content. Per part, summed over the part's tokens and averaged over the
examples (the marker column over every example, plain ones included): the z-free surprisal ``b_t``, term 3's
weight ``pi_t``, the decoder's NLL under the posterior code ``l_t``, and the latent gain ``prior_nll -
conditioned_nll`` (what the posterior code saves over the prior mixture, the quantity ``eval`` averages per token).
A latent that carries the style gains on the marker and the end; one that carries something else gains on the
content. Last, per style, the probability the decoder gives the end-of-sequence token where the response ends, under
the posterior code (:func:`end_probability`; mean, median and least): a decoder that has learnt where a response
with a suffix marker ends gives it nearly 1 (section 42). Responses cut off before their end (no end-of-sequence
token: a long ``chatterbot-style`` response under ``max_response_tokens``) are left out and counted.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from disentanglement.inspection import token_values  # noqa: E402
from disentanglement.runs import load_checkpoint, load_examples  # noqa: E402
from disentanglement.synthetic import STYLE_MARKERS  # noqa: E402

PARTS = ("marker", "end", "content")
QUANTITIES = {
    "zfree_surprisal": "z-free b_t",
    "token_weight": "term 3's pi_t",
    "conditioned_nll": "posterior NLL l_t",
    "latent_gain": "latent gain",
}


def token_parts(tokens: list[str], specials: set[str], style: str) -> list[str] | None:
    """Each response token's part, or None for a response cut off before its end (no special token in ``tokens``).

    "end" from the first special token on; before it, "marker" for a token whose first character that is not
    whitespace (a token's leading space belongs to the gap before it) lies in the span of the style's marker in the
    text the tokens spell, "content" otherwise. A style whose marker the text does not show has no marker tokens.
    """
    end = next((i for i, token in enumerate(tokens) if token in specials), None)
    if end is None:
        return None
    text = "".join(tokens[:end]).rstrip()
    where, marker = STYLE_MARKERS[style]
    marker = marker.strip()
    span = (0, 0)
    if where == "prefix" and text.startswith(marker):
        span = (0, len(marker))
    elif where == "suffix" and text.endswith(marker):
        span = (len(text) - len(marker), len(text))
    parts, position = [], 0
    for token in tokens[:end]:
        start = position + (len(token) - len(token.lstrip()))
        parts.append("marker" if span[0] <= start < span[1] else "content")
        position += len(token)
    return parts + ["end"] * (len(tokens) - end)


def end_probability(parts: list[str], conditioned_nll: list[float]) -> float:
    """``exp(-l_t)`` at the response's first "end" token (its end-of-sequence token): the probability the decoder
    gives ending there, under the code it was scored with."""
    return math.exp(-conditioned_nll[parts.index("end")])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run")
    parser.add_argument("--data", required=True)
    parser.add_argument("--examples", type=int, default=64)
    args = parser.parse_args(argv)
    model, tokenizer, config, _, _, _ = load_checkpoint(args.run, device="cpu")
    examples, _ = load_examples(args.data, config, tokenizer)
    specials = set(tokenizer.all_special_tokens)
    sums = defaultdict(float)
    styles = defaultdict(int)
    cut_off = 0
    ends = defaultdict(list)
    for example in examples[: args.examples]:
        style = example.label["style"]
        tokens, values, _ = token_values(model, tokenizer, example)
        parts = token_parts(tokens, specials, style)
        if parts is None:
            cut_off += 1
            continue
        styles[style] += 1
        ends[style].append(end_probability(parts, values["conditioned_nll"]))
        for quantity in QUANTITIES:
            for part, value in zip(parts, values[quantity], strict=True):
                sums[quantity, part] += value
                sums[quantity, style, part] += value
    n = sum(styles.values())
    print(
        f"{args.run}: {n} examples of {args.data} ({cut_off} cut off before their end left out); per example, "
        "summed over each part's tokens"
    )
    print(
        "| quantity | " + " | ".join(PARTS) + " | " + " | ".join(f"{s}: marker / end / content" for s in styles) + " |"
    )
    print("| --- " * (1 + len(PARTS) + len(styles)) + "|")
    for quantity, name in QUANTITIES.items():
        cells = [f"{sums[quantity, p] / n:.3f}" for p in PARTS]
        cells += [" / ".join(f"{sums[quantity, s, p] / styles[s]:.2f}" for p in PARTS) for s in styles]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    print("| style | examples | p(end) under the posterior code: mean | median | least |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for s, p in ends.items():
        print(f"| {s} | {len(p)} | {statistics.fmean(p):.3f} | {statistics.median(p):.3f} | {min(p):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
