"""The reliability probes of issue 26, each a test that reproduces the original problem on a tiny model.

Symlinks planted in a run directory never redirect a write (``safe_io``), an ``--overwrite`` or a pruning
never leaves a run half removed, bad inputs are one-line errors with exit 2 (never a traceback), options
are never silently ignored, forged non-finite checkpoints are refused naming the file and tensor, sweeps
cannot fake an interval, every numeric option is range-checked before the model loads, and
``rng.safetensors`` is written byte for byte the same. docs/reliability.md lists them for a reader.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from disentanglement import checkpoints, cli, safe_io, stability, trainer
from disentanglement.checkpoints import complete_checkpoints, latest_checkpoint
from disentanglement.testing import make_hidden_factor_pairs
from helpers import Stop, stop_at, tiny_llama, tiny_tokenizer, trainer_config

PROMPTS = [f"tell me about topic {i}" for i in range(24)]


def pairs():
    return make_hidden_factor_pairs(PROMPTS, kind="clean", seed=0)


def train_tiny(output_dir: Path, callbacks=(), **overrides):
    """Two steps of the trainer tests' tiny run, a checkpoint after each."""
    tokenizer = tiny_tokenizer(chat_template=False)
    settings = dict(max_steps=2, save_every=1, eval_every=2, eval_batches=1, warmup_steps=1, device="cpu")
    settings.update(overrides)
    config = trainer_config(output_dir, **settings)
    return trainer.train(config, (tiny_llama(len(tokenizer)), tokenizer), pairs(), callbacks)


def write_data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": p.prompt, "response": p.response}) + "\n" for p in pairs()))
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A trained two-step continuous run whose config names a data file (for eval, inspect and encode)."""
    root = tmp_path_factory.mktemp("tiny")
    data = write_data(root / "data.jsonl")
    train_tiny(root / "run", data=str(data), latent="continuous")
    return root / "run"


@pytest.fixture
def fresh_run(tiny_run, tmp_path) -> Path:
    """A copy of :func:`tiny_run` that a test may plant links in."""
    import shutil

    target = tmp_path / "run"
    shutil.copytree(tiny_run, target, symlinks=True)
    return target


@pytest.fixture
def loader(monkeypatch):
    """``trainer.load_trained`` on a fresh tiny decoder (the checkpoint's weights on top)."""
    original = trainer.load_trained

    def load(checkpoint, _=None, **kwargs):
        tokenizer = tiny_tokenizer(chat_template=False)
        return original(checkpoint, (tiny_llama(len(tokenizer)), tokenizer), **kwargs)

    monkeypatch.setattr(trainer, "load_trained", load)


def outside_file(tmp_path: Path, name: str = "victim.txt") -> Path:
    victim = tmp_path / "outside" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_text("must not change\n")
    return victim


def fails(argv: list[str], capsys, code: int = 2) -> str:
    """Run the command line; it must return ``code`` with a one-line error and no traceback."""
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert f"disentangle {argv[0]}: error: " in err, err
    return err


FAST_EVAL = ["--no-progress", "--max-examples", "4", "--iw-samples", "1", "--prior-samples", "2", "--batch-size", "4"]


# ------------------------------------------------------------------------------------------------
# 1. writes never follow a symbolic link


def test_atomic_write_replaces_a_link_and_never_writes_its_target(tmp_path):
    victim = outside_file(tmp_path)
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    safe_io.write_json(link, {"a": 1})
    assert victim.read_text() == "must not change\n"
    assert not link.is_symlink() and json.loads(link.read_text()) == {"a": 1}
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "outside" / "created-through-link.txt")
    safe_io.atomic_write(dangling, "x")
    assert not (tmp_path / "outside" / "created-through-link.txt").exists()
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left"
    umask = os.umask(0o027)
    try:
        safe_io.atomic_write(tmp_path / "mode.txt", "x")
    finally:
        os.umask(umask)
    assert (tmp_path / "mode.txt").stat().st_mode & 0o777 == 0o640, "the mode follows the umask, as open()'s"


