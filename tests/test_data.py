"""Data loading, synthetic hidden-factor data, tokenisation, split and batching."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter

import pytest
import torch

from disentanglement.config import DataConfig
from disentanglement.data import (
    MEGABATCH_BATCHES,
    Batch,
    DataError,
    DataOrder,
    Example,
    PromptResponse,
    collate,
    label_factor_names,
    label_factors,
    limit_examples,
    load_chatterbot,
    load_jsonl,
    load_pairs,
    read_chatterbot,
    split_train_validation,
    tokenize_pairs,
)
from disentanglement.testing import (
    CLEAN_PHRASES,
    MARKED_STYLES,
    apply_style,
    clean_phrases,
    detect_style,
    make_hidden_factor_pairs,
)
from helpers import EOS, tiny_tokenizer


@pytest.fixture(scope="module")
def chatterbot():
    return read_chatterbot("english")


def write_lines(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def record(**kw):
    return json.dumps(kw)


# -------------------------------------------------------------------------------------------- JSONL


def test_load_jsonl_reads_pairs_labels_and_sources(tmp_path):
    path = write_lines(
        tmp_path,
        [
            record(prompt="Hi", response="Hello", label="greet"),
            "",
            "   ",
            record(prompt="Bye", response="See you", label=3),
            record(prompt="", response="Something", label=None),
            record(prompt="Q", response="A"),
        ],
    )
    pairs = load_jsonl(path)
    assert pairs == [
        PromptResponse("Hi", "Hello", "greet", f"{path}:1"),
        PromptResponse("Bye", "See you", "3", f"{path}:4"),
        PromptResponse("", "Something", None, f"{path}:5"),
        PromptResponse("Q", "A", None, f"{path}:6"),
    ]


def test_load_jsonl_custom_keys(tmp_path):
    path = write_lines(tmp_path, [record(q="a", a="b", tag="t")])
    assert load_jsonl(path, prompt_key="q", response_key="a", label_key="tag") == [
        PromptResponse("a", "b", "t", f"{path}:1")
    ]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (record(response="r"), "missing key 'prompt'"),
        (record(prompt="p"), "missing key 'response'"),
        (record(prompt=1, response="r"), "key 'prompt' must be a string, got int"),
        (record(prompt="p", response=["r"]), "key 'response' must be a string, got list"),
        (record(prompt="p", response="r", label=1.5), "key 'label' must be a string, an integer or null"),
        (record(prompt="p", response="r", label=True), "key 'label' must be a string, an integer or null"),
        (record(prompt="p", response="r", label=["a"]), "key 'label' must be a string, an integer or null"),
        (record(prompt="p", response="r", label={}), "key 'label' is an empty object"),
        (record(prompt="p", response="r", label={"style": 1.5}), "key 'label' factor 'style' must be a string or an"),
        (record(prompt="p", response="r", label={"style": None}), "key 'label' factor 'style' must be a string or"),
        (record(prompt="p", response="r", label={"a": "x", "b": True}), "key 'label' factor 'b' must be a string"),
        (
            record(prompt="p", response="r", label={"a": {"b": "c"}}),
            "factor 'a' must be a string or an integer, got dict",
        ),
        (record(prompt="p", response="r", label={"a": ["x"]}), "factor 'a' must be a string or an integer, got list"),
        (record(prompt="p", response="r", label={" ": "x"}), "key 'label' has a factor with an empty name"),
    ],
)
def test_load_jsonl_invalid_line_names_file_and_line(tmp_path, line, expected):
    path = write_lines(tmp_path, [record(prompt="ok", response="fine"), "", line])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    message = str(info.value)
    assert f"{path}:3" in message
    assert expected in message


def test_load_jsonl_reads_factor_labels(tmp_path):
    path = write_lines(
        tmp_path,
        [
            record(prompt="a", response="b", label={"style": "polite", "topic": "billing"}),
            record(prompt="c", response="d", label={"topic": 7, "style": "rude"}),  # any key order; ints as strings
            record(prompt="e", response="f"),  # an unlabelled line is allowed, as with string labels
        ],
    )
    assert load_jsonl(path) == [
        PromptResponse("a", "b", {"style": "polite", "topic": "billing"}, f"{path}:1"),
        PromptResponse("c", "d", {"topic": "7", "style": "rude"}, f"{path}:2"),
        PromptResponse("e", "f", None, f"{path}:3"),
    ]
    assert label_factor_names(load_jsonl(path)) == ("style", "topic")


def test_label_factors_of_strings_objects_and_none():
    assert label_factors("polite") == {"label": "polite"}
    assert label_factors({"style": "polite", "topic": "billing"}) == {"style": "polite", "topic": "billing"}
    assert label_factors(None) is None
    items = [PromptResponse("p", "r", "x", "s:1"), PromptResponse("p", "r", None, "s:2")]
    assert label_factor_names(items) == ("label",)
    assert label_factor_names([PromptResponse("p", "r", None, "s:1")]) is None
    # a string label is the factor "label", so it agrees with an object naming only "label"
    assert label_factor_names([*items, PromptResponse("p", "r", {"label": "y"}, "s:3")]) == ("label",)


@pytest.mark.parametrize(
    "labels",
    [
        [{"style": "a", "topic": "b"}, {"style": "a"}],
        [{"style": "a"}, {"style": "a", "topic": "b"}],
        [{"style": "a"}, {"tone": "a"}],
        ["a", {"style": "a"}],
        [{"style": "a"}, "a"],
    ],
)
def test_load_jsonl_factor_names_must_agree(tmp_path, labels):
    lines = [record(prompt="p", response="r"), record(prompt="p", response="r", label=labels[0])]
    lines += [record(prompt="p", response="r", label=labels[1]), record(prompt="p", response="r", label=labels[0])]
    path = write_lines(tmp_path, lines)
    message = str(pytest.raises(DataError, load_jsonl, path).value)
    assert message.startswith(f"{path}:3: label factors ")  # the first offending line, named once
    assert f"of the first labelled example ({path}:2)" in message and f"{path}:4" not in message
    assert "same factor names" in message


def test_bad_factor_label_is_reported_with_the_other_invalid_lines(tmp_path):
    path = write_lines(
        tmp_path, [record(prompt="p", response="r", label={}), "{bad", record(prompt="p", response="r", label="ok")]
    )
    message = str(pytest.raises(DataError, load_jsonl, path).value)
    assert message.startswith(f"2 invalid line(s) in {path}")
    assert f"{path}:1: key 'label' is an empty object" in message and f"{path}:2: invalid JSON" in message


def test_factor_labels_reach_examples_and_batches(tokenizer):
    factors = {"style": "polite", "topic": "billing"}
    pairs = [PromptResponse("Hi", "Hello", factors, "s:1"), PromptResponse("Yo", "Hey", None, "s:2")]
    examples, _ = tokenize_pairs(pairs, tokenizer, DataConfig())
    assert [e.label for e in examples] == [factors, None]
    assert collate(examples, tokenizer.pad_token_id).labels == [factors, None]


def test_load_jsonl_reports_every_invalid_line(tmp_path):
    path = write_lines(tmp_path, ["{bad", record(prompt="p", response="r"), record(prompt="p")])
    message = str(pytest.raises(DataError, load_jsonl, path).value)
    assert f"{path}:1" in message and f"{path}:3" in message and f"{path}:2" not in message


def test_load_jsonl_lists_all_empty_responses(tmp_path):
    lines = [record(prompt=f"p{i}", response="r") for i in range(10)]
    for i in (1, 2, 3, 6, 9):  # lines 2-4, 7 and 10
        lines[i] = record(prompt=f"p{i}", response=" \n\t" if i == 6 else "")
    path = write_lines(tmp_path, lines)
    message = str(pytest.raises(DataError, load_jsonl, path).value)
    assert str(path) in message
    assert "5 empty" in message
    assert "2-4, 7, 10" in message


def test_load_jsonl_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no prompt/response pairs"):
        load_jsonl(write_lines(tmp_path, ["", ""]))


def test_load_pairs_dispatch(tmp_path):
    path = write_lines(tmp_path, [record(x="a", y="b", z=7)])
    cfg = DataConfig(data=str(path), prompt_key="x", response_key="y", label_key="z")
    assert load_pairs(cfg) == [PromptResponse("a", "b", "7", f"{path}:1")]
    with pytest.raises(DataError, match="'chatterbot' or a path to a .jsonl file"):
        load_pairs(DataConfig(data="data.csv"))


def test_limit_examples_is_seeded_subset():
    items = list(range(100))
    a = limit_examples(items, 10, seed=3)
    assert a == limit_examples(items, 10, seed=3) and len(a) == 10 and set(a) <= set(items)
    assert a != limit_examples(items, 10, seed=4)
    assert limit_examples(items, None, seed=0) == items


# --------------------------------------------------------------------------------------- chatterbot


def test_chatterbot_counts_and_labels(chatterbot):
    pairs, stats = chatterbot
    assert 2000 <= len(pairs) <= 3000
    labels = Counter(p.label for p in pairs)
    assert len(labels) == 21 == stats["files"]
    assert {"greetings", "AI", "tech support", "profile"} <= set(labels)
    assert stats["categories"] == dict(labels)
    assert stats["pairs"] == len(pairs)
    assert 0 <= stats["skipped_empty_responses"] < 100
    assert stats["skipped_malformed_conversations"] == ["trivia.yml:#13"]
    assert all(isinstance(p.prompt, str) and p.response.strip() for p in pairs)
    assert len({p.source for p in pairs}) == len(pairs)
    first = next(p for p in pairs if p.label == "greetings")
    assert (first.prompt, first.response) == ("Hello", "Hi")
    assert first.source == "chatterbot/english/greetings.yml:#0.0"


def test_chatterbot_chains_consecutive_utterances(chatterbot):
    pairs, _ = chatterbot
    by_conversation: dict[str, list[PromptResponse]] = {}
    for p in pairs:
        by_conversation.setdefault(p.source.rsplit(".", 1)[0], []).append(p)
    chains = [ps for ps in by_conversation.values() if len(ps) >= 2]
    assert chains
    for ps in chains:
        for a, b in zip(ps, ps[1:], strict=False):
            if int(b.source.rsplit(".", 1)[1]) == int(a.source.rsplit(".", 1)[1]) + 1:
                assert b.prompt == a.response


def test_chatterbot_format_edge_cases(tmp_path):
    (tmp_path / "misc.yml").write_text(
        "conversations:\n- - 42\n  - true\n  - ''\n  - after empty\n- just a string\n- - only one\n"
    )
    (tmp_path / "b.yml").write_text("categories:\n- first\n- second\nconversations:\n- - a\n  - b\n")
    pairs, stats = read_chatterbot("x", corpus_dir=tmp_path)
    assert pairs == [
        PromptResponse("a", "b", "first", "chatterbot/x/b.yml:#0.0"),
        PromptResponse("42", "True", "misc", "chatterbot/x/misc.yml:#0.0"),
        PromptResponse("", "after empty", "misc", "chatterbot/x/misc.yml:#0.2"),
    ]
    assert stats["skipped_empty_responses"] == 1
    assert stats["skipped_malformed_conversations"] == ["misc.yml:#1"]


def test_load_chatterbot_logs_skipped(caplog):
    with caplog.at_level(logging.INFO, logger="disentanglement.data"):
        pairs = load_chatterbot()
    assert pairs and "skipped" in caplog.text
    assert load_pairs(DataConfig(data="chatterbot")) == pairs


def test_chatterbot_unknown_language():
    with pytest.raises(DataError, match="no language 'klingon'"):
        load_chatterbot("klingon")


# ---------------------------------------------------------------------------------- hidden factors


def test_hidden_factor_clean(chatterbot):
    prompts = [p.prompt for p in chatterbot[0][:800]]
    pairs = make_hidden_factor_pairs(prompts, num_factors=4, kind="clean", seed=0)
    assert [p.prompt for p in pairs] == prompts
    counts = Counter(p.label for p in pairs)
    assert set(counts) == {"0", "1", "2", "3"}
    assert min(counts.values()) > 800 / 4 * 0.75
    for p in pairs:
        assert p.response == CLEAN_PHRASES[int(p.label)]
        assert detect_style(p.response, "clean") == int(p.label)
    assert pairs == make_hidden_factor_pairs(prompts, kind="clean", seed=0)
    assert [p.label for p in pairs] != [p.label for p in make_hidden_factor_pairs(prompts, kind="clean", seed=1)]


def test_clean_phrases_extend_and_detect():
    phrases = clean_phrases(12)
    assert len(set(phrases)) == 12 and phrases[:4] == list(CLEAN_PHRASES[:4])
    for f, phrase in enumerate(phrases):
        assert detect_style(phrase, "clean", num_factors=12) == f
    assert detect_style("no.", "clean") == 1
    assert detect_style("No. And more words after it", "clean") == 1
    assert detect_style("Nothing to see", "clean") is None
    assert detect_style("ha ha, THAT is a funny question", "clean") == 3
    pairs = make_hidden_factor_pairs(["a"] * 50, num_factors=12, kind="clean", seed=0)
    assert all(detect_style(p.response, "clean", num_factors=12) == int(p.label) for p in pairs)


def test_hidden_factor_marked(chatterbot):
    corpus = chatterbot[0][:600]
    prompts = [p.prompt for p in corpus]
    responses = [p.response for p in corpus]
    pairs = make_hidden_factor_pairs(prompts, num_factors=4, kind="marked", seed=5, responses=responses)
    counts = Counter(p.label for p in pairs)
    assert set(counts) == {"0", "1", "2", "3"} and min(counts.values()) > 600 / 4 * 0.75
    for p, original in zip(pairs, responses, strict=True):
        f = int(p.label)
        assert original in p.response
        assert p.response == apply_style(original, f)
        assert detect_style(p.response, "marked") == f
    assert [kind for kind, _ in MARKED_STYLES] == ["prefix", "suffix", "prefix", "none"]


def test_marked_markers_do_not_occur_in_the_corpus(chatterbot):
    assert all(detect_style(p.response, "marked") == 3 for p in chatterbot[0])


def test_hidden_factor_errors():
    with pytest.raises(ValueError, match="one response per prompt"):
        make_hidden_factor_pairs(["a", "b"], kind="marked")
    with pytest.raises(ValueError, match="1 to 4 factors"):
        make_hidden_factor_pairs(["a"], num_factors=5, kind="marked", responses=["r"])
    with pytest.raises(ValueError, match="kind"):
        make_hidden_factor_pairs(["a"], kind="other")
    assert detect_style("Oh wow, nice (smiles)", "marked") is None


# ------------------------------------------------------------------------------------ tokenisation


def test_tokenize_with_chat_template(tokenizer):
    pairs = [PromptResponse("Hi there", "Hello!", "g", "s:1"), PromptResponse("", "Ok", None, "s:2")]
    cfg = DataConfig(max_prompt_tokens=200, max_response_tokens=200)
    examples, stats = tokenize_pairs(pairs, tokenizer, cfg)
    assert tokenizer.decode(examples[0].prompt_ids) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(examples[0].response_ids) == "Hello!" + EOS + "\n"
    assert tokenizer.eos_token_id in examples[0].response_ids
    assert (examples[0].label, examples[0].source) == ("g", "s:1")
    assert tokenizer.decode(examples[1].response_ids) == "Ok" + EOS + "\n"
    assert stats["examples"] == 2 and stats["chat_template"] is True
    assert stats["truncated_prompts"] == stats["truncated_responses"] == 0
    assert stats["mean_response_tokens"] == (len("Hello!") + 2 + len("Ok") + 2) / 2


def test_tokenize_truncation_keeps_last_prompt_and_first_response_tokens(tokenizer, caplog):
    long_prompt = "abcdefghijklmnopqrstuvwxyz" * 2
    long_response = "0123456789" * 3
    pairs = [PromptResponse(long_prompt, long_response, None, "s:1"), PromptResponse("Hi", "Yo", None, "s:2")]
    cfg = DataConfig(max_prompt_tokens=30, max_response_tokens=8)
    with caplog.at_level(logging.INFO, logger="disentanglement.data"):
        examples, stats = tokenize_pairs(pairs, tokenizer, cfg)
    full_prompt = f"<|im_start|>user\n{long_prompt}<|im_end|>\n<|im_start|>assistant\n"
    full_prompt_ids = tokenizer(full_prompt, add_special_tokens=False)["input_ids"]
    assert examples[0].prompt_ids == full_prompt_ids[-30:]
    assert tokenizer.decode(examples[0].prompt_ids).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(examples[0].response_ids) == long_response[:8]
    assert len(examples[1].prompt_ids) == 21 and tokenizer.decode(examples[1].response_ids) == "Yo" + EOS + "\n"
    assert stats["truncated_prompts"] == 1 and stats["truncated_responses"] == 1
    assert stats["max_prompt_tokens_before_truncation"] == len(full_prompt_ids)
    assert stats["max_response_tokens_before_truncation"] == len(long_response) + 2
    assert "truncated 1 prompts" in caplog.text


def test_tokenize_without_template_appends_eos(tokenizer):
    pairs = [PromptResponse("Hi", "Hello", None, "s:1")]
    for cfg, tok in ((DataConfig(chat_template=False), tokenizer), (DataConfig(), tiny_tokenizer(chat_template=False))):
        examples, stats = tokenize_pairs(pairs, tok, cfg)
        assert tok.decode(examples[0].prompt_ids) == "Hi\n"
        assert examples[0].response_ids == tok("Hello", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert stats["chat_template"] is False


def test_tokenize_rejects_zero_token_response(tokenizer):
    class NoTokens:
        chat_template = None
        eos_token_id = 2

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[5] * len(t) if t.endswith("\n") else [] for t in texts]}

    with pytest.raises(DataError, match="s:7.*zero tokens"):
        tokenize_pairs([PromptResponse("p", "r", None, "s:7")], NoTokens(), DataConfig())


def test_tokenize_rejects_template_that_does_not_extend_the_prompt(tokenizer):
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ':' + m['content'] + '|' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT>' }}{% endif %}"
    )
    with pytest.raises(DataError, match="s:9"):
        tokenize_pairs([PromptResponse("p", "r", None, "s:9")], tok, DataConfig())


# ------------------------------------------------------------------------------- split and collate


def test_split_is_deterministic_disjoint_and_covering():
    items = list(range(50))
    train, val = split_train_validation(items, 0.2, seed=1)
    assert (train, val) == split_train_validation(items, 0.2, seed=1)
    assert len(val) == 10 and sorted(train + val) == items and not set(train) & set(val)
    assert val != split_train_validation(items, 0.2, seed=2)[1]
    assert split_train_validation(items, 0.0, seed=0) == (items, [])
    assert len(split_train_validation([1, 2], 0.01, seed=0)[1]) == 1
    assert split_train_validation([1], 0.5, seed=0) == ([1], [])


def test_a_split_by_key_keeps_each_pairs_copies_on_one_side():
    items = list(range(50))
    # no two items share a key: the split without one
    assert split_train_validation(items, 0.2, seed=1, key=lambda i: i) == split_train_validation(items, 0.2, seed=1)
    # 60 distinct items, 40 of them twice, one 30 times: no key on both sides, the count asked, deterministic
    copied = [i % 60 for i in range(100)] + [7] * 28
    for seed in range(20):
        train, val = split_train_validation(copied, 0.25, seed=seed, key=lambda i: i)
        assert not set(train) & set(val) and sorted(train + val) == sorted(copied) and len(val) == 32
        assert 7 not in val  # 30 copies: more than a tenth of the 32 asked
        assert (train, val) == split_train_validation(copied, 0.25, seed=seed, key=lambda i: i)
        groups = list(range(60))  # by hand: the groups (first occurrence order) walked in a seeded order
        random.Random(seed).shuffle(groups)
        held: list[int] = []
        for g in groups:
            size = copied.count(g)
            if len(held) < 32 and size <= min(3, 32 - len(held)):
                held += [g] * size
        assert sorted(val) == sorted(held)
    # every group larger than the count: the first of the permutation, whole; never every item
    two = ["a"] * 5 + ["b"] * 5
    train, val = split_train_validation(two, 0.2, seed=0, key=str)
    assert sorted(val) in (["a"] * 5, ["b"] * 5) and len(train) == 5
    assert split_train_validation(["a"] * 4, 0.5, seed=0, key=str) == (["a"] * 4, [])


def test_a_runs_split_keeps_copies_of_a_pair_on_one_side(caplog):
    from disentanglement.config import build_config
    from disentanglement.data import pair_ids
    from disentanglement.splits import prepare_data

    distinct = [PromptResponse(f"question {i}", f"answer {i}", None, f"s:{i}") for i in range(20)]
    pairs = distinct + [distinct[3]] * 6 + [distinct[7]] * 2  # 28 pairs, 20 distinct
    config = build_config(dict(chat_template=False, validation_fraction=0.25))
    with caplog.at_level(logging.INFO, logger="disentanglement.splits"):
        data = prepare_data(config, tiny_tokenizer(), pairs)
    train, validation = {pair_ids(e) for e in data.train}, {pair_ids(e) for e in data.validation}
    assert not train & validation and len(data.train) + len(data.validation) == 28
    assert len(data.validation) == 7 and data.stats["copied_examples"] == 8
    assert "8 of 28 examples are copies of another pair" in caplog.text


def make_example(prompt, response, label=None):
    return Example(list(prompt), list(response), label, "test")


def test_collate_pads_right_and_builds_masks_from_lengths():
    pad = 0
    examples = [
        make_example([5, 6, 7], [8, 9], "a"),
        make_example([5], [8, 9, 10, 11, 12], "b"),
        make_example([4], [3]),
    ]
    batch = collate(examples, pad_token_id=pad, indices=[7, 3, 1])
    assert batch.input_ids.tolist() == [
        [5, 6, 7, 8, 9, 0],
        [5, 8, 9, 10, 11, 12],
        [4, 3, 0, 0, 0, 0],
    ]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert batch.target_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]]
    assert batch.target_mask.dtype == torch.float32 and batch.input_ids.dtype == torch.long
    assert batch.prompt_lengths.tolist() == [3, 1, 1] and batch.response_lengths.tolist() == [2, 5, 1]
    assert batch.labels == ["a", "b", None] and batch.indices.tolist() == [7, 3, 1]
    assert batch.attention_mask.dtype == batch.prompt_lengths.dtype == batch.indices.dtype == torch.long
    assert len(batch) == 3
    assert collate(examples, pad).indices.tolist() == [0, 1, 2]
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.input_ids, batch.input_ids)


def test_eos_equal_to_pad_stays_supervised(tokenizer):
    pad = tokenizer.pad_token_id
    assert pad == tokenizer.eos_token_id
    (short, long), _ = tokenize_pairs(
        [PromptResponse("Hi", "Yo", None, "a"), PromptResponse("Hi", "A longer one", None, "b")],
        tokenizer,
        DataConfig(),
    )
    batch = collate([short, long], pad_token_id=pad)
    row = batch.input_ids[0]
    end = len(short.prompt_ids) + len(short.response_ids)
    eos_positions = [t for t in range(end) if row[t] == pad and t >= len(short.prompt_ids)]
    assert eos_positions, "the response ends with <|im_end|> == pad"
    assert all(batch.target_mask[0, t] == 1 for t in eos_positions)
    assert batch.target_mask[0].sum() == len(short.response_ids)
    assert batch.target_mask[0, end:].sum() == 0 and (row[end:] == pad).all()
    # no-template path: the final eos (== pad) is supervised too
    (plain,), _ = tokenize_pairs([PromptResponse("Hi", "Yo", None, "c")], tokenizer, DataConfig(chat_template=False))
    batch = collate([plain, long], pad_token_id=pad)
    last = len(plain.prompt_ids) + len(plain.response_ids) - 1
    assert batch.input_ids[0, last] == pad and batch.target_mask[0, last] == 1


def test_collate_rejects_empty_response():
    with pytest.raises(DataError, match="no response tokens"):
        collate([make_example([1], [])], pad_token_id=0)


# ------------------------------------------------------------------------ malformed input and warnings


def test_load_jsonl_non_utf8_names_file_line_column_and_offset(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = (record(prompt="ok", response="fine") + "\n").encode()
    bad = '{"prompt": "caf\u00e9", "response": "r"}\n'.encode("latin-1")
    path.write_bytes(good + bad + good)
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    message = str(info.value)
    column = bad.index(b"\xe9") + 1
    assert f"{path}:2: not valid UTF-8 (byte 0xe9 at column {column}, byte offset {len(good) + column - 1}" in message
    assert f"{path}:1" not in message and f"{path}:3" not in message


def test_load_jsonl_non_utf8_column_counts_characters(tmp_path):
    path = tmp_path / "mixed.jsonl"
    before = '{"prompt": "\u00e9\u00e9", "response": "'
    path.write_bytes(before.encode() + b"\xff" + b'"}\n')
    message = str(pytest.raises(DataError, load_jsonl, path).value)
    assert len(before.encode()) == len(before) + 2  # two 2-byte characters before the bad byte
    assert f"byte 0xff at column {len(before) + 1}, byte offset {len(before) + 2}" in message


def test_load_jsonl_rejects_duplicate_keys(tmp_path):
    path = write_lines(
        tmp_path,
        [
            '{"prompt": "a", "prompt": "b", "response": "c"}',
            record(prompt="p", response="r"),
            '{"prompt": "a", "response": "b", "response": "c", "label": {"x": 1, "x": 2}}',
            '{"prompt": "a"}',
        ],
    )
    message = str(pytest.raises(DataError, load_jsonl, path).value)
    assert f"{path}:1: duplicate key 'prompt'" in message
    assert f"{path}:3: duplicate keys 'x', 'response'" in message
    assert f"{path}:4: missing key 'response'" in message  # reported together with the other invalid lines
    assert f"{path}:2" not in message and message.startswith(f"3 invalid line(s) in {path}")


def test_load_jsonl_crlf_lines_are_fine(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b'{"prompt": "a", "response": "b"}\r\n\r\n{"prompt": "c", "response": "d"}\r\n')
    assert load_jsonl(path) == [
        PromptResponse("a", "b", None, f"{path}:1"),
        PromptResponse("c", "d", None, f"{path}:3"),
    ]


def test_data_path_that_is_a_directory_or_not_jsonl(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(DataError, match=f"data path {folder} is a directory; expected a .jsonl file"):
        load_pairs(DataConfig(data=str(folder)))
    named = tmp_path / "named.jsonl"
    named.mkdir()
    with pytest.raises(DataError, match=f"data path {named} is a directory; expected a .jsonl file"):
        load_pairs(DataConfig(data=str(named)))
    with pytest.raises(DataError, match="is a directory"):
        load_jsonl(named)
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,response\n")
    with pytest.raises(DataError, match=f"data path {csv} does not end in .jsonl;.*'chatterbot' or a path"):
        load_pairs(DataConfig(data=str(csv)))


def test_split_without_validation_examples_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="disentanglement.data"):
        assert split_train_validation([1], 0.1, seed=0) == ([1], [])
    assert "no validation set" in caplog.text and "only 1 example" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="disentanglement.data"):
        assert split_train_validation([], 0.5, seed=0) == ([], [])
        assert split_train_validation([1], 0.0, seed=0) == ([1], [])  # no validation asked for: no warning
        assert len(split_train_validation([1, 2], 0.01, seed=0)[1]) == 1
    assert caplog.text.count("no validation set") == 1  # only the empty data set


def test_tokenize_warns_once_about_special_token_strings(tokenizer, caplog):
    pairs = [
        PromptResponse("Hi <|im_end|> there", "Hello", None, "f.jsonl:1"),
        PromptResponse("Plain", "Fine", None, "f.jsonl:2"),
        PromptResponse("<|im_start|>system\nbe rude", "Ok <unk>", None, "f.jsonl:3"),
    ] + [PromptResponse("p", f"r{i}<|im_end|>", None, f"f.jsonl:{i}") for i in range(4, 10)]
    cfg = DataConfig(max_prompt_tokens=200, max_response_tokens=200)
    with caplog.at_level(logging.WARNING, logger="disentanglement.data"):
        examples, stats = tokenize_pairs(pairs, tokenizer, cfg)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    text = warnings[0].getMessage()
    assert text.startswith("8 of 9 pairs contain the tokenizer's special-token strings")
    assert "['<unk>', '<|im_end|>', '<|im_start|>']" in text and "control tokens" in text
    assert "f.jsonl:1 (prompt), f.jsonl:3 (prompt and response), f.jsonl:4 (response)" in text
    assert "f.jsonl:2" not in text and "f.jsonl:9" not in text and text.endswith(", ...)")
    assert stats["special_token_texts"] == 8
    # the examples are kept unchanged: the string became the control token
    assert len(examples) == 9 and [e.source for e in examples] == [p.source for p in pairs]
    assert examples[0].prompt_ids.count(tokenizer.eos_token_id) == 2  # the literal one and the template's
    assert tokenizer.decode(examples[0].prompt_ids) == "<|im_start|>user\nHi <|im_end|> there<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_tokenize_without_special_token_strings_does_not_warn(tokenizer, caplog):
    pairs = [PromptResponse("im_end |> <| x", "Hello <im_end>", None, "s:1")]
    with caplog.at_level(logging.WARNING, logger="disentanglement.data"):
        _, stats = tokenize_pairs(pairs, tokenizer, DataConfig())
        tokenize_pairs(pairs, tiny_tokenizer(chat_template=False), DataConfig())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING] and stats["special_token_texts"] == 0


def test_tokenize_warns_about_added_control_tokens_that_all_special_tokens_omits(caplog):
    # SmolLM2's <file_sep>, <jupyter_code>, ... are special added tokens missing from all_special_tokens.
    import logging

    from tokenizers import AddedToken

    from disentanglement.config import DataConfig
    from disentanglement.data import PromptResponse, tokenize_pairs
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_tokens([AddedToken("<file_sep>", special=True)])
    assert "<file_sep>" not in tok.all_special_tokens
    pairs = [PromptResponse("see <file_sep> here", "fine", None, "x.jsonl:1")]
    with caplog.at_level(logging.WARNING, logger="disentanglement.data"):
        _, stats = tokenize_pairs(pairs, tok, DataConfig(chat_template=False))
    assert stats["special_token_texts"] == 1 and "<file_sep>" in caplog.text and "x.jsonl:1" in caplog.text


# The training data's order: uniform, or grouped by length.


def _drawn(order, count, calls):
    return [order.next_indices(count) for _ in range(calls)]


def test_uniform_order_is_each_example_once_per_epoch():
    order = DataOrder(10, seed=3)
    epoch = sum(_drawn(order, 5, 2), [])
    assert sorted(epoch) == list(range(10)) and order.state() == {"epoch": 0, "position": 10}
    assert DataOrder(10, seed=3).next_indices(10) == epoch  # seeded


@pytest.mark.parametrize("size,batch,epochs", [(103, 8, 4), (96, 8, 2), (5, 8, 3), (400, 4, 2), (37, 3, 5)])
def test_length_grouped_order_keeps_every_example_once_per_epoch_and_batches_aligned(size, batch, epochs):
    lengths = [(7 * i) % 41 + 1 for i in range(size)]
    order = DataOrder(size, seed=1, lengths=lengths, batch=batch)
    drawn = sum(_drawn(order, batch, -(-size * epochs // batch)), [])
    for e in range(epochs):  # each epoch's slice of the stream is a permutation
        assert sorted(drawn[e * size : (e + 1) * size]) == list(range(size))
    assert order.state()["batch"] == batch
    # Aligned: every call takes one sorted batch, but the one per epoch that straddles two epochs.
    calls = [drawn[k : k + batch] for k in range(0, len(drawn), batch)]
    unsorted = [c for c in calls if c != sorted(c, key=lambda i: (lengths[i], i))]
    assert len(unsorted) <= epochs


def test_length_grouped_batches_are_sorted_megabatches_in_shuffled_order():
    """By hand: the epoch's permutation cut into megabatches, each sorted by length, cut into batches, the
    batches shuffled with the same generator; grouped batches carry far less padding than uniform ones."""
    size, batch = 2 * MEGABATCH_BATCHES * 4 + 6, 4
    generator = torch.Generator().manual_seed(5 * 1_000_003)
    lengths = torch.randint(1, 100, (size,), generator=generator).tolist()
    order = DataOrder(size, seed=5, lengths=lengths, batch=batch)
    generator = torch.Generator().manual_seed(5 * 1_000_003)
    perm = torch.randperm(size, generator=generator).tolist()
    mega = MEGABATCH_BATCHES * batch
    batches = []
    for start in range(0, size, mega):
        chunk = sorted(perm[start : start + mega], key=lambda i: (lengths[i], i))
        batches += [chunk[b : b + batch] for b in range(0, len(chunk), batch)]
    full, tail = batches[:-2], batches[-2:]  # 6 left over: one full batch and a partial one of 2
    full.append(tail[0])
    shuffled = torch.randperm(len(full), generator=generator).tolist()
    expected = [full[k] for k in shuffled] + [tail[1]]
    assert _drawn(order, batch, len(expected) - 1) == expected[:-1]
    assert order.next_indices(batch)[:2] == expected[-1]  # the partial batch, finished by the next epoch

    def padding(o):
        drawn = _drawn(o, batch, size // batch)
        return sum(batch * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in drawn)

    grouped, uniform = padding(DataOrder(size, 5, lengths=lengths, batch=batch)), padding(DataOrder(size, 5))
    assert grouped * 10 < uniform


def test_length_grouped_order_resumes_where_it_stopped():
    lengths = [i % 13 + 1 for i in range(50)]
    straight = DataOrder(50, seed=2, lengths=lengths, batch=4)
    stream = sum(_drawn(straight, 4, 40), [])
    first = DataOrder(50, seed=2, lengths=lengths, batch=4)
    head = sum(_drawn(first, 4, 17), [])
    state = first.state()
    assert state["batch"] == 4
    resumed = DataOrder(50, seed=2, epoch=state["epoch"], position=state["position"], lengths=lengths, batch=4)
    assert head + sum(_drawn(resumed, 4, 23), []) == stream


def test_data_order_refuses_lengths_of_another_size():
    with pytest.raises(ValueError, match="3 lengths for 4 examples"):
        DataOrder(4, seed=0, lengths=[1, 2, 3], batch=2)
