"""Where the seeds' token weights fall on the built-in hidden-factor sets (embedded model, z-free reference).

For each response token of a ``two-factor``, ``style-in-content`` or ``style-in-echo`` file this takes the z-free surprisal
``b_t`` and term 3's share ``pi_t = b_t^alpha / sum_s b_s^alpha`` (eps 0), and reports, per alpha, the mean
over examples of the weight that falls on each part of the response: ``two-factor``: the rare word (factor A),
the opener and closer (factor B), the fixed sentence; the style sets: the style marker, the content (and
the end-of-sequence token in both). Printed as a Markdown table.

    .venv/bin/python benchmarks/thesis/weight_shares.py runs/thesis/data/two-factor-heldout.jsonl
"""

from __future__ import annotations

import argparse
import sys

import torch

from disentanglement.config import DataConfig, ModelConfig
from disentanglement.data import load_jsonl, tokenize_pairs
from disentanglement.lm import load_model_and_tokenizer
from disentanglement.synthetic import STYLE_MARKERS, TWO_FACTOR_PHRASINGS, TWO_FACTOR_WORDS


def part_of_char(kind: str, response: str, label: dict) -> list[str]:
    """Each character of ``response`` named by the part of the response it belongs to."""
    parts = ["content"] * len(response)
    if kind == "two-factor":
        parts = ["sentence"] * len(response)
        opener, closer = TWO_FACTOR_PHRASINGS[label["B"]]
        for start, text, name in (
            (0, opener, "B (opener)"),
            (response.rindex(closer), closer, "B (closer)"),
            (response.index(f" {label['A']} "), f" {label['A']}", "A (rare word)"),
        ):
            parts[start : start + len(text)] = [name] * len(text)
    else:
        where, marker = STYLE_MARKERS[label["style"]]
        if where == "prefix":
            parts[: len(marker)] = ["style marker"] * len(marker)
        elif where == "suffix":
            parts[len(response) - len(marker) :] = ["style marker"] * len(marker)
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", help="a two-factor, style-in-content or style-in-echo JSONL file")
    parser.add_argument("--alphas", default="0,0.5,1,2")
    parser.add_argument("--max-examples", type=int, default=200)
    args = parser.parse_args(argv)
    assert TWO_FACTOR_WORDS
    pairs = load_jsonl(args.data)[: args.max_examples]
    kind = "two-factor" if "A" in pairs[0].label else "style"
    model, tokenizer = load_model_and_tokenizer(ModelConfig(dtype="float32"))
    cfg = DataConfig(chat_template=True, max_prompt_tokens=48, max_response_tokens=32)
    examples, _ = tokenize_pairs(pairs, tokenizer, cfg)
    alphas = [float(a) for a in args.alphas.split(",")]
    totals: dict[float, dict[str, float]] = {a: {} for a in alphas}
    surprisal: dict[str, list[float]] = {}
    for pair, ex in zip(pairs, examples, strict=True):
        ids = torch.tensor([list(ex.prompt_ids) + list(ex.response_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(ex.prompt_ids) - 1 : -1].float()
        b = torch.nn.functional.cross_entropy(logits, ids[0, len(ex.prompt_ids) :], reduction="none")
        # name each response token by the part its first character belongs to
        response_text = pair.response
        chars = part_of_char(kind, response_text, pair.label)
        names, offset = [], 0
        for token in ex.response_ids:
            piece = tokenizer.decode([token])
            found = response_text.find(piece.strip(), offset) if piece.strip() else -1
            if found < 0:
                names.append("end of sequence" if token == tokenizer.eos_token_id else "other")
                continue
            names.append(chars[found])
            offset = found + len(piece.strip())
        for name, value in zip(names, b.tolist(), strict=True):
            surprisal.setdefault(name, []).append(value)
        for a in alphas:
            w = b.clamp_min(1e-12) ** a
            w = w / w.sum()
            for name, share in zip(names, w.tolist(), strict=True):
                totals[a][name] = totals[a].get(name, 0.0) + share / len(pairs)
    names = sorted(surprisal)
    print(f"{args.data}: {len(pairs)} examples, mean weight share per example (pi_t summed over the part)\n")
    print("| part | tokens / example | mean b_t (nats) | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in alphas) + " |")
    for name in names:
        values = surprisal[name]
        shares = " | ".join(f"{totals[a].get(name, 0.0):.3f}" for a in alphas)
        print(f"| {name} | {len(values) / len(pairs):.2f} | {sum(values) / len(values):.2f} | {shares} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