def test_a_linked_folder_under_the_root_is_refused(tmp_path):
    (tmp_path / "outside").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(safe_io.UnsafePathError, match=r"eval is a symbolic link; nothing is written through a link"):
        safe_io.write_json(run / "eval" / "r.json", {}, root=run)
    assert not list((tmp_path / "outside").iterdir())
    # the path the user gave may itself be a link: it is used as given
    user_dir = tmp_path / "mine"
    user_dir.symlink_to(tmp_path / "outside", target_is_directory=True)
    safe_io.write_json(user_dir / "r.json", {"b": 2})
    assert json.loads((tmp_path / "outside" / "r.json").read_text()) == {"b": 2}


def test_open_append_refuses_a_link(tmp_path):
    victim = outside_file(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(safe_io.UnsafePathError, match="metrics.jsonl is a symbolic link"):
        safe_io.open_append(tmp_path / "metrics.jsonl")
    assert victim.read_text() == "must not change\n"


def test_eval_replaces_planted_report_links(fresh_run, tmp_path, loader, capsys):
    victim_json, victim_md = outside_file(tmp_path, "a.json"), outside_file(tmp_path, "a.md")
    (fresh_run / "eval").mkdir()
    (fresh_run / "eval" / "eval_validation.json").symlink_to(victim_json)
    (fresh_run / "eval" / "eval_validation.md").symlink_to(victim_md)
    assert cli.main(["eval", str(fresh_run), *FAST_EVAL]) == 0
    assert victim_json.read_text() == victim_md.read_text() == "must not change\n"
    report = fresh_run / "eval" / "eval_validation.json"
    assert not report.is_symlink() and json.loads(report.read_text())["examples"] == 4
    assert not (fresh_run / "eval" / "eval_validation.md").is_symlink()


def test_eval_refuses_a_linked_eval_folder_before_the_model_loads(fresh_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trainer, "load_trained", lambda *a, **k: pytest.fail("the model must not load"))
    (tmp_path / "outside").mkdir()
    (fresh_run / "eval").symlink_to(tmp_path / "outside", target_is_directory=True)
    err = fails(["eval", str(fresh_run), *FAST_EVAL], capsys)
    assert f"{fresh_run / 'eval'} is a symbolic link" in err
    assert not list((tmp_path / "outside").iterdir())


def test_inspect_replaces_planted_links(fresh_run, tmp_path, loader, capsys):
    victims = {name: outside_file(tmp_path, name) for name in ("inspect_0.html", "inspect_0.json", "kl.png")}
    (fresh_run / "inspect").mkdir()
    # a short log: the run's ~190 metrics would take most of the test drawing its curves
    (fresh_run / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "kl": 0.5}\n{"step": 2, "loss": 1.0, "kl": 0.4}\n'
    )
    for name, victim in victims.items():
        (fresh_run / "inspect" / name).symlink_to(victim)
    assert cli.main(["inspect", str(fresh_run), "--no-progress", "--max-examples", "4", "--batch-size", "4"]) == 0
    for name, victim in victims.items():
        assert victim.read_text() == "must not change\n", name
        assert not (fresh_run / "inspect" / name).is_symlink(), name
    assert (fresh_run / "inspect" / "kl.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("explore", [False, True])
def test_inspect_refuses_a_linked_inspect_folder_before_the_model_loads(fresh_run, tmp_path, capsys, no_model, explore):
    (tmp_path / "outside").mkdir()
    (fresh_run / "inspect").symlink_to(tmp_path / "outside", target_is_directory=True)
    err = fails(["inspect", str(fresh_run), "--no-progress", *(["--explore"] if explore else [])], capsys)
    assert f"{fresh_run / 'inspect'} is a symbolic link" in err
    assert not list((tmp_path / "outside").iterdir())


def test_train_refuses_a_linked_lock_and_metrics_never_follow_a_link(tmp_path):
    victim = outside_file(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(trainer.ConfigError, match=r"\.lock is a symbolic link"):
        train_tiny(run)
    assert victim.read_text() == "must not change\n"
    (run / ".lock").unlink()
    (run / "metrics.jsonl").symlink_to(tmp_path / "outside" / "new-metrics.jsonl")  # dangling: would be created
    with pytest.raises(safe_io.UnsafePathError, match="metrics.jsonl is a symbolic link"):
        train_tiny(run, resume="auto")
    assert not (tmp_path / "outside" / "new-metrics.jsonl").exists()


def test_train_writes_config_and_stats_over_links_not_through_them(tmp_path):
    victims = {name: outside_file(tmp_path, name) for name in ("config.yaml", "data_stats.json")}
    run = tmp_path / "run"
    run.mkdir()
    for name, victim in victims.items():
        (run / name).symlink_to(victim)
    train_tiny(run, overwrite=True, max_steps=1)
    for name, victim in victims.items():
        assert victim.read_text() == "must not change\n"
        assert not (run / name).is_symlink()


def test_a_linked_checkpoints_folder_is_refused(tmp_path):
    (tmp_path / "outside").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(tmp_path / "outside", target_is_directory=True)
    steps = []
    with pytest.raises(trainer.ConfigError, match="checkpoints is a symbolic link; a run writes only into real"):
        train_tiny(run, overwrite=True, max_steps=1, callbacks=[lambda step, record: steps.append(step)])
    assert steps == [], "refused before training"
    assert not list((tmp_path / "outside").iterdir())
    with pytest.raises(safe_io.UnsafePathError, match="checkpoints is a symbolic link"):  # the save checks too
        checkpoints.save_checkpoint(run, 1, {}, {"state": {}}, {}, {}, trainer_config(run))
    assert not list((tmp_path / "outside").iterdir())


def test_data_synth_output_link_is_replaced(tmp_path, capsys):
    victim = outside_file(tmp_path)
    link = tmp_path / "set.jsonl"
    link.symlink_to(victim)
    assert cli.main(["data", "synth", "clean", "--output", str(link), "--rows", "4"]) == 0
    assert victim.read_text() == "must not change\n"
    assert len(link.read_text().splitlines()) == 4


# ------------------------------------------------------------------------------------------------
# 2. no half-removed runs


def test_overwrite_with_a_linked_eval_folder_removes_the_link_only(fresh_run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (fresh_run / "eval").symlink_to(outside, target_is_directory=True)
    train_tiny(fresh_run, overwrite=True, max_steps=1)
    assert (outside / "keep.txt").read_text() == "keep", "a link is removed as a link"
    assert not (fresh_run / "eval").exists()
    assert [c.name for c in complete_checkpoints(fresh_run)] == ["step-000001"]
    assert not [p for p in fresh_run.iterdir() if p.name.startswith(safe_io.REMOVING_PREFIX)]


def test_a_failed_removal_puts_everything_back(tmp_path, monkeypatch):
    run = tmp_path / "run"
    for name in ("a", "b", "c"):
        (run / name).mkdir(parents=True)
        (run / name / "f").write_text(name)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name == "c":
            raise OSError(13, "Permission denied", str(src))
        real_rename(src, dst)

    monkeypatch.setattr(safe_io.os, "rename", rename)
    with pytest.raises(OSError, match="Permission denied"):
        safe_io.remove_all([run / "a", run / "b", run / "c"])
    assert sorted(p.name for p in run.iterdir()) == ["a", "b", "c"], "the run is whole again"
    assert all((run / n / "f").read_text() == n for n in "abc")


def test_pruning_removes_a_linked_checkpoint_as_a_link(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Stop):
        train_tiny(run, max_steps=3, callbacks=[stop_at(2)])
    outside = tmp_path / "outside-step"
    first = run / "checkpoints" / "step-000001"
    first.rename(outside)
    first.symlink_to(outside, target_is_directory=True)
    train_tiny(run, max_steps=3, resume="auto", keep_checkpoints=1)
    assert [c.name for c in complete_checkpoints(run)] == ["step-000003"]
    assert (outside / "trainer_state.json").is_file(), "the link's target is untouched"
    assert not os.path.lexists(first)


# ------------------------------------------------------------------------------------------------
# 8. rng.safetensors byte for byte


def test_rng_file_is_byte_identical_for_the_same_state():
    random.seed(3)
    np.random.seed(3)  # noqa: NPY002
    torch.manual_seed(3)
    state = checkpoints.rng_state()
    written = {checkpoints.rng_state_to_safetensors(state) for _ in range(30)}
    assert len(written) == 1, "the metadata is one key: its order cannot vary"


def test_rng_file_of_two_identical_runs_hashes_the_same(tmp_path):
    for name in ("a", "b"):
        train_tiny(tmp_path / name, max_steps=1)
    a, b = (latest_checkpoint(tmp_path / n) for n in ("a", "b"))
    # (config.yaml and trainer_state.json name the run's own directory, so they differ by that)
    for name in ("rng.safetensors", "model.safetensors", "optimizer.pt", "scheduler.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_rng_file_of_the_older_layout_still_reads(tmp_path):
    from safetensors.torch import save_file

    state = checkpoints.rng_state()
    version, mt, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    tensors = {
        "torch": state["torch"],
        "python_mt": torch.tensor(mt, dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
    }
    metadata = {
        "python": json.dumps({"version": version, "gauss_next": gauss}),
        "numpy": json.dumps({"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached": cached}),
    }
    save_file(tensors, tmp_path / "rng.safetensors", metadata=metadata)
    back = checkpoints.rng_state_from_safetensors(tmp_path / "rng.safetensors")
    assert back["python"] == state["python"] and torch.equal(back["torch"], state["torch"])


# ------------------------------------------------------------------------------------------------
# 3. no tracebacks: lone surrogates, --device cuda without CUDA

SURROGATE = b'{"prompt": "a\\ud800b", "response": "r"}\n'


@pytest.fixture
def no_model(monkeypatch):
    import disentanglement.lm as lm

    def refuse(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(lm, "load_model_and_tokenizer", refuse)
    monkeypatch.setattr(trainer, "load_trained", refuse)


def surrogate_file(tmp_path: Path) -> Path:
    path = tmp_path / "surrogate.jsonl"
    path.write_bytes(b'{"prompt": "p", "response": "r"}\n' + SURROGATE)
    return path


@pytest.mark.parametrize("command", ["train", "eval", "encode", "inspect"])
def test_lone_surrogate_is_an_invalid_line(tiny_run, tmp_path, capsys, no_model, command):
    data = surrogate_file(tmp_path)
    if command == "train":
        argv = ["train", "--data", str(data), "--output-dir", str(tmp_path / "run"), "--no-progress"]
    else:
        argv = [command, str(tiny_run), "--data", str(data), "--no-progress"]
        argv += ["--output", str(tmp_path / "x.jsonl")] if command == "encode" else []
    err = fails(argv, capsys)
    assert f"{data}:2: key 'prompt' holds a lone surrogate escape \\ud800 at character 2" in err


def test_a_surrogate_in_a_label_is_an_invalid_line(tmp_path):
    from disentanglement.data import DataError, load_jsonl

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "p", "response": "r", "label": {"style": "\\udc00"}}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: key 'label' factor 'style' holds a lone surrogate escape"):
        load_jsonl(path)


@pytest.mark.parametrize("command", ["train", "eval", "generate", "encode"])
def test_device_cuda_without_cuda_is_refused(tiny_run, tmp_path, capsys, monkeypatch, no_model, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = {
        "train": ["train", "--data", str(write_data(tmp_path / "d.jsonl")), "--output-dir", str(tmp_path / "run")],
        "eval": ["eval", str(tiny_run)],
        "generate": ["generate", str(tiny_run), "--prompt", "hi"],
        "encode": ["encode", str(tiny_run), "--output", str(tmp_path / "x.jsonl")],
    }[command]
    err = fails(
        [*argv, "--device", "cuda", "--no-progress"] if command != "generate" else [*argv, "--device", "cuda"], capsys
    )
    flag = "TrainConfig.device" if command == "train" else "--device"
    assert f"{flag} cuda: no usable CUDA device here (" in err
    assert "use --device cpu or auto" in err
    if command == "train":
        assert not (tmp_path / "run" / "config.yaml").exists(), "nothing recorded as trained on cuda"


# ------------------------------------------------------------------------------------------------
# 5. forged non-finite checkpoints, JSON that names its file, "last good" that is good


def forge(checkpoint: Path, value: float, pick=lambda names: names[0]) -> str:
    """Set one element of a weight of ``checkpoint`` to ``value`` and fix the recorded checksum, as a forger
    would; returns the tensor's name."""
    import hashlib

    from safetensors.torch import load, save

    tensors = load((checkpoint / "model.safetensors").read_bytes())
    name = pick(sorted(k for k, v in tensors.items() if v.is_floating_point()))
    tensors[name].view(-1)[0] = value
    data = save(tensors)
    (checkpoint / "model.safetensors").write_bytes(data)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["files"]["model.safetensors"] = hashlib.sha256(data).hexdigest()
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    return name


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("command", ["eval", "encode"])
def test_a_forged_non_finite_weight_is_refused_naming_file_and_tensor(fresh_run, tmp_path, capsys, command, value):
    checkpoint = latest_checkpoint(fresh_run)
    name = forge(checkpoint, value)
    argv = [command, str(fresh_run), "--no-progress"]
    argv += ["--output", str(tmp_path / "rows.parquet")] if command == "encode" else []
    err = fails(argv, capsys)
    assert f"{checkpoint / 'model.safetensors'}: refused: tensor {name} holds NaN or infinity" in err
    assert "Out of range float" not in err
    assert not (tmp_path / "rows.parquet").exists()


def test_resume_auto_skips_a_forged_checkpoint_and_never_calls_it_good(fresh_run, caplog):
    newest = latest_checkpoint(fresh_run)
    forge(newest, float("inf"))
    before = complete_checkpoints(fresh_run)[0]
    result = train_tiny(fresh_run, resume="auto", data=str(fresh_run.parent.parent / "data.jsonl"), latent="continuous")
    assert f"cannot resume from {newest}" in caplog.text and "holds NaN or infinity" in caplog.text
    assert f"resuming from {before}" in caplog.text
    assert result.checkpoint.name == "step-000002"
    assert bool(
        torch.isfinite(
            checkpoints.read_model_state(result.checkpoint)[sorted(checkpoints.read_model_state(result.checkpoint))[0]]
        ).all()
    )


def test_json_with_a_non_finite_number_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"r\.json: not written: gain\[1\] is inf, which JSON cannot hold"):
        safe_io.write_json(tmp_path / "r.json", {"gain": [0.5, float("inf")]})
    assert not (tmp_path / "r.json").exists()


def test_parquet_rows_with_nan_are_refused(tmp_path):
    from disentanglement.latent_file import write_rows

    with pytest.raises(ValueError, match=r"rows\.parquet: not written: latent_gain is nan"):
        write_rows([{"latent_gain": float("nan"), "label": None}], tmp_path / "rows.parquet")
    assert not (tmp_path / "rows.parquet").exists()


def test_a_blown_up_checkpoint_is_suspect_and_the_last_good_one_is_kept(tmp_path):
    from disentanglement.checkpoints import read_trainer_state

    with pytest.raises(trainer.TrainingDiverged) as error:
        train_tiny(tmp_path / "run", max_steps=4, latent_lr=1e30, keep_checkpoints=1)
    first, second = tmp_path / "run" / "checkpoints" / "step-000001", tmp_path / "run" / "checkpoints" / "step-000002"
    message = str(error.value)
    assert f"the last checkpoint {second} is suspect (parameter norms jumped more than 100x (latent " in message
    assert f"the last good checkpoint is {first}." in message
    assert [c.name for c in complete_checkpoints(tmp_path / "run")] == ["step-000001", "step-000002"]
    assert "suspect" not in read_trainer_state(first)
    norms = read_trainer_state(second)["param_norms"]
    assert norms["latent"] > 1e20 and norms["encoder"] < 1e3


def test_parameter_norms_match_an_independent_computation():
    state = {
        "encoder_head.weight": torch.tensor([[3.0, 4.0]]),
        "codebook.weight": torch.tensor([1.0, 2.0, 2.0]),
        "latent_projection.bias": torch.tensor([0.0]),
        "decoder.layer.weight": torch.tensor([5.0, 12.0]),
        "usage": torch.tensor([7], dtype=torch.int64),  # not floating point: left out
    }
    assert stability.parameter_norms(state) == {"encoder": 5.0, "latent": 3.0, "decoder": 13.0}
    assert stability.norm_jump({"latent": 100.0}, {"latent": 0.5}) is None  # 100 x max(1, 0.5)
    assert "latent 301 against 3 before" in stability.norm_jump({"latent": 301.0}, {"latent": 3.0})


# ------------------------------------------------------------------------------------------------
# 4. options accepted and ignored or misread


@pytest.mark.parametrize("flags", [["--codes", "0"], ["--slot", "0"], ["--all-combinations"]])
def test_generate_on_a_continuous_checkpoint_refuses_code_options(tiny_run, no_model, capsys, flags):
    err = fails(["generate", str(tiny_run), "--prompt", "hi", "--max-new-tokens", "2", *flags], capsys)
    assert f"{flags[0]}: an option of a discrete model (codes); this checkpoint is continuous" in err


def test_generate_refuses_code_options_on_a_loaded_continuous_model_too(tiny_run, loader):
    from disentanglement.generation import generate
    from disentanglement.runs import load_checkpoint

    model, tokenizer, config, *_ = load_checkpoint(tiny_run, device="cpu")
    with pytest.raises(ValueError, match="--slot, --all-combinations: options of a discrete model"):
        generate(model, tokenizer, config, ["hi"], slot=0, all_combinations=True)


def test_a_posterior_of_another_codebook_size_is_refused():
    from types import SimpleNamespace

    from disentanglement.latent_file import code_examples
    from disentanglement.latent_space import DiscreteLatentSpace

    model = SimpleNamespace(is_discrete=True, num_slots=1, codebook_size=4)
    model.latent_space = DiscreteLatentSpace(model)
    rows = [{"codes": [1], "posterior": [[0.5, 0.5]], "response": "a"}]
    with pytest.raises(ValueError, match=r"row 0: 'posterior' of slot 0 must have 4 probabilities .* got 2 entries"):
        code_examples(model, rows, 0, 1, 1)
    with pytest.raises(ValueError, match=r"row 0: 'posterior' must be 1 list\(s\) of 4 probabilities"):
        code_examples(model, [{"codes": [1], "posterior": [[0.5] * 4, [0.5] * 4]}], 0, 1, 1)
    with pytest.raises(ValueError, match=r"holds 1.5; expected probabilities in \[0, 1\]"):
        code_examples(model, [{"codes": [1], "posterior": [[0, 1.5, 0, 0]]}], 0, 1, 1)
    good = code_examples(model, [{"codes": [1], "posterior": [[0.1, 0.7, 0.1, 0.1]], "response": "a"}], 0, 1, 1)
    assert good["examples"][0]["probability"] == 0.7


def test_integer_and_string_labels_that_would_merge_are_refused(tmp_path):
    from disentanglement.data import DataError, load_jsonl

    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "p", "response": "r", "label": 1}\n{"prompt": "p", "response": "r", "label": "1"}\n'
        '{"prompt": "p", "response": "r", "label": 2}\n{"prompt": "p", "response": "r", "label": "b"}\n'
    )
    with pytest.raises(
        DataError, match=r"d\.jsonl:2: key 'label' is '1' \(a string\) but line 1 gives 1 \(an integer\)"
    ):
        load_jsonl(path)
    factors = tmp_path / "f.jsonl"
    factors.write_text(
        '{"prompt": "p", "response": "r", "label": {"s": "3", "t": 1}}\n{"prompt": "p", "response": "r", "label": {"s": 3, "t": 1}}\n'
    )
    with pytest.raises(
        DataError, match=r"f\.jsonl:2: factor 's' is 3 \(an integer\) but line 1 gives '3' \(a string\)"
    ):
        load_jsonl(factors)
    # integers and strings that differ as text stay allowed (and read as text, as documented)
    path.write_text('{"prompt": "p", "response": "r", "label": 1}\n{"prompt": "p", "response": "r", "label": "b"}\n')
    assert [p.label for p in load_jsonl(path)] == ["1", "b"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1_0", "1_0"), ("1:30", "1:30"), ("017", 17), ("0o17", 15), ("0x1f", 31), ("1e-3", 0.001), ("2", 2), (".5", 0.5)],
)
def test_config_numbers_are_read_as_in_yaml_1_2(tmp_path, text, expected):
    from disentanglement.config import read_config_file
    from disentanglement.sweep import parse_value

    path = tmp_path / "c.yaml"
    path.write_text(f"max_steps: {text}\n")
    value = read_config_file(path)["max_steps"]
    assert value == expected and type(value) is type(expected)
    assert parse_value(text) == expected and type(parse_value(text)) is type(expected)


def test_yaml_1_0_is_refused_not_read_as_ten(tmp_path, capsys, no_model):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 1_0\n")
    err = fails(["train", "--config", str(path), "--output-dir", str(tmp_path / "run")], capsys)
    assert "TrainConfig.max_steps must be an integer, got '1_0' (str)" in err


# ------------------------------------------------------------------------------------------------
# 6. sweeps cannot fake an interval


def sweep_fails(argv: list[str], capsys) -> str:
    return fails(["sweep", *argv], capsys)


@pytest.fixture
def sweep_data(tmp_path) -> Path:
    return write_data(tmp_path / "d.jsonl")


def test_sweep_refuses_repeated_seeds(tmp_path, capsys, no_model):
    err = sweep_fails(["--output-dir", str(tmp_path / "s"), "--seeds", "0,0"], capsys)
    assert "--seeds repeats 0: a seed is one run" in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("sets", [["--set", "beta=0.5"], ["--set", "beta=0.5,0.7"]])
def test_sweep_refuses_a_cell_and_a_set_of_the_same_field(tmp_path, capsys, no_model, sets):
    err = sweep_fails(["--output-dir", str(tmp_path / "s"), "--cell", "a beta=0.1", *sets], capsys)
    assert f"--cell 'a' sets beta=0.1 and --set beta={sets[1].split('=')[1]} sets it too" in err


def test_sweep_checks_eval_options_before_training(tmp_path, capsys, no_model, sweep_data, monkeypatch):
    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("nothing may train"))
    base = ["--output-dir", str(tmp_path / "s"), "--seeds", "0", "--set", f"data={sweep_data}"]
    err = sweep_fails([*base, "--eval-data", str(tmp_path / "missing.jsonl")], capsys)
    assert (
        f"sweep: --eval-data {tmp_path / 'missing.jsonl'}: data file {tmp_path / 'missing.jsonl'} does not exist" in err
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p"}\n')
    err = sweep_fails([*base, "--eval-data", str(bad)], capsys)
    assert f"sweep: --eval-data {bad}: 1 invalid line(s)" in err
    err = sweep_fails([*base, "--eval-max-examples", "0"], capsys)
    assert "sweep: --eval-max-examples must be an integer >= 1, got 0" in err


def test_sweep_output_dir_that_is_a_file(tmp_path, capsys, no_model):
    out = tmp_path / "file"
    out.write_text("x")
    err = sweep_fails(["--output-dir", str(out), "--seeds", "0"], capsys)
    assert f"sweep: --output-dir {out} is a file, not a directory" in err


def test_sweep_empty_cell(tmp_path, capsys, no_model):
    err = sweep_fails(["--output-dir", str(tmp_path / "s"), "--cell", ""], capsys)
    assert "sweep: --cell '' is empty: expected NAME FIELD=VALUE" in err


@pytest.mark.parametrize(
    ("field", "hint"),
    [("output_dir", "--output-dir"), ("seed", "--seeds"), ("resume", "resumes an unfinished run by itself")],
)
def test_sweep_reserved_field_refusal_suggests_the_right_flag(tmp_path, capsys, no_model, field, hint):
    err = sweep_fails(["--output-dir", str(tmp_path / "s"), "--set", f"{field}=x"], capsys)
    assert f"sweep: '{field}' is set by the sweep itself (" in err and hint in err
    if field != "seed":
        assert "--seeds" not in err


# ------------------------------------------------------------------------------------------------
# 7. clear messages, and every numeric option range-checked before the model loads


@pytest.fixture
def weightless_run(tmp_path) -> Path:
    """A run directory with one checkpoint that has a trainer state and a config, and no weights."""
    from disentanglement.config import build_config, write_run_config

    data = write_data(tmp_path / "train.jsonl")
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 1, "zfree_reference_scale": 1.0}))
    write_run_config(build_config({"data": str(data), "output_dir": str(tmp_path)}), checkpoint / "config.yaml")
    return tmp_path / "run"


