"""``disentangle data dailydialog`` and ``data split``: DailyDialog's own files read on a small fixture written
here (the corpus is not shipped), their mistakes named by file and line, and the split by dialogue."""

from __future__ import annotations

import json
import re

import pytest

from disentanglement import cli
from disentanglement.corpora import detokenize, parse_ranges, read_dailydialog, split_by_dialogue

TEXT = (
    "Good morning , sir . Is there a bank near here ? __eou__ There is one . 5 blocks away from here ? __eou__ "
    "Well , that ’ s too far.Can you change $ 5 ( please ) ? __eou__\n"
    'Hi ! __eou__ It \' s " Star war " - - the film . __eou__ \n'
)
ACTS = "3 1 2\n1 4\n"
EMOTIONS = "0 0 4\n0 6\n"


def write_split(directory, text=TEXT, acts=ACTS, emotions=EMOTIONS, names=("text", "act", "emotion")):
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in zip(names, (text, acts, emotions), strict=True):
        (directory / f"dialogues_{name}.txt").write_text(content, encoding="utf-8")
    return directory


EXPECTED = [
    {
        "prompt": "Good morning, sir. Is there a bank near here?",
        "response": "There is one. 5 blocks away from here?",
        "label": {"act": "inform", "emotion": "none"},
        "source": "dailydialog/validation:0:1",
    },
    {
        "prompt": "There is one. 5 blocks away from here?",
        "response": "Well, that’s too far.Can you change $5 (please)?",
        "label": {"act": "question", "emotion": "happiness"},
        "source": "dailydialog/validation:0:2",
    },
    {
        "prompt": "Hi!",
        "response": 'It\'s " Star war " - - the film.',
        "label": {"act": "commissive", "emotion": "surprise"},
        "source": "dailydialog/validation:1:1",
    },
]


def test_detokenize_like_the_shared_validation_file():
    # the first rows of ../shared/data/dailydialog/validation.jsonl, from the corpus's tokens
    assert detokenize("Well , that's too far.Can you change some money for me ?") == (
        "Well, that's too far.Can you change some money for me?"
    )
    assert detokenize("It should be issued as Steven , but the card is under the name ' Steven ' .") == (
        "It should be issued as Steven, but the card is under the name'Steven '."
    )
    assert detokenize("I ’ m  sure ; 50 % ( or so ) : yes") == "I’m sure; 50% (or so): yes"


def test_dailydialog_pairs_from_a_split_folder(tmp_path):
    directory = write_split(tmp_path / "validation")
    assert read_dailydialog(directory) == EXPECTED
    # the split folders' own file names, and a split name given
    other = write_split(
        tmp_path / "x", names=("train", "act_train", "emotion_train")
    )  # dialogues_train.txt, dialogues_act_train.txt, ...
    rows = read_dailydialog(other, split="train")
    assert [r["source"] for r in rows] == ["dailydialog/train:0:1", "dailydialog/train:0:2", "dailydialog/train:1:1"]
    assert [r["response"] for r in rows] == [r["response"] for r in EXPECTED]


