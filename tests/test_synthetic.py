"""The built-in hidden-factor data sets (``synthetic.py``) and ``disentangle data synth``."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
from collections import Counter, defaultdict

import pytest

from disentanglement import cli, synthetic
from disentanglement.synthetic import (
    CLEAN_RESPONSES,
    ECHO_TEMPLATES,
    STYLE_MARKERS,
    SYNTHETIC_SETS,
    TOPICS,
    TWO_FACTOR_PHRASINGS,
    TWO_FACTOR_WORDS,
    balanced_design,
    detect_factor,
    make_clean,
    make_style_in_content,
    make_style_in_echo,
    make_two_factor,
    two_factor_response,
    write_synthetic,
)

GENERATED = ("clean", "two-factor", "style-in-content", "style-in-echo")  # the sets that do not read the corpus
SEEDS = (0, 1, 2, 3, 4)


def values(rows, factor):
    return [row["label"][factor] for row in rows]


def prompt_majority_accuracy(rows, factor) -> float:
    """Accuracy of the best predictor of ``factor`` that sees only the prompt (its majority value, in sample)."""
    by_prompt: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        by_prompt[row["prompt"]][row["label"][factor]] += 1
    return sum(counts.most_common(1)[0][1] for counts in by_prompt.values()) / len(rows)


@pytest.fixture(scope="module")
def chatterbot_rows():
    return SYNTHETIC_SETS["chatterbot-style"]()


# ------------------------------------------------------------------ rows, registry, determinism


@pytest.mark.parametrize("name", GENERATED)
def test_rows_have_the_documented_shape(name):
    spec = SYNTHETIC_SETS[name]
    rows = spec()
    assert len(rows) == spec.default_rows == 800
    for i, row in enumerate(rows):
        assert set(row) == {"prompt", "response", "label", "source"}
        assert row["source"] == f"synth/{name}:#{i}"
        assert tuple(row["label"]) == spec.factors
        assert all(isinstance(v, str) and v for v in row["label"].values())
        assert row["prompt"].strip() and row["response"].strip()
        json.dumps(row)  # plain JSON
    assert len(spec(rows=37, seed=5)) == 37
    assert len(spec(rows=1)) == 1


@pytest.mark.parametrize("name", GENERATED)
def test_deterministic_given_the_seed(name):
    make = SYNTHETIC_SETS[name].make
    assert make(800, 3) == make(800, 3)
    assert make(800, 3) != make(800, 4)
    assert SYNTHETIC_SETS[name](seed=3) == make(800, 3)


def test_same_seed_writes_byte_identical_files(tmp_path):
    for name in GENERATED:
        a, b = tmp_path / f"{name}-a.jsonl", tmp_path / f"{name}-b.jsonl"
        assert write_synthetic(name, a, 200, 7) == 200 == write_synthetic(name, b, 200, 7)
        assert a.read_bytes() == b.read_bytes()


def test_registry_describes_each_set():
    assert set(SYNTHETIC_SETS) == {"clean", "two-factor", "style-in-content", "style-in-echo", "chatterbot-style"}
    for name, spec in SYNTHETIC_SETS.items():
        assert spec.name == name and callable(spec)
        assert spec.description and "\n" not in spec.description
        assert spec.factors


def test_bad_row_counts_are_refused():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="rows must be a positive integer"):
            make_clean(bad, 0)
    with pytest.raises(ValueError, match="asks for more"):
        synthetic.make_chatterbot_style(10**6, 0)
    with pytest.raises(ValueError, match="unknown synthetic set 'nope'"):
        write_synthetic("nope", "x.jsonl")


def test_balanced_design_balances_every_combination():
    for rows in (1, 7, 48, 100, 800):
        choices = [range(3), "ab", ("w", "x", "y", "z")]
        design = balanced_design(random.Random(rows), choices, rows)
        assert len(design) == rows
        counts = Counter(design)
        full = rows // 24
        assert all(full <= counts[c] <= full + 1 for c in itertools.product(range(3), "ab", "wxyz"))
        for j, choice in enumerate(choices):  # each value of each choice gets its fair share within 2
            single = Counter(item[j] for item in design)
            assert all(abs(single[v] - rows / len(choice)) <= 2 for v in choice), (rows, single)


# ------------------------------------------------------------------ balance and independence


@pytest.mark.parametrize("seed", (0, 1))
def test_the_default_800_rows_are_an_exactly_balanced_design(seed):
    clean = Counter((r["prompt"], r["label"]["style"]) for r in make_clean(800, seed))
    assert len(clean) == 10 * 4 and set(clean.values()) == {20}
    two = Counter((r["prompt"], r["label"]["A"], r["label"]["B"]) for r in make_two_factor(800, seed))
    assert len(two) == 10 * 4 * 4 and set(two.values()) == {5}
    sic = Counter((r["prompt"], r["response"]) for r in make_style_in_content(800, seed))
    assert len(sic) == 800  # every (question, answer, style) once
    echo = Counter((r["prompt"], r["response"]) for r in make_style_in_echo(800, seed))
    assert len(echo) == 800 and set(echo.values()) == {1}  # every (template, sentence, style) once


@pytest.mark.parametrize("rows", (800, 1000, 333))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", GENERATED)
def test_factor_values_are_balanced(name, seed, rows):
    rows = SYNTHETIC_SETS[name](rows, seed=seed)
    for factor in SYNTHETIC_SETS[name].factors:
        counts = Counter(values(rows, factor))
        expected = len(rows) / len(counts)
        assert len(counts) == (8 if factor == "topic" else 4)
        assert all(abs(c - expected) <= 6 for c in counts.values()), (factor, counts)  # 1.5% of 400


@pytest.mark.parametrize("seed", SEEDS)
def test_two_factor_factors_are_independent(seed):
    rows = make_two_factor(800, seed)
    joint = Counter(zip(values(rows, "A"), values(rows, "B"), strict=True))
    assert len(joint) == 16
    assert all(abs(c - 50) <= 5 for c in joint.values()), joint  # 800 / 16 = 50 per combination
    # knowing A does not help to guess B (nor B to guess A): the majority of each conditional is near chance
    for given, target in (("A", "B"), ("B", "A")):
        by_value: dict[str, Counter] = defaultdict(Counter)
        for row in rows:
            by_value[row["label"][given]][row["label"][target]] += 1
        accuracy = sum(c.most_common(1)[0][1] for c in by_value.values()) / len(rows)
        assert accuracy <= 0.28


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ("clean", "two-factor"))
def test_the_prompt_cannot_predict_a_hidden_factor(name, seed):
    rows = SYNTHETIC_SETS[name](seed=seed)
    prompts = Counter(row["prompt"] for row in rows)
    assert len(prompts) >= 10
    for factor in SYNTHETIC_SETS[name].factors:
        by_prompt: dict[str, Counter] = defaultdict(Counter)
        for row in rows:
            by_prompt[row["prompt"]][row["label"][factor]] += 1
        for prompt, counts in by_prompt.items():
            assert len(counts) == 4, (prompt, counts)  # every prompt is seen with every value
            assert counts.most_common(1)[0][1] / prompts[prompt] <= 0.3, (prompt, counts)  # chance is 0.25
        assert prompt_majority_accuracy(rows, factor) <= 0.27


@pytest.mark.parametrize("seed", SEEDS)
def test_style_in_content_style_is_hidden_and_topic_follows_the_prompt(seed):
    rows = make_style_in_content(800, seed)
    by_prompt: dict[str, set] = defaultdict(set)
    topic_of_prompt: dict[str, set] = defaultdict(set)
    for row in rows:
        by_prompt[row["prompt"]].add(row["label"]["style"])
        topic_of_prompt[row["prompt"]].add(row["label"]["topic"])
    assert len(by_prompt) == 40
    assert all(len(styles) >= 3 for styles in by_prompt.values())  # a prompt appears with several styles
    assert prompt_majority_accuracy(rows, "style") <= 0.4  # chance 0.25 with about 25 rows per prompt
    assert all(len(topics) == 1 for topics in topic_of_prompt.values())  # the prompt gives the topic
    assert prompt_majority_accuracy(rows, "topic") == 1.0
    # the style is independent of the topic too
    joint = Counter(zip(values(rows, "topic"), values(rows, "style"), strict=True))
    assert len(joint) == 32 and set(joint.values()) == {25}, joint  # exact at 800 rows
    # the content is a topic answer (the marker removed), chosen independently of the question template
    for row in rows:
        assert synthetic._strip_style_marker(row["response"]) in TOPICS[row["label"]["topic"]][1]
    answers_per_prompt = defaultdict(set)
    for row in rows:
        answers_per_prompt[row["prompt"]].add(synthetic._strip_style_marker(row["response"]))
    assert all(len(a) >= 3 for a in answers_per_prompt.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_style_in_echo_content_is_the_prompts_sentence_and_style_is_hidden(seed):
    rows = make_style_in_echo(800, seed)
    sentences = {answer: topic for topic, (_, answers) in TOPICS.items() for answer in answers}
    templates = [t.split("{sentence}")[0] for t in ECHO_TEMPLATES]
    by_prompt: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        content = synthetic._strip_style_marker(row["response"])
        # the response's content is, word for word, the sentence the prompt asks for back
        prefix = next(t for t in templates if row["prompt"].startswith(t))
        assert row["prompt"] == prefix + content
        assert sentences[content] == row["label"]["topic"]
        assert synthetic.apply_style_marker(content, row["label"]["style"]) == row["response"]
        by_prompt[row["prompt"]][row["label"]["style"]] += 1
    assert len(by_prompt) == 5 * 40  # every template with every sentence
    assert all(sum(c.values()) == 4 and len(c) == 4 for c in by_prompt.values())  # each prompt with every style once
    assert prompt_majority_accuracy(rows, "topic") == 1.0
    joint = Counter(zip(values(rows, "topic"), values(rows, "style"), strict=True))
    assert len(joint) == 32 and set(joint.values()) == {25}, joint  # the style is independent of the topic


def test_chatterbot_style_is_balanced_within_every_category(chatterbot_rows):
    rows = chatterbot_rows
    assert len(rows) == 2296  # every English pair but the 10 whose response occurs in two categories
    counts = Counter(values(rows, "style"))
    assert set(counts) == set(STYLE_MARKERS)
    assert max(counts.values()) - min(counts.values()) <= len({r["label"]["category"] for r in rows})
    per_category: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        per_category[row["label"]["category"]][row["label"]["style"]] += 1
    for category, c in per_category.items():
        assert max(c.values()) - min(c[s] for s in STYLE_MARKERS) <= 1, (category, c)
    subset = synthetic.make_chatterbot_style(300, 1)
    assert len(subset) == 300 and subset == synthetic.make_chatterbot_style(300, 1)
    assert subset != synthetic.make_chatterbot_style(300, 2)


# ------------------------------------------------------------------ what carries each factor


def test_two_factor_a_changes_exactly_one_word():
    for b in TWO_FACTOR_PHRASINGS:
        for a1, a2 in itertools.combinations(TWO_FACTOR_WORDS, 2):
            w1, w2 = two_factor_response(a1, b).split(), two_factor_response(a2, b).split()
            assert len(w1) == len(w2)
            differing = [i for i, (x, y) in enumerate(zip(w1, w2, strict=True)) if x != y]
            assert len(differing) == 1
            assert (w1[differing[0]], w2[differing[0]]) == (a1, a2)


def test_two_factor_b_changes_only_the_phrasing():
    for a in TWO_FACTOR_WORDS:
        middles = set()
        for b, (opener, closer) in TWO_FACTOR_PHRASINGS.items():
            response = two_factor_response(a, b)
            assert response.startswith(opener + " ") and response.endswith(" " + closer)
            middles.add(response[len(opener) + 1 : -len(closer) - 1])
            assert not set(synthetic._words(opener + " " + closer)) & set(TWO_FACTOR_WORDS)
        assert middles == {synthetic.TWO_FACTOR_SENTENCE.format(word=a)}  # the same sentence for every B
    # and the data holds only these responses
    for row in make_two_factor(800, 0):
        assert row["response"] == two_factor_response(row["label"]["A"], row["label"]["B"])


def test_clean_responses_are_fixed_and_distinct():
    assert len(set(CLEAN_RESPONSES.values())) == 4
    assert len({synthetic._words(r)[0] for r in CLEAN_RESPONSES.values()}) == 4
    for row in make_clean(800, 0):
        assert row["response"] == CLEAN_RESPONSES[row["label"]["style"]]


# ------------------------------------------------------------------ detect_factor


@pytest.mark.parametrize("seed", (0, 1))
@pytest.mark.parametrize("name", GENERATED)
def test_detect_factor_recovers_every_factor_of_every_row(name, seed):
    for row in SYNTHETIC_SETS[name](seed=seed):
        for factor, value in row["label"].items():
            assert detect_factor(name, factor, row["response"]) == value, (row, factor)


def test_detect_factor_recovers_every_chatterbot_row(chatterbot_rows):
    for row in chatterbot_rows:
        for factor, value in row["label"].items():
            assert detect_factor("chatterbot-style", factor, row["response"]) == value, (row, factor)


def test_detect_factor_tolerates_generation_noise_and_says_none_when_unsure():
    # case, punctuation and spacing do not matter; a generation cut short still shows its factors
    assert detect_factor("clean", "style", "  hmm give me a QUIET moment to mull this over properly") == "pensive"
    assert detect_factor("clean", "style", "Something else entirely.") is None
    text = "okay no problem you will find it in the Lobster drawer"
    assert detect_factor("two-factor", "A", text) == "lobster"
    assert detect_factor("two-factor", "B", text) == "okay"
    assert detect_factor("two-factor", "B", "It is in the cactus drawer. Have a nice day!") == "question"
    assert detect_factor("two-factor", "B", "Sure thing! It is there. Have a nice day!") is None  # two B values
    assert detect_factor("two-factor", "A", "the saffron or the cactus drawer") is None
    assert detect_factor("two-factor", "A", "the top drawer") is None
    assert detect_factor("style-in-content", "style", "ahoy there, the rain stops soon") == "ahoy"
    assert detect_factor("style-in-content", "style", "Listen up. Rain soon. Over and out.") is None
    assert (
        detect_factor("style-in-content", "topic", "Ahoy there! My guitar needs new strings for the song.") == "music"
    )
    assert detect_factor("style-in-content", "topic", "Nothing to see here.") is None
    assert detect_factor("chatterbot-style", "category", "Not a corpus response at all.") is None
    with pytest.raises(ValueError, match="has factors style, topic, not 'A'"):
        detect_factor("style-in-content", "A", "x")
    with pytest.raises(ValueError, match="unknown synthetic set"):
        detect_factor("marked", "style", "x")


def test_topic_keywords_name_only_their_own_topic():
    for topic, keywords in synthetic.TOPIC_KEYWORDS.items():
        assert not any(keywords & other for t, other in synthetic.TOPIC_KEYWORDS.items() if t != topic)
        for answer in TOPICS[topic][1]:  # the keyword vote alone also finds every answer's topic
            hits = {t: len(set(synthetic._words(answer)) & k) for t, k in synthetic.TOPIC_KEYWORDS.items()}
            assert max(hits, key=hits.get) == topic and sorted(hits.values())[-2] < hits[topic], (answer, hits)


# ------------------------------------------------------------------ writing and the command line


def parser() -> argparse.ArgumentParser:
    return cli.build_parser()


def run_cli(argv):
    args = parser().parse_args(argv)
    return args.func(args)


def test_cli_writes_the_file(tmp_path, capsys):
    out = tmp_path / "two.jsonl"
    assert run_cli(["data", "synth", "two-factor", "--output", str(out), "--rows", "50", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 50 rows to {out} (factors: A, B)"
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows == make_two_factor(50, 3)
    assert run_cli(["data", "synth", "clean", "--output", str(out)]) == 0  # replaces; defaults 800 rows, seed 0
    assert "wrote 800 rows" in capsys.readouterr().out
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == make_clean(800, 0)
    assert not [p for p in tmp_path.iterdir() if p.name != "two.jsonl"]  # no temporary file left


def test_cli_writes_chatterbot_style(tmp_path, capsys):
    out = tmp_path / "cb.jsonl"
    assert run_cli(["data", "synth", "chatterbot-style", "--output", str(out), "--rows", "20"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 20 rows to {out} (factors: style, category)"
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == (
        synthetic.make_chatterbot_style(20, 0)
    )


def test_cli_lists_the_sets(capsys):
    assert run_cli(["data", "synth", "--list"]) == 0
    out = capsys.readouterr().out
    for name, spec in SYNTHETIC_SETS.items():
        assert name in out and spec.description in out


@pytest.mark.parametrize(
    "argv",
    [
        ["data"],
        ["data", "synth"],
        ["data", "synth", "clean"],
        ["data", "synth", "--output", "x.jsonl"],
        ["data", "synth", "marked", "--output", "x.jsonl"],
        ["data", "synth", "clean", "--output", "x.jsonl", "--rows", "0"],
        ["data", "synth", "clean", "--output", "x.jsonl", "--seed", "one"],
    ],
)
def test_cli_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bad_output_paths_are_named(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = {
        str(tmp_path): "is a directory",
        str(tmp_path / "rows.json"): "must end in .jsonl",
        str(tmp_path / "missing" / "rows.jsonl"): "does not exist",
        str(a_file / "rows.jsonl"): "is not a directory",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message) as exc:
            write_synthetic("clean", path, 10)
        assert path in str(exc.value)
        with pytest.raises(ValueError, match=message):
            run_cli(["data", "synth", "clean", "--output", path])


def test_failed_write_names_the_path_and_keeps_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "rows.jsonl"
    out.write_text("old\n")

    def fail(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(synthetic.os, "replace", fail)
    with pytest.raises(ValueError, match=f"cannot write output path {out}: Permission denied"):
        write_synthetic("clean", out, 10)
    assert out.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]  # the temporary file is removed


def test_written_file_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_synthetic("clean", tmp_path / "rows.jsonl", 5)
    finally:
        os.umask(old)
    assert (tmp_path / "rows.jsonl").stat().st_mode & 0o777 == 0o644


def test_the_disentangle_command_writes_a_set_that_train_can_read(tmp_path, capsys):
    from disentanglement import cli
    from disentanglement.config import DataConfig
    from disentanglement.data import load_pairs

    out = tmp_path / "two.jsonl"
    assert cli.main(["data", "synth", "two-factor", "--output", str(out), "--rows", "40", "--seed", "1"]) == 0
    assert "wrote 40 rows" in capsys.readouterr().out
    pairs = load_pairs(DataConfig(data=str(out)))
    assert len(pairs) == 40 and set(pairs[0].label) == {"A", "B"}
    assert cli.main(["data", "synth", "two-factor", "--output", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


# ------------------------------------------------------------------ held-out files (--heldout)

ALL_SETS = (*GENERATED, "chatterbot-style")
HELDOUT_CASES = [(name, 800, 200, seed) for name in ALL_SETS for seed in (0, 1)] + [
    ("clean", 40, 13, 2),
    ("two-factor", 333, None, 3),
    ("style-in-echo", 250, 60, 4),
    ("style-in-content", 1000, 100, 5),
    ("chatterbot-style", None, None, 0),
    ("chatterbot-style", None, 300, 1),
]


@pytest.fixture(scope="module")
def splits():
    cache: dict = {}

    def get(name, rows=800, heldout_rows=200, seed=0):
        key = (name, rows, heldout_rows, seed)
        if key not in cache:
            cache[key] = synthetic.make_split(*key)
        return cache[key]

    return get


def pairs_of(rows):
    return {(row["prompt"], row["response"]) for row in rows}


#: The sha256 (first 16 hex digits) of each (set, rows, seed)'s JSONL file as written before --heldout existed.
UNCHANGED = {
    ("clean", 800, 0): "8d1e3dff9d26800a",
    ("clean", 37, 5): "ce2fe752fde2a94d",
    ("two-factor", 800, 0): "e95d61e4e37b9675",
    ("two-factor", 333, 1): "458ae95e0c554b13",
    ("style-in-content", 800, 2): "93aecdb1a2e29053",
    ("style-in-content", 1000, 0): "7fe87721dc6036cf",
    ("style-in-echo", 800, 0): "5d0ff4f9de69b1a9",
    ("style-in-echo", 250, 3): "1d709c5161869b61",
    ("chatterbot-style", None, 0): "3f44cbbe1a901e4c",
    ("chatterbot-style", 300, 1): "e71bd75a5493f43e",
}


@pytest.mark.parametrize(("name", "rows", "seed"), list(UNCHANGED))
def test_without_heldout_the_rows_are_unchanged(name, rows, seed, tmp_path):
    import hashlib

    out = tmp_path / "rows.jsonl"
    write_synthetic(name, out, rows, seed)
    assert hashlib.sha256(out.read_bytes()).hexdigest()[:16] == UNCHANGED[name, rows, seed]
    make = SYNTHETIC_SETS[name].make
    assert make(rows, seed, part=None, heldout_share=0.5) == make(rows, seed)  # the share matters only to parts


@pytest.mark.parametrize(("name", "rows", "heldout_rows", "seed"), HELDOUT_CASES)
def test_heldout_prompts_never_occur_in_training(name, rows, heldout_rows, seed, splits):
    train, heldout = splits(name, rows, heldout_rows, seed)
    if rows is None and heldout_rows is None:  # chatterbot-style by default: every pair, about a fifth held out
        assert len(train) + len(heldout) == len(synthetic._chatterbot_pairs())
        assert 0.15 <= len(heldout) / len(train + heldout) <= 0.3
    elif rows is not None:
        assert len(train) == rows
    if heldout_rows is not None or rows is not None:
        assert len(heldout) == (heldout_rows if heldout_rows is not None else max(1, rows // 4))
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in heldout}
    assert not {row["prompt"].strip() for row in train} & {row["prompt"].strip() for row in heldout}
    assert not pairs_of(train) & pairs_of(heldout)
    assert [row["source"] for row in train] == [f"synth/{name}:#{i}" for i in range(len(train))]
    assert [row["source"] for row in heldout] == [f"synth/{name}:heldout#{i}" for i in range(len(heldout))]
    for factor in SYNTHETIC_SETS[name].factors:  # every value of every factor in both parts
        assert set(values(train, factor)) == set(values(heldout, factor)), factor


@pytest.mark.parametrize(("name", "rows", "heldout_rows", "seed"), HELDOUT_CASES)
def test_each_part_is_balanced(name, rows, heldout_rows, seed, splits):
    train, heldout = splits(name, rows, heldout_rows, seed)
    for part in (train, heldout):
        if name == "chatterbot-style":  # the style within each category, as without --heldout
            per_category: dict[str, Counter] = defaultdict(Counter)
            for row in part:
                per_category[row["label"]["category"]][row["label"]["style"]] += 1
            for category, c in per_category.items():
                assert max(c.values()) - min(c[s] for s in STYLE_MARKERS) <= 1, (category, c)
            continue
        for factor in SYNTHETIC_SETS[name].factors:
            counts = Counter(values(part, factor))
            assert len(counts) == (8 if factor == "topic" else 4)
            # the tolerance of the whole set's design: at most 5 apart at these sizes (see balanced_design)
            assert max(counts.values()) - min(counts.values()) <= 5, (factor, counts)
    if name == "two-factor":  # A and B stay crossed in each part
        for part in (train, heldout):
            joint = Counter(zip(values(part, "A"), values(part, "B"), strict=True))
            assert len(joint) == 16 and max(joint.values()) - min(joint.values()) <= 2, joint


def test_what_each_set_holds_out_at_800_and_200_rows(splits):
    counts = {}
    for name in ALL_SETS:
        train, heldout = splits(name)
        counts[name] = (len(pairs_of(train)), len(pairs_of(heldout)))
    assert counts["clean"] == (8 * 4, 2 * 4)  # 2 of 10 prompts held out
    assert counts["two-factor"] == (8 * 16, 2 * 16)
    assert counts["style-in-content"] == (8 * 4 * 5 * 4, 8 * 1 * 5 * 4)  # 1 of 5 questions per topic held out
    assert counts["style-in-echo"] == (8 * 4 * 5 * 4, 8 * 1 * 5 * 4)  # 1 of 5 sentences per topic held out
    # style-in-content: the answers are the topic's 5 in both parts, the questions differ
    train, heldout = splits("style-in-content")
    content = {synthetic._strip_style_marker(row["response"]) for row in heldout}
    assert content == {synthetic._strip_style_marker(row["response"]) for row in train}
    # style-in-echo: the held-out sentences occur nowhere in training, prompt or response
    train, heldout = splits("style-in-echo")
    unseen = {synthetic._strip_style_marker(row["response"]) for row in heldout}
    assert len(unseen) == 8 and not any(s in row["prompt"] or s in row["response"] for row in train for s in unseen)


@pytest.mark.parametrize("name", ALL_SETS)
def test_the_split_is_deterministic_and_follows_the_seed(name):
    rows = 400 if name == "chatterbot-style" else 200
    assert synthetic.make_split(name, rows, 50, 7) == synthetic.make_split(name, rows, 50, 7)
    axes = {frozenset(row["prompt"] for row in synthetic.make_split(name, rows, 50, seed)[1]) for seed in range(6)}
    assert len(axes) >= 3  # another seed holds out other prompts


@pytest.mark.parametrize(("name", "rows", "heldout_rows", "seed"), HELDOUT_CASES)
def test_detect_factor_reads_every_heldout_row(name, rows, heldout_rows, seed, splits):
    for row in splits(name, rows, heldout_rows, seed)[1]:
        for factor, value in row["label"].items():
            assert detect_factor(name, factor, row["response"]) == value, (row, factor)


def test_heldout_rows_are_read_by_the_controllability_detector(splits):
    from disentanglement.controllability import synthetic_detector

    heldout = splits("two-factor")[1]
    found = synthetic_detector([row["source"] for row in heldout])
    assert found is not None and found[0] == "two-factor"


def test_bad_splits_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="part must be one of"):
        make_clean(10, 0, part="validation")
    for share in (0, 1, 1.5, True):
        with pytest.raises(ValueError, match="heldout_share must be a number between 0 and 1"):
            make_clean(10, 0, part="train", heldout_share=share)
    with pytest.raises(ValueError, match=r"held-out part has \d+ rows; --heldout-rows 2200 asks for more"):
        synthetic.make_split("chatterbot-style", 100, 2200)
    with pytest.raises(ValueError, match=r"training part has \d+ rows; --rows 2200 asks for more"):
        synthetic.make_split("chatterbot-style", 2200)
    with pytest.raises(ValueError, match="--heldout-rows 2296 asks for all or more"):
        synthetic.make_split("chatterbot-style", None, 2296)
    monkeypatch.setattr(synthetic, "CLEAN_PROMPTS", ("The only prompt.",))
    with pytest.raises(ValueError, match="--heldout needs two or more clean prompts to hold some out, and there is 1"):
        synthetic.make_split("clean", 10)
    assert len(make_clean(10, 0)) == 10  # without --heldout a single prompt is fine


def test_cli_writes_the_training_and_heldout_files(tmp_path, capsys):
    out, held = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    argv = ["data", "synth", "style-in-echo", "--output", str(out), "--heldout", str(held), "--seed", "2"]
    assert run_cli([*argv, "--rows", "80", "--heldout-rows", "30"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"wrote 80 rows to {out} and 30 held-out rows to {held} (factors: style, topic)"
    )
    read = [[json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()] for f in (out, held)]
    assert tuple(read) == synthetic.make_split("style-in-echo", 80, 30, 2)
    assert run_cli(argv) == 0  # defaults: 800 rows and a quarter as many held out
    assert "wrote 800 rows" in capsys.readouterr().out and len(held.read_text().splitlines()) == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heldout.jsonl", "train.jsonl"]


def test_cli_refuses_bad_heldout_flags(tmp_path, capsys):
    out = tmp_path / "train.jsonl"
    with pytest.raises(SystemExit) as exc:
        run_cli(["data", "synth", "clean", "--output", str(out), "--heldout-rows", "5"])
    assert exc.value.code == 2 and "--heldout-rows needs --heldout" in capsys.readouterr().err
    for same in (str(out), str(tmp_path / "." / "train.jsonl")):
        with pytest.raises(ValueError, match="--heldout .* is the --output file"):
            run_cli(["data", "synth", "clean", "--output", str(out), "--heldout", same])
    with pytest.raises(ValueError, match="must end in .jsonl"):
        run_cli(["data", "synth", "clean", "--output", str(out), "--heldout", str(tmp_path / "held.json")])
    with pytest.raises(SystemExit):
        run_cli(
            [
                "data",
                "synth",
                "clean",
                "--output",
                str(out),
                "--heldout",
                str(tmp_path / "h.jsonl"),
                "--heldout-rows",
                "0",
            ]
        )
    assert not list(tmp_path.iterdir())  # nothing written
    from disentanglement import cli as cli_module

    assert cli_module.main(["data", "synth", "clean", "--output", str(out), "--heldout", str(out)]) == 2
    assert "--heldout" in capsys.readouterr().err