def _numeric_cases():
    from disentanglement.config import field_flag
    from disentanglement.options import SUBCOMMAND_OPTIONS, numeric_fields, option_range

    for command, cls in SUBCOMMAND_OPTIONS.items():
        for f in numeric_fields(cls):
            bound = option_range(f)
            if bound is None:  # a numeric option without a range: the test below fails on it
                yield pytest.param(command, field_flag(f), None, id=f"{command}-{f.name}-unchecked")
                continue
            bad = bound.low - 1 if not bound.low_open else bound.low
            yield pytest.param(command, field_flag(f), bad, id=f"{command}-{f.name}")
            if bound.high is not None:
                yield pytest.param(command, field_flag(f), bound.high + 0.5, id=f"{command}-{f.name}-high")


@pytest.mark.parametrize(("command", "flag", "bad"), list(_numeric_cases()))
def test_every_numeric_option_is_range_checked_before_the_model_loads(
    weightless_run, tmp_path, capsys, no_model, command, flag, bad
):
    assert bad is not None, f"{command} {flag} has no range (options.ranged)"
    value = str(int(bad)) if float(bad).is_integer() else str(bad)
    extra = {
        "generate": ["--prompt", "hi"],
        "encode": ["--output", str(tmp_path / "x.jsonl")],
        "refit-encoder": ["--output-dir", str(tmp_path / "refit")],
    }.get(command, [])
    if flag.startswith("--explore") or flag == "--clusters":
        extra = ["--explore"]
    err = fails([command, str(weightless_run), *extra, f"{flag}={value}"], capsys)
    assert f"{flag} must be " in err and f"got {bad!r}" in err.replace(f"got {float(bad)!r}", f"got {bad!r}")


def test_generate_batch_size_zero_is_a_clear_error(weightless_run, capsys, no_model):
    err = fails(["generate", str(weightless_run), "--prompt", "hi", "--batch-size", "0"], capsys)
    assert "--batch-size must be an integer >= 1, got 0" in err and "range()" not in err


def test_invalid_control_character_message_reads_once(tmp_path):
    from disentanglement.data import DataError, load_jsonl

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a\tb", "response": "r"}\n')
    with pytest.raises(DataError) as error:
        load_jsonl(path)
    assert "invalid JSON (Invalid control character at column 14)" in str(error.value)
    assert "at at" not in str(error.value)


def test_row_needs_latents_reads_well():
    from types import SimpleNamespace

    from disentanglement.generation import _check_steering
    from disentanglement.latent_space import ContinuousLatentSpace

    model = SimpleNamespace(latent_vector_dim=4)
    with pytest.raises(ValueError, match=r"^--row needs --latents FILE"):
        _check_steering(model, ContinuousLatentSpace(model), "row", None, 0, [], None, None, 0)