def test_cli_writes_the_pairs(tmp_path, capsys):
    directory = write_split(tmp_path / "validation")
    out = tmp_path / "dd.jsonl"
    assert cli.main(["data", "dailydialog", str(directory), "--output", str(out)]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == EXPECTED
    assert "wrote 3 pairs of 2 dialogues" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (dict(acts="3 1 2\n1\n"), r"dialogues_act.txt line 2: 1 acts for the 2 turns of that dialogue"),
        (dict(emotions="0 0 4 1\n0 6\n"), r"dialogues_emotion.txt line 1: 4 emotions for the 3 turns"),
        (dict(acts="3 1 2\n"), r"dialogues_act.txt: 1 lines \(dialogues\) but .*dialogues_text.txt has 2"),
        (dict(acts="3 1 2\n1 5\n"), r"dialogues_act.txt line 2: act '5' is not an integer 1-4"),
        (dict(emotions="0 0 x\n0 6\n"), r"dialogues_emotion.txt line 1: emotion 'x' is not an integer 0-6"),
        (dict(text="Hi ! __eou__ Hello .\n", acts="1 1\n", emotions="0 0\n"), r"line 1: the last turn does not end"),
        (dict(text="Hi ! __eou__  __eou__\n", acts="1 1\n", emotions="0 0\n"), r"line 1: turn 1 is empty"),
    ],
)
def test_mismatched_files_are_named_with_their_line(tmp_path, capsys, files, message):
    directory = write_split(tmp_path / "validation", **files)
    with pytest.raises(ValueError, match=message):
        read_dailydialog(directory)
    assert cli.main(["data", "dailydialog", str(directory), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "disentangle data: error:" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected DailyDialog's dialogues_text.txt"):
        read_dailydialog(tmp_path)
    (tmp_path / "dialogues_text.txt").write_text(TEXT)
    with pytest.raises(FileNotFoundError, match="dialogues_text.txt is there but not .*dialogues_act.txt"):
        read_dailydialog(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        read_dailydialog(tmp_path / "dialogues_text.txt")


def test_split_by_dialogue(tmp_path, capsys):
    rows = [
        {"prompt": "p", "response": f"r{d}.{t}", "source": f"dailydialog/validation:{d}:{t}"}
        for d in range(6)
        for t in (1, 2)
    ]
    data = tmp_path / "all.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert parse_ranges("0-2,4") == [(0, 2), (4, 4)]
    chosen, rest = split_by_dialogue(data, [(0, 2), (4, 4)])
    assert [json.loads(c)["response"] for c in chosen] == [
        "r0.1",
        "r0.2",
        "r1.1",
        "r1.2",
        "r2.1",
        "r2.2",
        "r4.1",
        "r4.2",
    ]
    assert [json.loads(c)["response"] for c in rest] == ["r3.1", "r3.2", "r5.1", "r5.2"]
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    argv = ["data", "split", str(data), "--dialogues", "0-3", "--output", str(train), "--rest", str(held)]
    assert cli.main(argv) == 0
    assert "wrote 8 rows to" in capsys.readouterr().out
    assert train.read_text() + held.read_text() == data.read_text()  # every row once, in order within each
    # no dialogue in both
    dialogues = [
        {json.loads(line)["source"].split(":")[1] for line in f.read_text().splitlines()} for f in (train, held)
    ]
    assert dialogues == [{"0", "1", "2", "3"}, {"4", "5"}]


@pytest.mark.parametrize(
    ("line", "ranges", "message"),
    [
        (
            '{"prompt": "p", "response": "r", "source": "mine:7"}',
            "0-1",
            r"line 2: source 'mine:7' is not NAME:DIALOGUE:TURN",
        ),
        ('{"prompt": "p", "response": "r"}', "0-1", r"line 2: source None is not"),
        ("{not json", "0-1", r"line 2: not JSON"),
        ('{"prompt": "p", "response": "r", "source": "d:1:1"}', "3-1", r"--dialogues '3-1': expected ranges"),
    ],
)
def test_split_errors(tmp_path, capsys, line, ranges, message):
    data = tmp_path / "all.jsonl"
    data.write_text('{"prompt": "p", "response": "r", "source": "d:0:1"}\n' + line + "\n")
    argv = ["data", "split", str(data), "--dialogues", ranges, "--output", str(tmp_path / "o.jsonl")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_split_refuses_to_overwrite_its_input(tmp_path, capsys):
    data = tmp_path / "all.jsonl"
    data.write_text('{"prompt": "p", "response": "r", "source": "d:0:1"}\n')
    assert cli.main(["data", "split", str(data), "--dialogues", "0", "--output", str(data)]) == 2
    assert "three different files" in capsys.readouterr().err
