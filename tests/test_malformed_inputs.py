"""Malformed inputs are refused before any model loads, with exit code 2 and a message saying what and where.

Each row of ``TRAIN_CASES`` is one bad input: a config file's text (``yaml``/``json``), a JSONL data
file's bytes (``jsonl``) or a data path that is not a file (``data_dir``/``data_file``), the extra
command-line arguments, and the fragments expected in stderr (``{file}`` stands for the path written).
``disentangle train`` must return 2 without loading the model. Adding a case is adding one row.
``EVAL_CASES`` does the same for ``eval`` and ``inspect`` on a checkpoint whose model must not load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import disentanglement.lm as lm
from disentanglement import cli, trainer
from disentanglement.config import build_config, write_run_config

Writer = Callable[[Path], tuple[list[str], Path]]  # writes the bad input under tmp_path: (arguments, path)


def config_yaml(text: str, name: str = "run.yaml") -> Writer:
    """A YAML config file holding ``text``, passed as ``--config``."""

    def write(tmp_path: Path) -> tuple[list[str], Path]:
        path = tmp_path / name
        path.write_text(text)
        return ["--config", str(path)], path

    return write


def config_json(text: str) -> Writer:
    """A JSON config file holding ``text``, passed as ``--config``."""
    return config_yaml(text, name="run.json")


def jsonl(content: bytes, name: str = "data.jsonl") -> Writer:
    """A data file holding ``content`` (bytes, so that any encoding can be tested), passed as ``--data``."""

    def write(tmp_path: Path) -> tuple[list[str], Path]:
        path = tmp_path / name
        path.write_bytes(content)
        return ["--data", str(path)], path

    return write


def data_dir(name: str = "data") -> Writer:
    """A directory passed as ``--data``."""

    def write(tmp_path: Path) -> tuple[list[str], Path]:
        path = tmp_path / name
        path.mkdir()
        return ["--data", str(path)], path

    return write


def missing(name: str = "missing.jsonl") -> Writer:
    """A ``--data`` path that does not exist."""
    return lambda tmp_path: (["--data", str(tmp_path / name)], tmp_path / name)


GOOD = b'{"prompt": "p", "response": "r"}\n'


def case(case_id: str, writer: Writer, *expected: str, args: tuple[str, ...] = (), output_dir: bool = True):
    """One row: ``output_dir=False`` leaves out ``--output-dir`` (when the config file's output_dir is the bad value)."""
    return pytest.param(writer, list(args), expected, output_dir, id=case_id)


# fmt: off
TRAIN_CASES = [
    case("lora-target-modules-empty", config_yaml("decoder_training: lora\nlora_target_modules: []\n"), "config file {file}: ModelConfig.lora_target_modules must name at least one module for LoRA, got []"),
    case("output-dir-empty", config_yaml("output_dir: ''\n"), "config file {file}: TrainConfig.output_dir must name a directory, got ''", output_dir=False),
    # type confusion in a config file: the field, the value and its type, and the file
    case("chat-template-string-false", config_yaml('chat_template: "false"\n'), "config file {file}: DataConfig.chat_template must be a boolean (true/false), got 'false' (str)"),
    case("feature-cache-string-no", config_yaml("train:\n  feature_cache: 'no'\n"), "config file {file}: TrainConfig.feature_cache must be a boolean (true/false), got 'no' (str)"),
    case("output-dir-number", config_yaml("output_dir: 5\n"), "config file {file}: TrainConfig.output_dir must be a string, got 5 (int)", output_dir=False),
    case("output-dir-list", config_yaml("output_dir: [a, b]\n"), "TrainConfig.output_dir must be a string, got ['a', 'b'] (list)", output_dir=False),
    case("model-number", config_yaml("model:\n  model: 135\n"), "config file {file}: ModelConfig.model must be a string or null, got 135 (int)"),
    case("model-list", config_yaml("model: [a, b]\n"), "ModelConfig.model must be a string or null, got ['a', 'b'] (list)"),
    case("data-number", config_yaml("data: 3\n"), "config file {file}: DataConfig.data must be a string, got 3 (int)"),
    case("data-list", config_yaml("data:\n  data: [a.jsonl]\n"), "DataConfig.data must be a string, got ['a.jsonl'] (list)"),
    case("lora-target-modules-string", config_yaml("lora_target_modules: q_proj\n"), "ModelConfig.lora_target_modules must be a list of strings or null, got 'q_proj' (str); write a list: [q_proj] in a config file"),
    case("lora-target-modules-number-item", config_yaml("lora_target_modules: [q_proj, 3]\n"), "got ['q_proj', 3] (list) (item 3 is int)"),
    case("int-field-given-1.5", config_yaml("max_steps: 1.5\n"), "config file {file}: TrainConfig.max_steps must be an integer, got 1.5 (float)"),
    case("int-field-given-bool", config_yaml("train:\n  batch_size: true\n"), "TrainConfig.batch_size must be an integer, got True (bool)"),
    case("float-field-given-bool", config_yaml("kl:\n  beta: yes\n"), "KLConfig.beta must be a number, got True (bool)"),
    case("float-field-given-string", config_yaml("beta: '0.1'\n"), "KLConfig.beta must be a number, got '0.1' (str)"),
    case("json-bool-as-string", config_json('{"data": {"chat_template": "false"}}'), "config file {file}: DataConfig.chat_template must be a boolean"),
    # keys of a config file
    case("yaml-duplicate-key", config_yaml("kl:\n  beta: 0.1\n  beta: 0.2\n"), "config file {file}: duplicate key 'beta' on line 3 (first on line 2)"),
    case("json-duplicate-key", config_json('{"beta": 0.1, "max_steps": 3, "beta": 0.2}'), "config file {file}: duplicate key 'beta'"),
    case("flat-and-nested-key", config_yaml("beta: 0.1\nkl:\n  beta: 0.2\n"), "config file {file}: field 'beta' is given twice (as 'beta' and as 'kl.beta')"),
    case("unknown-key", config_yaml("betta: 0.1\n"), "config file {file}: unknown key 'betta'"),
    case("unknown-key-in-section", config_yaml("kl:\n  betta: 0.1\n"), "config file {file}: unknown key kl.betta"),
    case("invalid-yaml", config_yaml("kl: [1, 2\n"), "config file {file} is not valid YAML"),
    case("invalid-json", config_json('{"beta": 0.1,}'), "config file {file} is not valid JSON"),
    # data files and paths
    case("jsonl-not-utf8", jsonl(GOOD + b'{"prompt": "caf\xe9", "response": "r"}\n'), "{file}:2: not valid UTF-8 (byte 0xe9 at column 16, byte offset 48"),
    case("jsonl-duplicate-key", jsonl(GOOD + b'{"prompt": "a", "prompt": "b", "response": "c"}\n'), "{file}:2: duplicate key 'prompt'"),
    case("jsonl-missing-key", jsonl(GOOD + b'{"prompt": "a"}\n'), "{file}:2: missing key 'response'"),
    case("jsonl-non-string-response", jsonl(b'{"prompt": "a", "response": 7}\n' + GOOD), "{file}:1: key 'response' must be a string, got int"),
    case("jsonl-empty-response", jsonl(GOOD + b'{"prompt": "a", "response": "  "}\n'), "{file}: 1 empty or whitespace-only response(s)", "line(s) 2"),
    case("jsonl-invalid-json", jsonl(GOOD + b'{"prompt": "a", "response": "b"\n'), "{file}:2: invalid JSON"),
    case("jsonl-not-an-object", jsonl(b"[1, 2]\n" + GOOD), "{file}:1: expected a JSON object, got list"),
    case("jsonl-several-problems", jsonl(b'{"prompt": 1, "response": "b"}\n' + GOOD + b"{bad\n"), "2 invalid line(s) in {file}", "{file}:1: key 'prompt'", "{file}:3: invalid JSON"),
    case("jsonl-no-pairs", jsonl(b"\n\n"), "{file} holds no prompt/response pairs"),
    case("jsonl-label-float", jsonl(GOOD + b'{"prompt": "a", "response": "b", "label": 1.5}\n'), "{file}:2: key 'label' must be a string, an integer or null (or an object of named factors"),
    case("jsonl-label-empty-object", jsonl(GOOD + b'{"prompt": "a", "response": "b", "label": {}}\n'), "{file}:2: key 'label' is an empty object"),
    case("jsonl-label-factor-float", jsonl(b'{"prompt": "a", "response": "b", "label": {"style": 0.5}}\n' + GOOD), "{file}:1: key 'label' factor 'style' must be a string or an integer, got float"),
    case("jsonl-label-factor-null", jsonl(b'{"prompt": "a", "response": "b", "label": {"style": null}}\n'), "{file}:1: key 'label' factor 'style' must be a string or an integer, got NoneType"),
    case("jsonl-label-factor-nested", jsonl(b'{"prompt": "a", "response": "b", "label": {"style": {"x": 1}}}\n'), "{file}:1: key 'label' factor 'style' must be a string or an integer, got dict"),
    case("jsonl-label-factor-duplicate", jsonl(b'{"prompt": "a", "response": "b", "label": {"s": "x", "s": "y"}}\n'), "{file}:1: duplicate key 's'"),
    case("jsonl-label-with-other-problems", jsonl(b'{"prompt": "a", "response": "b", "label": {}}\n{bad\n'), "2 invalid line(s) in {file}", "{file}:1: key 'label' is an empty object", "{file}:2: invalid JSON"),
    case("jsonl-label-factors-differ", jsonl(b'{"prompt": "a", "response": "b", "label": {"style": "x", "topic": "y"}}\n{"prompt": "a", "response": "b", "label": {"style": "x"}}\n'), "{file}:2: label factors ['style'] differ from ['style', 'topic'] of the first labelled example ({file}:1)"),
    case("jsonl-label-string-and-object", jsonl(b'{"prompt": "a", "response": "b", "label": "x"}\n{"prompt": "a", "response": "b", "label": {"style": "x"}}\n'), "{file}:2: label factors ['style'] differ from ['label']"),
    case("data-path-is-a-directory", data_dir(), "data path {file} is a directory; expected a .jsonl file"),
    case("data-path-is-a-jsonl-directory", data_dir("data.jsonl"), "data path {file} is a directory; expected a .jsonl file"),
    case("data-path-not-jsonl", jsonl(GOOD, name="data.json"), "data path {file} does not end in .jsonl"),
    case("data-path-missing", missing(), "data file {file} does not exist"),
]
# fmt: on


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(lm, "load_model_and_tokenizer", refuse)
    monkeypatch.setattr(trainer, "load_trained", refuse)


@pytest.mark.parametrize(("writer", "args", "expected", "output_dir"), TRAIN_CASES)
def test_malformed_train_input_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, capsys, no_model, writer, args, expected, output_dir
):
    monkeypatch.chdir(tmp_path)  # a default output_dir would land here
    bad_args, path = writer(tmp_path)
    argv = ["train", *bad_args, *args, "--no-progress"]
    if output_dir:
        argv += ["--output-dir", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("disentangle train: error: "), err
    for fragment in expected:
        assert fragment.format(file=path) in err, f"{fragment.format(file=path)!r} not in {err!r}"
    assert "Traceback" not in err


def test_non_utf8_config_file_names_the_file(tmp_path, capsys, no_model):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("output_dir: caf\u00e9\n".encode("latin-1"))
    assert cli.main(["train", "--config", str(path)]) == 2
    assert f"config file {path} is not UTF-8 text" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# eval and inspect: options and --data checked before the checkpoint's model loads


@pytest.fixture
def fake_run(tmp_path) -> Path:
    """A run directory with one checkpoint that has a trainer state and a config (keys q/a), and no weights."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"q": "p", "a": "r"}) + "\n")
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 1, "zfree_reference_scale": 1.0}))
    config = build_config({"data": str(data), "prompt_key": "q", "response_key": "a", "output_dir": str(tmp_path)})
    write_run_config(config, checkpoint / "config.yaml")
    return tmp_path / "run"


def run_data(name: str, content: bytes | None) -> Callable[[Path], tuple[list[str], Path]]:
    """``--data tmp_path/name`` holding ``content`` (a directory when None)."""

    def write(tmp_path: Path) -> tuple[list[str], Path]:
        path = tmp_path / name
        path.mkdir() if content is None else path.write_bytes(content)
        return ["--data", str(path)], path

    return write


def no_input(tmp_path: Path) -> tuple[list[str], Path]:
    return [], tmp_path


QA = b'{"q": "p", "a": "r"}\n'

# fmt: off
EVAL_CASES = [
    pytest.param("eval", missing(), (), ("missing.jsonl", "does not exist"), id="eval-data-missing"),
    pytest.param("inspect", missing(), (), ("missing.jsonl", "does not exist"), id="inspect-data-missing"),
    pytest.param("eval", run_data("folder", None), (), ("data path {file} is a directory",), id="eval-data-directory"),
    pytest.param("eval", run_data("d.txt", QA), (), ("data path {file} does not end in .jsonl",), id="eval-data-not-jsonl"),
    pytest.param("eval", run_data("d.jsonl", GOOD), (), ("1 invalid line(s) in {file}", "{file}:1: missing key 'q'", "{file}:1: missing key 'a'"), id="eval-data-uses-the-run-keys"),
    pytest.param("inspect", run_data("d.jsonl", QA + b'{"q": "p", "q": "x", "a": "r"}\n'), (), ("{file}:2: duplicate key 'q'",), id="inspect-data-duplicate-key"),
    pytest.param("eval", run_data("d.jsonl", b'{"q": "\xff", "a": "r"}\n'), (), ("{file}:1: not valid UTF-8",), id="eval-data-not-utf8"),
    pytest.param("eval", run_data("d.jsonl", b'{"q": "p", "a": "r", "label": {"style": 2.5}}\n'), (), ("{file}:1: key 'label' factor 'style' must be a string or an integer, got float",), id="eval-data-label-factor-float"),
    pytest.param("inspect", run_data("d.jsonl", b'{"q": "p", "a": "r", "label": {"s": "x"}}\n{"q": "p", "a": "r", "label": {"t": "x"}}\n'), (), ("{file}:2: label factors ['t'] differ from ['s']",), id="inspect-data-label-factors-differ"),
    pytest.param("eval", no_input, ("--max-examples", "0"), ("--max-examples must be an integer >= 1, got 0",), id="eval-max-examples-0"),
    pytest.param("eval", no_input, ("--iw-samples", "0"), ("--iw-samples must be an integer >= 1, got 0",), id="eval-iw-samples-0"),
    pytest.param("eval", no_input, ("--prior-samples", "-2"), ("--prior-samples must be an integer >= 1, got -2",), id="eval-prior-samples-negative"),
    pytest.param("eval", no_input, ("--batch-size", "0"), ("--batch-size must be an integer >= 1, got 0",), id="eval-batch-size-0"),
    pytest.param("eval", no_input, ("--exact-limit", "-1"), ("--exact-limit must be an integer >= 0, got -1",), id="eval-exact-limit-negative"),
    pytest.param("eval", no_input, ("--output", "."), ("--output . is a directory",), id="eval-output-directory"),
    pytest.param("eval", no_input, ("--output", "train.jsonl/r.json"), ("--output train.jsonl/r.json: train.jsonl is a file",), id="eval-output-under-a-file"),
    pytest.param("inspect", no_input, ("--output-dir", "train.jsonl/sub"), ("--output-dir train.jsonl/sub: train.jsonl is a file",), id="inspect-output-dir-under-a-file"),
    pytest.param("inspect", no_input, ("--index", "-1"), ("--index must be an integer >= 0, got -1",), id="inspect-index-negative"),
    pytest.param("inspect", no_input, ("--index", "5", "--max-examples", "5"), ("--index 5 is outside [0, 5)",), id="inspect-index-past-max-examples"),
    pytest.param("inspect", no_input, ("--prior-samples", "0"), ("--prior-samples must be an integer >= 1, got 0",), id="inspect-prior-samples-0"),
    pytest.param("inspect", no_input, ("--alpha", "-1"), ("--alpha must be a finite number >= 0, got -1.0",), id="inspect-alpha-negative"),
    pytest.param("inspect", no_input, ("--alpha", "nan"), ("--alpha must be a finite number >= 0",), id="inspect-alpha-nan"),
]
# fmt: on


@pytest.mark.parametrize(("command", "writer", "args", "expected"), EVAL_CASES)
def test_malformed_eval_and_inspect_options_are_refused_before_the_model_loads(
    fake_run, tmp_path, monkeypatch, capsys, no_model, command, writer, args, expected
):
    monkeypatch.chdir(tmp_path)
    bad_args, path = writer(tmp_path)
    assert cli.main([command, str(fake_run), *bad_args, *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"disentangle {command}: error: "), err
    for fragment in expected:
        assert fragment.format(file=path) in err, f"{fragment.format(file=path)!r} not in {err!r}"


def test_eval_missing_data_file_names_it_and_loads_no_model(fake_run, tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("model must not load")

    monkeypatch.setattr(trainer, "load_trained", refuse)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["eval", str(fake_run), "--data", "missing.jsonl"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("split", ["validation", "train"])
def test_eval_split_whose_data_file_is_gone(fake_run, tmp_path, capsys, no_model, split):
    (tmp_path / "train.jsonl").unlink()
    assert cli.main(["eval", str(fake_run), "--data", split]) == 2
    err = capsys.readouterr().err
    assert f"--data {split} rebuilds the run's split from its data file {tmp_path / 'train.jsonl'}" in err


def test_good_options_reach_the_model_load(fake_run, tmp_path, capsys, no_model):
    """The early checks pass valid options and data through to loading (which the fixture refuses)."""
    data = tmp_path / "ok.jsonl"
    data.write_bytes(QA)
    for command in (["eval", str(fake_run), "--data", str(data)], ["inspect", str(fake_run), "--index", "0"]):
        with pytest.raises(AssertionError, match="the model must not load"):
            cli.main(command)
