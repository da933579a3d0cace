"""What each slot's codes hold on ``style-in-content``: the style, the topic, or the answer among a topic's five.

    disentangle encode RUN --data HELDOUT.jsonl --output LATENTS.jsonl
    python benchmarks/cvae-adds/what_codes_hold.py LATENTS.jsonl [...]

In ``style-in-content`` two things in a response are not predicted by its prompt: the hidden style (one of 4
markers, log 4 = 1.39 nats) and which of its topic's 5 answer sentences it is (log 5 = 1.61 nats; the prompt gives
the topic, not the answer). The data's labels name the style and the topic only; the answer is read from the
response itself (the text without its style marker). Per file (an ``encode`` output), per slot and for the code
tuple of all slots: NMI (scikit-learn's, arithmetic normalisation, as ``eval``) with the style, the topic, the
answer (40 sentences) and the answer's index within its topic (5 values), and the number of codes used.

    python benchmarks/cvae-adds/what_codes_hold.py --per-code style LATENTS.jsonl [...]

instead counts, per code of the first slot, the examples of each value of the label ``style`` (any label of the
rows, so any set's latents file, ``.jsonl`` or ``.parquet``): which values a code holds, and how many of each.
``--key decoder_codes`` reads, in both, the decoder's own likeliest codes (``encode`` writes them where the prior
mixture is exact) instead of the encoder's ``codes``; the tables then say so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What the tables say after the file's name, by the key the codes were read from.
LABELS = {"codes": "", "decoder_codes": " (the decoder's codes)"}
sys.path.insert(0, str(ROOT / "src"))

from sklearn.metrics import normalized_mutual_info_score  # noqa: E402

from disentanglement.data import label_factors  # noqa: E402
from disentanglement.latent_file import read_latents  # noqa: E402
from disentanglement.synthetic import STYLE_MARKERS, TOPICS  # noqa: E402

FACTORS = ("style", "topic", "answer", "answer_in_topic")


def answer_of(response: str, style: str) -> str:
    """The response without its style marker."""
    where, marker = STYLE_MARKERS[style]
    text = response
    if where == "prefix" and text.startswith(marker):
        text = text[len(marker) :]
    elif where == "suffix" and text.rstrip().endswith(marker.strip()):
        text = text.rstrip()[: -len(marker.strip())]
    return text.strip()


def factors(row: dict) -> dict[str, object]:
    label = row["label"]
    answer = answer_of(row["response"], label["style"])
    answers = TOPICS[label["topic"]][1]
    if answer not in answers:
        raise ValueError(f"{row.get('source')}: response {row['response']!r} is none of its topic's answers")
    return {
        "style": label["style"],
        "topic": label["topic"],
        "answer": answer,
        "answer_in_topic": answers.index(answer),
    }


def table(path: Path, key: str = "codes") -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = [factors(row) for row in rows]
    missing = next((number for number, row in enumerate(rows, 1) if key not in row), None)
    if missing is not None:
        raise ValueError(f"{path} row {missing}: no {key!r} (a discrete CVAE's encode output has them)")
    codes = [row[key] for row in rows]
    slots = len(codes[0])
    columns = {f"slot {m}": [c[m] for c in codes] for m in range(slots)}
    if slots > 1:
        columns["all slots"] = [tuple(c) for c in codes]
    out = []
    for name, assigned in columns.items():
        keys = {a: i for i, a in enumerate(sorted(set(assigned), key=str))}
        ids = [keys[a] for a in assigned]
        nmi = [normalized_mutual_info_score([v[f] for v in values], ids) for f in FACTORS]
        out.append(
            f"| {path.parent.name}/{path.stem}{LABELS[key]} | {name} | {len(keys)} | "
            + " | ".join(f"{x:.3f}" for x in nmi)
            + " |"
        )
    return out


def per_code(path: Path, factor: str, key: str = "codes") -> list[str]:
    """Per code of the first slot, how many of its examples have each value of label ``factor``: table rows."""
    counts: dict[int, Counter] = {}
    for number, row in enumerate(read_latents(path).rows, 1):  # JSONL or Parquet, checked as generate's --latents
        label, codes = label_factors(row.get("label")) or {}, row.get(key)
        if factor not in label:
            raise ValueError(f"{path} row {number}: no label {factor!r} (labels: {sorted(label)})")
        if not isinstance(codes, list) or not codes:
            raise ValueError(f"{path} row {number}: no {key!r} (a discrete CVAE's encode output has them)")
        counts.setdefault(codes[0], Counter())[str(label[factor])] += 1
    values = sorted({value for count in counts.values() for value in count})
    header = f"| {path.parent.name}/{path.stem}{LABELS[key]} | code | " + " | ".join(values) + " | examples |"
    rows = [header, "| --- | --- |" + " --- |" * (len(values) + 1)]
    for code in sorted(counts):
        count = counts[code]
        rows.append(f"| | {code} | " + " | ".join(str(count[v]) for v in values) + f" | {sum(count.values())} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--per-code", metavar="FACTOR", help="count each code's examples per value of this label")
    parser.add_argument(
        "--key",
        default="codes",
        choices=("codes", "decoder_codes"),
        help="the encoder's codes, or the decoder's own likeliest (encode writes them where the mixture is exact)",
    )
    args = parser.parse_args(argv)
    if args.per_code is not None:
        print("\n\n".join("\n".join(per_code(path, args.per_code, args.key)) for path in args.files))
        return 0
    print("| latents | codes of | used | " + " | ".join(f"NMI {f}" for f in FACTORS) + " |")
    print("| --- | --- | --- |" + " --- |" * len(FACTORS))
    for path in args.files:
        print("\n".join(table(path, args.key)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
