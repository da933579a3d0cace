"""Real labelled corpora as prompt/response JSONL, and a split of a JSONL file by dialogue.

    disentangle data dailydialog DIR --output FILE.jsonl [--split NAME]
    disentangle data split FILE.jsonl --dialogues 0-699 --output TRAIN.jsonl [--rest EVAL.jsonl]

**DailyDialog** (Li et al., IJCNLP 2017; CC BY-NC-SA 4.0, so this project ships none of it): a split's
directory holds three line-aligned files, one dialogue a line: the text, its turns each followed by
``__eou__``; the turns' dialogue acts (1-4: inform, question, directive, commissive) and emotions (0-6: none,
anger, disgust, fear, happiness, sadness, surprise), space-separated integers, one per turn. Their names are
``dialogues_text.txt``, ``dialogues_act.txt``, ``dialogues_emotion.txt`` (the corpus's top level) or
``dialogues_SPLIT.txt``, ``dialogues_act_SPLIT.txt``, ``dialogues_emotion_SPLIT.txt`` (its split folders).
Every turn after a dialogue's first becomes one row::

    {"prompt": previous turn, "response": this turn, "label": {"act": ..., "emotion": ...},
     "source": "dailydialog/SPLIT:DIALOGUE:TURN"}

with ``DIALOGUE`` the 0-based line and ``TURN`` the 0-based turn, the text detokenised (:func:`detokenize`).

**Split by dialogue**: turns of one dialogue share context, so a held-out set must hold out whole dialogues.
``data split`` keeps the rows whose dialogue number (the second-to-last ``:`` field of ``source``, as above)
lies in the given ranges, and writes the others to ``--rest``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .safe_io import atomic_write

ACTS = ("inform", "question", "directive", "commissive")  # DailyDialog's 1..4
EMOTIONS = ("none", "anger", "disgust", "fear", "happiness", "sadness", "surprise")  # 0..6
END_OF_UTTERANCE = "__eou__"


def detokenize(text: str) -> str:
    """DailyDialog's space-separated tokens as plain text: no space before ``. , ? ! ; : % )`` nor after
    ``( $``; none around the typographic apostrophe ``’``; an ASCII apostrophe between two words joined
    (``it ' s`` -> ``it's``); other spacing (quotes, dashes) kept, runs of spaces made one."""
    text = " ".join(text.split())
    text = re.sub(r"\s*’\s*", "’", text)
    text = re.sub(r"(?<=\w) ' (?=\w)", "'", text)
    text = re.sub(r" (?=[.,?!;:%)\]])", "", text)
    return re.sub(r"(?<=[(\[$]) ", "", text)


def _split_files(directory: Path, split: str) -> tuple[Path, Path, Path]:
    for names in (
        ("dialogues_text.txt", "dialogues_act.txt", "dialogues_emotion.txt"),
        (f"dialogues_{split}.txt", f"dialogues_act_{split}.txt", f"dialogues_emotion_{split}.txt"),
    ):
        paths = tuple(directory / n for n in names)
        if paths[0].is_file():
            missing = [str(p) for p in paths[1:] if not p.is_file()]
            if missing:
                raise FileNotFoundError(f"{directory}: {paths[0].name} is there but not {', '.join(missing)}")
            return paths  # type: ignore[return-value]
    raise FileNotFoundError(
        f"{directory}: expected DailyDialog's dialogues_text.txt, dialogues_act.txt and dialogues_emotion.txt "
        f"(or dialogues_{split}.txt, dialogues_act_{split}.txt and dialogues_emotion_{split}.txt)"
    )


def _read_lines(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def _labels(path: Path, number: int, line: str, turns: int, names: tuple[str, ...], low: int, kind: str) -> list[str]:
    values = line.split()
    if len(values) != turns:
        raise ValueError(f"{path} line {number}: {len(values)} {kind}s for the {turns} turns of that dialogue")
    out = []
    for value in values:
        if not re.fullmatch(r"\d+", value) or not low <= int(value) < low + len(names):
            raise ValueError(f"{path} line {number}: {kind} {value!r} is not an integer {low}-{low + len(names) - 1}")
        out.append(names[int(value) - low])
    return out


def read_dailydialog(directory: str | Path, split: str | None = None) -> list[dict]:
    """The rows of one DailyDialog split directory (see the module docstring); ``split`` names it in
    ``source`` (default: the directory's name). A ``ValueError`` names the file and line of what is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory (expected a DailyDialog split folder)")
    split = split or directory.resolve().name
    text_path, act_path, emotion_path = _split_files(directory, split)
    texts, acts, emotions = (_read_lines(p) for p in (text_path, act_path, emotion_path))
    for path, lines in ((act_path, acts), (emotion_path, emotions)):
        if len(lines) != len(texts):
            raise ValueError(f"{path}: {len(lines)} lines (dialogues) but {text_path} has {len(texts)}")
    rows: list[dict] = []
    for d, (text, act_line, emotion_line) in enumerate(zip(texts, acts, emotions, strict=True)):
        number = d + 1
        parts = text.split(END_OF_UTTERANCE)
        if parts[-1].strip():
            raise ValueError(f"{text_path} line {number}: the last turn does not end with {END_OF_UTTERANCE}")
        turns = [detokenize(t) for t in parts[:-1]]
        if not turns:
            raise ValueError(f"{text_path} line {number}: no turns (expected turns each ending with __eou__)")
        if not all(turns):
            raise ValueError(f"{text_path} line {number}: turn {turns.index('')} is empty")
        turn_acts = _labels(act_path, number, act_line, len(turns), ACTS, 1, "act")
        turn_emotions = _labels(emotion_path, number, emotion_line, len(turns), EMOTIONS, 0, "emotion")
        for t in range(1, len(turns)):
            rows.append(
                {
                    "prompt": turns[t - 1],
                    "response": turns[t],
                    "label": {"act": turn_acts[t], "emotion": turn_emotions[t]},
                    "source": f"dailydialog/{split}:{d}:{t}",
                }
            )
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    from .synthetic import check_output_path

    path = check_output_path(path)
    return atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


# --------------------------------------------------------------------------------------------------
# split by dialogue


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """``"0-699,800,900-999"`` -> ``[(0, 699), (800, 800), (900, 999)]`` (inclusive)."""
    ranges = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"--dialogues {text!r}: expected ranges like 0-699 or 0-99,200 (low <= high)")
        low = int(match.group(1))
        ranges.append((low, int(match.group(2)) if match.group(2) else low))
    return ranges


def dialogue_number(source: object, where: str) -> int:
    """The dialogue of a ``source`` like ``dailydialog/validation:12:3`` (its second-to-last ``:`` field)."""
    fields = source.split(":") if isinstance(source, str) else []
    if len(fields) < 3 or not fields[-2].isdigit():
        raise ValueError(f"{where}: source {source!r} is not NAME:DIALOGUE:TURN (the dialogue a number)")
    return int(fields[-2])


def split_by_dialogue(path: str | Path, ranges: list[tuple[int, int]]) -> tuple[list[str], list[str]]:
    """The lines of a JSONL file whose dialogue lies in ``ranges``, and the others (each line kept as is)."""
    path = Path(path)
    chosen: list[str] = []
    rest: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {number}: expected a JSON object")
        dialogue = dialogue_number(row.get("source"), f"{path} line {number}")
        (chosen if any(lo <= dialogue <= hi for lo, hi in ranges) else rest).append(line + "\n")
    return chosen, rest


# --------------------------------------------------------------------------------------------------
# command line


def run_dailydialog(args: argparse.Namespace) -> int:
    rows = read_dailydialog(args.directory, args.split)
    write_jsonl(rows, args.output)
    acts: dict[str, int] = {}
    for row in rows:
        acts[row["label"]["act"]] = acts.get(row["label"]["act"], 0) + 1
    dialogues = len({r["source"].rsplit(":", 1)[0] for r in rows})
    print(f"wrote {len(rows)} pairs of {dialogues} dialogues to {args.output} (acts: {json.dumps(acts)})")
    return 0


def run_split(args: argparse.Namespace) -> int:
    from .synthetic import check_output_path

    ranges = parse_ranges(args.dialogues)
    outputs = [check_output_path(args.output)] + ([check_output_path(args.rest)] if args.rest else [])
    if len({p.resolve() for p in outputs} | {Path(args.file).resolve()}) != len(outputs) + 1:
        raise ValueError("data split: --output, --rest and the input must be three different files")
    chosen, rest = split_by_dialogue(args.file, ranges)
    atomic_write(outputs[0], "".join(chosen))
    message = f"wrote {len(chosen)} rows to {args.output}"
    if args.rest:
        atomic_write(outputs[1], "".join(rest))
        message += f" and the other {len(rest)} to {args.rest}"
    print(message)
    return 0


def add_corpus_subcommands(data_sub) -> None:
    """Register ``data dailydialog`` and ``data split`` on the ``data`` command's subparsers."""
    daily = data_sub.add_parser(
        "dailydialog",
        help="convert a DailyDialog split folder to prompt/response JSONL",
        description=__doc__.split("\n\n")[2].replace("**", ""),
    )
    daily.add_argument("directory", metavar="DIR", help="the split's folder (its text, act and emotion files)")
    daily.add_argument("--output", required=True, help="the .jsonl file to write (replaced if it exists)")
    daily.add_argument("--split", help="the split's name in each row's source (default: DIR's name)")
    daily.set_defaults(func=run_dailydialog)
    split = data_sub.add_parser(
        "split",
        help="split a JSONL file by dialogue (source NAME:DIALOGUE:TURN)",
        description=__doc__.split("\n\n")[4].replace("**", ""),
    )
    split.add_argument("file", metavar="FILE", help="the .jsonl file to split")
    split.add_argument("--dialogues", required=True, help="the dialogues to keep, e.g. 0-699 or 0-99,200-299")
    split.add_argument("--output", required=True, help="where the chosen dialogues' rows go")
    split.add_argument("--rest", help="where the other rows go (optional)")
    split.set_defaults(func=run_split)
