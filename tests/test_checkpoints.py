"""Trustworthy runs: pickle-free checkpoints, bit-identical resume in every mode, one run per directory,
changed flags on resume, non-finite and exploding training, corrupt files, durable writes."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from disentanglement import checkpoints, cli, feature_store
from disentanglement.checkpoints import CheckpointError, complete_checkpoints, latest_checkpoint, read_resumable
from disentanglement.config import ConfigError
from disentanglement.stability import LossMonitor
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.trainer import TrainingDiverged, load_trained, train
from helpers import Stop, stop_at, tiny_llama, tiny_tokenizer, trainer_config

TESTS = Path(__file__).parent
PROMPTS = [f"tell me about topic {i}" for i in range(40)]


def pairs():
    return make_hidden_factor_pairs(PROMPTS, kind="clean", seed=0)


config_for = trainer_config


def run(output_dir, callbacks=(), **overrides):
    tokenizer = tiny_tokenizer()
    return train(config_for(output_dir, **overrides), (tiny_llama(len(tokenizer)), tokenizer), pairs(), callbacks)


def metrics(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path, model_a, model_b):
    """Bit-identical: every logged number of every step, and every trainable tensor."""
    assert metrics(a) == metrics(b)
    wa, wb = model_a.trainable_state_dict(), model_b.trainable_state_dict()
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def rewrite(checkpoint: Path, name: str, data: bytes, update_checksum: bool) -> None:
    """Replace a checkpoint file; with ``update_checksum`` as a forger would (the recorded SHA-256 too)."""
    (checkpoint / name).write_bytes(data)
    if update_checksum:
        state_path = checkpoint / "trainer_state.json"
        state = json.loads(state_path.read_text())
        state["files"][name] = hashlib.sha256(data).hexdigest()
        state_path.write_text(json.dumps(state))


# ------------------------------------------------------------------------------------------------
# 1. no code from a checkpoint


class Payload:
    """Unpickling this writes a file: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.write_text, (pathlib.Path(self.marker), "code ran"))


def pickle_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_payload_really_runs_when_unpickled(tmp_path):
    # The attack is real: loading the planted file the old way runs it.
    marker = tmp_path / "marker"
    path = tmp_path / "optimizer.pt"
    path.write_bytes(pickle_bytes({"state": {}, "param_groups": Payload(marker)}))
    torch.load(path, weights_only=False)
    assert marker.read_text() == "code ran"


def test_a_planted_pickle_never_runs_and_is_never_accepted(tmp_path, caplog):
    run_dir = tmp_path / "run"
    straight = run(tmp_path / "straight")
    run(run_dir)
    marker = tmp_path / "marker"
    newest, previous = complete_checkpoints(run_dir)[-1], complete_checkpoints(run_dir)[-2]
    rewrite(newest, "optimizer.pt", pickle_bytes({"state": {}, "param_groups": Payload(marker)}), True)
    with caplog.at_level(logging.WARNING, logger="disentanglement.checkpoints"):
        resumed = read_resumable(run_dir)
    assert resumed.path == previous and not marker.exists()
    assert "optimizer.pt: not a plain optimizer state, refused" in caplog.text
    # Resuming falls back to the previous checkpoint and ends where the uninterrupted run ends.
    result = run(run_dir, resume="auto")
    assert not marker.exists()
    assert_same_run(tmp_path / "straight", run_dir, straight.model, result.model)
    # Planted in every checkpoint: refused, nothing runs.
    for checkpoint in complete_checkpoints(run_dir):
        rewrite(checkpoint, "optimizer.pt", pickle_bytes({"state": {}, "param_groups": Payload(marker)}), True)
    with pytest.raises(CheckpointError, match="no checkpoint of .* can be resumed"):
        run(run_dir, resume="auto")
    with pytest.raises(CheckpointError, match="not a plain optimizer state"):
        run(tmp_path / "other", resume=str(latest_checkpoint(run_dir)))
    assert not marker.exists()


def test_old_format_pickles_are_never_loaded(tmp_path):
    run(tmp_path, max_steps=3)
    checkpoint = latest_checkpoint(tmp_path)
    marker = tmp_path / "marker"
    for name in ("rng.pt", "scheduler.pt"):
        (checkpoint / name).write_bytes(pickle_bytes(Payload(marker)))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["format"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="older version .* never loaded"):
        run(tmp_path / "other", resume=str(checkpoint), max_steps=3)
    model, *_ = load_trained(checkpoint, (tiny_llama(len(tiny_tokenizer())), tiny_tokenizer()))  # evaluable
    assert not marker.exists()


def test_no_source_file_unpickles():
    for path in (TESTS.parent / "src" / "disentanglement").glob("*.py"):
        text = path.read_text()
        assert "weights_only=False" not in text and "import pickle" not in text, path
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path}: {line.strip()}"


def test_rng_state_round_trips_without_pickle(tmp_path):
    import random

    import numpy as np

    random.random(), np.random.rand(), torch.rand(1)  # noqa: NPY002
    state = checkpoints.rng_state()
    data = checkpoints.rng_state_to_safetensors(state)
    path = tmp_path / "rng.safetensors"
    path.write_bytes(data)
    back = checkpoints.rng_state_from_safetensors(path)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))  # noqa: NPY002
    checkpoints.set_rng_state(back)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected  # noqa: NPY002


# ------------------------------------------------------------------------------------------------
# 2. bit-identical resume in every mode

RESUME_MODES = {
    "discrete, cache, refreshes after the stop": dict(codebook_refresh_every=2, max_steps=8),
    "discrete, no cache, refreshes after the stop": dict(codebook_refresh_every=2, max_steps=8, feature_cache=False),
    "discrete, no cache, c_base given": dict(
        codebook_refresh_every=2, max_steps=8, feature_cache=False, zfree_reference_scale=4.0
    ),
    "discrete, divergence, dead codes, accumulation": dict(
        divergence_weight=0.1, dead_code_steps=2, gradient_accumulation_steps=2
    ),
    "discrete, gumbel, no cache": dict(assignment="gumbel", feature_cache=False),
    "discrete, gumbel, cache, accumulation": dict(assignment="gumbel", gradient_accumulation_steps=2),
    "discrete, batches grouped by length, past an epoch": dict(group_by_length=True, max_steps=12),
    "continuous, cache": dict(latent="continuous"),
    "continuous, no cache, accumulation": dict(latent="continuous", feature_cache=False, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("mode", RESUME_MODES.values(), ids=RESUME_MODES.keys())
def test_resume_is_bit_identical(tmp_path, mode):
    straight = run(tmp_path / "straight", **mode)
    if mode.get("group_by_length"):  # the order the run trained on is the grouped one, and the checkpoint says so
        state = json.loads((latest_checkpoint(tmp_path / "straight") / "trainer_state.json").read_text())
        assert state["data_order"]["batch"] == config_for(tmp_path, **mode).train.batch_size
    with pytest.raises(Stop):
        run(tmp_path / "resumed", callbacks=[stop_at(3)], **mode)
    resumed = run(tmp_path / "resumed", resume="auto", **mode)
    assert resumed.final_step == straight.final_step
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", straight.model, resumed.model)


def _child_run(output_dir: str, kill_point: str) -> None:
    """Run in a child process: train and SIGKILL itself at ``kill_point`` of the step-6 save."""
    real_write, real_prune = checkpoints.write_durably, checkpoints.prune_checkpoints

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    def write(path, data):
        if ".tmp-step-000006" in str(path) and path.name == kill_point:
            if kill_point == "model.safetensors":  # half of the file is on disk
                path.write_bytes(data[: len(data) // 2])
            kill()
        return real_write(path, data)

    def prune(output_dir, keep, protect=None):
        if kill_point == "prune" and protect is not None and protect.name == "step-000006":
            kill()
        return real_prune(output_dir, keep, protect)

    checkpoints.write_durably = write
    checkpoints.prune_checkpoints = prune
    import disentanglement.trainer as trainer

    trainer.prune_checkpoints = prune
    callbacks = [lambda step, record: kill() if step == 5 else None] if kill_point == "after step 5" else []
    run(output_dir, callbacks=callbacks, max_steps=9)


@pytest.mark.parametrize("kill_point", ["model.safetensors", "trainer_state.json", "prune", "after step 5"])
def test_sigkill_then_resume_is_bit_identical(tmp_path, kill_point):
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_checkpoints as t; t._child_run(sys.argv[1], sys.argv[2])"
    child = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "killed"), kill_point], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    expected_latest = "step-000006" if kill_point == "prune" else "step-000003"
    assert latest_checkpoint(tmp_path / "killed").name == expected_latest
    resumed = run(tmp_path / "killed", resume="auto", max_steps=9)
    straight = run(tmp_path / "straight", max_steps=9)
    assert_same_run(tmp_path / "straight", tmp_path / "killed", straight.model, resumed.model)
    assert not any(p.name.startswith(".") for p in (tmp_path / "killed" / "checkpoints").iterdir())


# ------------------------------------------------------------------------------------------------
# 3. one run per directory


def test_a_run_directory_is_never_reused_silently(tmp_path):
    run(tmp_path, max_steps=3)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="already holds .*--resume auto.*--overwrite"):
        run(tmp_path, max_steps=3, beta=0.5)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    result = run(tmp_path, max_steps=2, beta=0.5, overwrite=True, save_every=1)
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000001", "step-000002"]
    assert json.loads((latest_checkpoint(tmp_path) / "trainer_state.json").read_text())["step"] == 2
    # The frozen pass is kept (in the shared store, outside the run): the replacing run does not run it again.
    assert result.model is not None and feature_store.last_stats.computed == 0
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a run's \\(notes.txt\\)"):
        run(tmp_path, max_steps=2, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "metrics.jsonl").exists()


def test_output_dir_problems_are_found_before_the_model_loads(tmp_path, monkeypatch):
    import tempfile

    import disentanglement.trainer as trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(trainer, "build_cvae", no_model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        run(tmp_path / "file")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(ConfigError, match="is not writable \\(Read-only file system\\)"):
        run(tmp_path / "ro")


# ------------------------------------------------------------------------------------------------
# 4. changed flags on resume


def test_changed_fields_on_resume_are_refused_or_applied(tmp_path):
    with pytest.raises(Stop):
        run(tmp_path / "run", callbacks=[stop_at(3)])
    for change, name in (
        (dict(token_weight_alpha=2.0), "token_weight_alpha"),
        (dict(max_steps=9), "max_steps"),
        (dict(latent="continuous"), "latent"),
        (dict(seed=5, beta=0.5), "beta, seed"),
    ):
        with pytest.raises(ConfigError, match=f"cannot resume .* with a changed {name} "):
            run(tmp_path / "run", resume="auto", **change)
    # Learning rates are applied from the resumed step on: the schedule continues with the new base.
    # A moved data file is no change (the frozen pass's fingerprint checks the content).
    run(tmp_path / "run", resume="auto", latent_lr=1e-3, encoder_lr=2e-3, eval_every=1, data="moved/pairs.jsonl")
    fresh = run(tmp_path / "fresh", latent_lr=1e-3, encoder_lr=2e-3)
    resumed_records, fresh_records = metrics(tmp_path / "run"), metrics(tmp_path / "fresh")
    for step in (4, 5, 6):
        a, b = resumed_records[step - 1], fresh_records[step - 1]
        assert a["lr_latent"] == b["lr_latent"] and a["lr_encoder"] == b["lr_encoder"], step
    assert resumed_records[0]["lr_latent"] != fresh_records[0]["lr_latent"]
    assert fresh.final_step == 6


def test_resume_from_the_command_line_continues_the_stored_config(tmp_path):
    with pytest.raises(Stop):
        run(tmp_path, callbacks=[stop_at(3)], beta=0.3, latent_tokens=2)
    parser = cli.build_parser()
    config = cli._train_config(parser.parse_args(["train", "--resume", "auto", "--output-dir", str(tmp_path)]))
    stored = config_for(tmp_path, beta=0.3, latent_tokens=2)
    assert config.kl.beta == 0.3 and config.latent.latent_tokens == 2 and config.train.resume == "auto"
    assert config.to_dict()["latent"] == stored.to_dict()["latent"]
    changed = cli._train_config(
        parser.parse_args(["train", "--resume", "auto", "--output-dir", str(tmp_path), "--beta", "1"])
    )
    assert changed.kl.beta == 1.0  # and train() refuses it, naming beta (test above)


# ------------------------------------------------------------------------------------------------
# 5. non-finite and exploding training


def test_nonfinite_weights_never_reach_a_checkpoint(tmp_path):
    with pytest.raises(TrainingDiverged) as raised:
        run(tmp_path, latent_lr=3e38, save_every=1, max_steps=12)
    message = str(raised.value)
    good = latest_checkpoint(tmp_path)
    assert good is not None and f"the last good checkpoint is {good}" in message
    assert "codebook" in message
    for checkpoint in complete_checkpoints(tmp_path):
        for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
            assert torch.isfinite(tensor).all(), (checkpoint, name)
    assert not any(p.name.startswith(".") for p in (tmp_path / "checkpoints").iterdir())


def test_an_exploding_loss_stops_with_a_diagnostic(tmp_path):
    exploding = dict(latent_lr=1e4, encoder_lr=1e4, max_grad_norm=1e30, warmup_steps=0, save_every=1, max_steps=12)
    with pytest.raises(
        TrainingDiverged, match="the loss .* is more than 100 x max\\(the lowest running median"
    ) as raised:
        run(tmp_path / "on", **exploding)
    assert "largest terms: codebook_loss" in str(raised.value)
    # lr 1e4 blows the weights up in the first step: that checkpoint is finite but suspect, never "good"
    # (was: "the last good checkpoint is <the latest>", before checkpoints recorded their parameter norms)
    assert f"the last checkpoint {latest_checkpoint(tmp_path / 'on')} is suspect (parameter norms jumped" in str(
        raised.value
    )
    assert "the last good checkpoint is none (every checkpoint is suspect: start a new run)" in str(raised.value)
    result = run(tmp_path / "off", max_loss_ratio=0.0, **exploding)  # the check can be switched off
    assert max(r["loss"] for r in metrics(tmp_path / "off")) > 1e10 and result.final_step == 12


def test_loss_monitor_thresholds():
    monitor = LossMonitor(ratio=10.0, c_base=2.0)
    assert monitor.check({"loss": 5.0, "reconstruction_loss": 19.9}) is None  # 19.9 <= 10 x max(2, 1)
    assert "reconstruction loss 20.1" in monitor.check({"loss": 5.0, "reconstruction_loss": 20.1})
    assert monitor.strikes == 1
    for loss in (3.0, 5.0, 4.0):
        assert monitor.check({"loss": loss, "reconstruction_loss": 1.0}) is None
    assert monitor.strikes == 0
    # losses 5, 5, 3, 5, 4: the lowest running median is 5 -> threshold 50 (c_base 2 is smaller)
    assert monitor.best_median == 5.0
    assert monitor.check({"loss": 49.0, "reconstruction_loss": 1.0}) is None
    assert "lowest running median" in monitor.check({"loss": -51.0, "reconstruction_loss": 1.0})
    # A small c_base is floored at 1 nat/token.
    small = LossMonitor(ratio=10.0, c_base=0.01)
    assert small.check({"loss": 5.0, "reconstruction_loss": 9.9}) is None
    assert small.check({"loss": 0.01, "reconstruction_loss": 0.01}) is None
    assert small.check({"loss": 9.0, "reconstruction_loss": 0.01}) is None  # the floor is 1, not 0.01
    assert LossMonitor(ratio=0.0, c_base=2.0).check({"loss": 1e30, "reconstruction_loss": 1e30}) is None


def test_a_slow_blow_up_is_caught_and_a_long_example_is_not_a_divergence():
    monitor, loss, steps = LossMonitor(ratio=100.0, c_base=3.0), 5.0, 0
    while monitor.strikes < 3:  # 15% a step: the lowest median stays put, so it is caught near 100 x
        monitor.check({"loss": loss, "reconstruction_loss": 3.0})
        loss, steps = loss * 1.15, steps + 1
    assert loss < 1e4 and steps < 50
    # One step whose sequence-summed loss is 150 x the usual (a long response) is one strike, not a stop.
    spiky = LossMonitor(ratio=100.0, c_base=3.0)
    for i in range(60):
        spiky.check({"loss": 2000.0 if i == 30 else 13.0, "reconstruction_loss": 3.0})
        assert spiky.strikes <= 1
    state = spiky.state()
    restored = LossMonitor(ratio=100.0, c_base=3.0)
    restored.load(json.loads(json.dumps(state)))
    assert restored.state() == state


# ------------------------------------------------------------------------------------------------
# 8. corrupt files: one row per case (file, how it is damaged, the message expected)

CORRUPTIONS = [
    pytest.param("model.safetensors", lambda b: b[: len(b) // 2], "model.safetensors: corrupt", id="weights-truncated"),
    pytest.param("optimizer.pt", lambda b: b"\x00" * 64, "optimizer.pt: corrupt", id="optimizer-zeroed"),
    pytest.param("scheduler.json", lambda b: b"{", "scheduler.json: corrupt", id="scheduler-cut"),
    pytest.param("rng.safetensors", lambda b: b[:10], "rng.safetensors: corrupt", id="rng-cut"),
    pytest.param("config.yaml", lambda b: b + b"\nbogus: 1\n", "config.yaml: corrupt", id="config-edited"),
    pytest.param("trainer_state.json", lambda b: b[:20], "trainer_state.json: unreadable or corrupt", id="state-cut"),
    pytest.param(
        "trainer_state.json", lambda b: b'{"step": 6}', "trainer_state.json: corrupt (expected", id="state-keys"
    ),
    pytest.param(
        "trainer_state.json", lambda b: b.replace(b'"step": 6', b'"step": "six"'), "'step' must be", id="state-step"
    ),
]


def _state_edit(**changes):
    """Damage trainer_state.json by setting fields (dotted for nested ones); the result stays JSON."""

    def damage(data: bytes) -> bytes:
        state = json.loads(data)
        for key, value in changes.items():
            *parents, last = key.split(".")
            target = state
            for parent in parents:
                target = target[parent]
            target[last] = value
        return json.dumps(state).encode()

    return damage


# trainer_state.json with values of the wrong type or range: each refused, named, and resume falls back.
for _id, _changes, _fragment in (
    ("c-base-null", {"zfree_reference_scale": None}, "'zfree_reference_scale' must be a finite number > 0"),
    ("c-base-negative", {"zfree_reference_scale": -1.0}, "'zfree_reference_scale' must be a finite number > 0"),
    ("epoch-string", {"data_order.epoch": "0"}, "'data_order' must be"),
    ("position-float", {"data_order.position": 1.5}, "'data_order' must be"),
    ("epoch-negative", {"data_order.epoch": -1}, "'data_order' must be"),
    ("batch-negative", {"data_order.batch": -1}, "'data_order' must be"),
    ("batch-string", {"data_order.batch": "8"}, "'data_order' must be"),
    ("order-unknown-key", {"data_order.shuffle": 1}, "'data_order' must be"),
    ("files-list", {"files": []}, "'files' must map file names to SHA-256"),
    ("step-not-the-directory", {"step": 10**12}, "'step' is 1000000000000 but the directory is step-000006"),
    ("format-other", {"format": "zzz"}, "'format' 'zzz' is not this version's"),
    ("monitor-string", {"loss_monitor.history": ["x"]}, "'loss_monitor' must hold finite numbers"),
    ("nonfinite-negative", {"nonfinite_steps": -1}, "'nonfinite_steps' must be a non-negative integer"),
):
    CORRUPTIONS.append(pytest.param("trainer_state.json", _state_edit(**_changes), _fragment, id=_id))
CORRUPTIONS += [
    pytest.param(
        "trainer_state.json",
        lambda b: b.replace(b'"zfree_reference_scale": ', b'"zfree_reference_scale": NaN, "x": '),
        "non-finite number NaN",
        id="c-base-nan",
    ),
    pytest.param(
        "trainer_state.json",
        lambda b: b.replace(b'"step": 6,', b'"step": 6, "step": 6,'),
        "duplicate key 'step'",
        id="duplicate-key",
    ),
]
# Without a recorded checksum (a file forged consistently, or an older checkpoint), parsing catches it.
FORGED = [
    pytest.param("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "not a valid safetensors", id="weights"),
    pytest.param("optimizer.pt", b"not a zip", "not a plain optimizer state", id="optimizer"),
    pytest.param("scheduler.json", b"[1", "scheduler.json: corrupt", id="scheduler"),
    pytest.param("rng.safetensors", b"\x00" * 16, "rng.safetensors: corrupt", id="rng"),
    pytest.param("config.yaml", b"latent: [", "config.yaml: not a valid config", id="config"),
    pytest.param("scheduler.json", b'{"a": NaN}', "non-finite number NaN", id="scheduler-nan"),
]
RESUME_ONLY = {"optimizer.pt", "scheduler.json", "rng.safetensors"}  # evaluation does not read these


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    run(root)
    return root


def _copy_run(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize("name, damage, fragment", CORRUPTIONS)
def test_a_corrupt_checkpoint_file_is_named_and_resume_falls_back(
    tmp_path, finished_run, name, damage, fragment, caplog
):
    run_dir = _copy_run(finished_run, tmp_path / "run")
    newest = run_dir / "checkpoints" / "step-000006"
    path = newest / name
    path.write_bytes(damage(path.read_bytes()))
    if name not in RESUME_ONLY:
        with pytest.raises(CheckpointError, match="^" + re.escape(str(path))) as raised:
            load_trained(newest, (tiny_llama(len(tiny_tokenizer())), tiny_tokenizer()))
        assert fragment in str(raised.value)
    with caplog.at_level(logging.WARNING, logger="disentanglement.checkpoints"):
        contents = read_resumable(run_dir)
    assert contents.path.name == "step-000003"
    assert fragment in caplog.text and "trying the previous complete checkpoint" in caplog.text


@pytest.mark.parametrize("name, data, fragment", FORGED)
def test_a_forged_checkpoint_file_is_refused_by_its_parser(tmp_path, finished_run, name, data, fragment):
    run_dir = _copy_run(finished_run, tmp_path / "run")
    newest = run_dir / "checkpoints" / "step-000006"
    rewrite(newest, name, data, update_checksum=True)
    with pytest.raises(CheckpointError, match=re.escape(fragment)):
        checkpoints.read_checkpoint(newest, for_resume=True)


def test_resume_auto_after_corruption_still_matches_the_uninterrupted_run(tmp_path, finished_run):
    run_dir = _copy_run(finished_run, tmp_path / "run")
    weights = run_dir / "checkpoints" / "step-000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    resumed = run(run_dir, resume="auto")
    straight = run(tmp_path / "straight")
    assert_same_run(tmp_path / "straight", run_dir, straight.model, resumed.model)


def test_metrics_with_a_partial_last_line_resume_cleanly(tmp_path, caplog):
    with pytest.raises(Stop):
        run(tmp_path / "run", callbacks=[stop_at(3)])
    with (tmp_path / "run" / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "lo')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        resumed = run(tmp_path / "run", resume="auto")
    assert "dropped a partial last line" in caplog.text
    straight = run(tmp_path / "straight")
    assert_same_run(tmp_path / "straight", tmp_path / "run", straight.model, resumed.model)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    lines[1] = "garbage"
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a metrics record"):
        run(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoints" / "step-000003"), overwrite=True)


# ------------------------------------------------------------------------------------------------
# 7. reading a checkpoint writes nothing outside the run and the user's cache


def test_a_checkpoint_config_cannot_redirect_the_model_cache(tmp_path, finished_run, monkeypatch):
    import yaml

    import disentanglement.lm as lm

    run_dir = _copy_run(finished_run, tmp_path / "run")
    checkpoint = latest_checkpoint(run_dir)
    stored = yaml.safe_load((checkpoint / "config.yaml").read_text())
    stored["model"]["model_cache_dir"] = str(tmp_path / "elsewhere")
    stored["train"]["feature_cache_dir"] = str(tmp_path / "elsewhere-too")
    rewrite(checkpoint, "config.yaml", yaml.safe_dump(stored).encode(), update_checksum=True)
    seen = {}

    def fake_load(cfg, device="cpu", dtype=None):
        seen["cfg"] = cfg
        tokenizer = tiny_tokenizer()
        return tiny_llama(len(tokenizer)), tokenizer

    monkeypatch.setattr(lm, "load_model_and_tokenizer", fake_load)
    model, tokenizer, config, state = load_trained(checkpoint)
    assert seen["cfg"].model_cache_dir is None and config.model.model_cache_dir is None
    assert config.train.feature_cache_dir is None
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "elsewhere-too").exists()


# ------------------------------------------------------------------------------------------------
# 10. durable writes


def test_every_checkpoint_file_and_directory_is_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(checkpoints.os, "fsync", recording_fsync)
    run(tmp_path, max_steps=3)
    checkpoint = latest_checkpoint(tmp_path)
    tmp = str(checkpoint.parent / f".tmp-{checkpoint.name}")
    for file in checkpoint.iterdir():
        assert f"{tmp}/{file.name}" in synced, file.name
    assert tmp in synced and str(checkpoint.parent) in synced  # the directory, before and after the rename
    assert synced.index(f"{tmp}/trainer_state.json") > max(
        synced.index(f"{tmp}/{f.name}") for f in checkpoint.iterdir() if f.name != "trainer_state.json"
    )


# ------------------------------------------------------------------------------------------------
# the command line: one line and an exit code for each failure


@pytest.fixture
def cli_train(tmp_path, monkeypatch):
    import disentanglement.lm as lm

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt, "response": p.response}) + "\n" for p in pairs()))

    def fake_load(cfg, device="cpu", dtype=None):
        tokenizer = tiny_tokenizer()
        return tiny_llama(len(tokenizer)), tokenizer

    monkeypatch.setattr(lm, "load_model_and_tokenizer", fake_load)
    common = ["--data", str(data), "--no-chat-template", "--no-progress", "--batch-size", "4", "--warmup-steps", "0"]

    def call(*flags):
        return cli.main(["train", *common, *flags])

    return call


def test_cli_exit_codes_and_one_line_messages(tmp_path, cli_train, capsys, monkeypatch):
    out = tmp_path / "diverges"
    assert cli_train("--output-dir", str(out), "--latent-lr", "3e38", "--max-steps", "4", "--save-every", "1") == 3
    err = capsys.readouterr().err
    assert err.startswith("disentangle train: error: training diverged at step") and err.count("\n") == 1

    real_write = checkpoints.write_durably

    def disk_full(path, data):
        if path.name == "optimizer.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, data)

    monkeypatch.setattr(checkpoints, "write_durably", disk_full)
    assert cli_train("--output-dir", str(tmp_path / "full"), "--max-steps", "2", "--save-every", "1") == 4
    err = capsys.readouterr().err
    assert "could not write checkpoint" in err and "No space left on device" in err and err.count("\n") == 1
    assert not any((tmp_path / "full" / "checkpoints").iterdir())
    monkeypatch.setattr(checkpoints, "write_durably", real_write)

    done = tmp_path / "done"
    assert cli_train("--output-dir", str(done), "--max-steps", "2", "--save-every", "1") == 0
    capsys.readouterr()
    assert cli_train("--output-dir", str(done), "--max-steps", "2") == 2
    assert "already holds" in capsys.readouterr().err
    assert cli_train("--output-dir", str(done), "--resume", "auto", "--max-steps", "3") == 2
    assert "with a changed max_steps (max_steps: 2 in the checkpoint, 3 now)" in capsys.readouterr().err
    for checkpoint in complete_checkpoints(done):
        (checkpoint / "trainer_state.json").write_text("{")
    assert cli_train("--output-dir", str(done), "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "no checkpoint of" in err and "trainer_state.json: unreadable or corrupt" in err


def _rng_bytes(**broken) -> bytes:
    state = checkpoints.rng_state()
    if "python_mt" in broken:
        version, mt, gauss = state["python"]
        state["python"] = (version, mt[:100], gauss)
    if "numpy_kind" in broken:
        state["numpy"] = ("XYZ", *state["numpy"][1:])
    if "torch_short" in broken:
        state["torch"] = state["torch"][:100]
    return checkpoints.rng_state_to_safetensors(state)


@pytest.mark.parametrize("broken", ["python_mt", "numpy_kind", "torch_short"])
def test_a_forged_rng_state_is_refused_before_it_is_applied(tmp_path, finished_run, broken, caplog):
    import random

    run_dir = _copy_run(finished_run, tmp_path / "run")
    rewrite(run_dir / "checkpoints" / "step-000006", "rng.safetensors", _rng_bytes(**{broken: True}), True)
    before = random.getstate()
    with caplog.at_level(logging.WARNING, logger="disentanglement.checkpoints"):
        assert read_resumable(run_dir).path.name == "step-000003"
    assert "rng.safetensors: corrupt" in caplog.text and random.getstate() == before


def _forged_optimizer(checkpoint: Path, edit) -> None:
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    edit(state)
    rewrite(checkpoint, "optimizer.pt", pickle_bytes(state), True)


OPTIMIZER_FORGERIES = {
    "exp_avg of the wrong shape": (
        lambda s: s["state"][0].update(exp_avg=torch.zeros(3)),
        "exp_avg is torch.float32 (3,)",
    ),
    "exp_avg_sq of another dtype": (
        lambda s: s["state"][0].update(exp_avg_sq=s["state"][0]["exp_avg_sq"].double()),
        "exp_avg_sq is torch.float64",
    ),
    "a missing group": (lambda s: s["param_groups"].pop(), "parameter groups"),
    "an unknown parameter": (lambda s: s["state"].update({999: s["state"][0]}), "unknown parameter 999"),
    "an extra state entry": (lambda s: s["state"][0].update(evil=torch.zeros(1)), "unexpected state"),
    "a non-finite moment": (
        lambda s: s["state"][0].update(exp_avg=torch.full_like(s["state"][0]["exp_avg"], float("nan"))),
        "exp_avg holds NaN or infinity",  # refused as the checkpoint is read (was: "exp_avg is not finite")
    ),
}


@pytest.mark.parametrize("forgery", OPTIMIZER_FORGERIES.values(), ids=OPTIMIZER_FORGERIES.keys())
def test_a_forged_optimizer_state_never_reaches_the_fused_kernel(tmp_path, finished_run, forgery):
    # A state of the wrong shape loads with weights_only=True and load_state_dict does not check it:
    # the fused AdamW step would then read and write out of bounds.
    edit, fragment = forgery
    run_dir = _copy_run(finished_run, tmp_path / "run")
    _forged_optimizer(run_dir / "checkpoints" / "step-000006", edit)
    with pytest.raises(CheckpointError, match=re.escape(fragment)):
        run(tmp_path / "branch", resume=str(run_dir / "checkpoints" / "step-000006"), max_steps=6)


def test_a_forged_scheduler_state_is_refused(tmp_path, finished_run):
    run_dir = _copy_run(finished_run, tmp_path / "run")
    checkpoint = run_dir / "checkpoints" / "step-000006"
    state = json.loads((checkpoint / "scheduler.json").read_text())
    state["optimizer"] = "x"  # load_state_dict would set any attribute it is given
    rewrite(checkpoint, "scheduler.json", json.dumps(state).encode(), True)
    with pytest.raises(CheckpointError, match="scheduler.json: corrupt \\(keys"):
        run(tmp_path / "branch", resume=str(checkpoint))


# ------------------------------------------------------------------------------------------------
# where a resumed run goes


def test_resume_path_never_mixes_two_runs(tmp_path, finished_run):
    source = _copy_run(finished_run, tmp_path / "source")
    other = tmp_path / "other"
    run(other, max_steps=3, seed=2)
    with pytest.raises(ConfigError, match="a checkpoint of the run in .*already holds another run"):
        run(other, resume=str(source / "checkpoints" / "step-000003"))
    # Into an empty directory: a branch, which continues exactly as the source would have.
    branch = run(tmp_path / "branch", resume=str(source / "checkpoints" / "step-000003"))
    straight = run(tmp_path / "straight")
    assert branch.final_step == 6 and metrics(tmp_path / "branch")[0]["step"] == 4
    for name, value in straight.model.trainable_state_dict().items():
        assert torch.equal(branch.model.trainable_state_dict()[name], value), name
    # From an older checkpoint of its own run: the later checkpoints are another branch's.
    with pytest.raises(ConfigError, match="the run has later checkpoints \\(step-000006\\); pass --overwrite"):
        run(source, resume=str(source / "checkpoints" / "step-000003"), latent_lr=1e-3)
    run(source, resume=str(source / "checkpoints" / "step-000003"), latent_lr=1e-3, overwrite=True, max_steps=6)
    assert [r["lr_latent"] for r in metrics(source)][3] != [r["lr_latent"] for r in metrics(tmp_path / "straight")][3]
    with pytest.raises(ConfigError, match="give one of them"):
        run(source, resume="auto", overwrite=True)
    # A run directory as --resume PATH means its newest checkpoint.
    assert run(tmp_path / "branch2", resume=str(source)).final_step == 6


def test_overwrite_keeps_the_old_run_until_the_new_one_can_start(tmp_path, finished_run, monkeypatch):
    import disentanglement.trainer as trainer

    run_dir = _copy_run(finished_run, tmp_path / "run")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    def fails(*args, **kwargs):
        raise RuntimeError("the model cannot be built (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "build_cvae", fails)
        with pytest.raises(RuntimeError, match="simulated"):
            run(run_dir, overwrite=True)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert (run_dir / "metrics.jsonl").is_file()
    (run_dir / ".config.yaml.tmp").write_text("left by a crash")
    run(run_dir, overwrite=True, max_steps=3)  # an interrupted write's leftover is a run artefact
    assert not (run_dir / ".config.yaml.tmp").exists()


def test_resume_refuses_other_data(tmp_path):
    with pytest.raises(Stop):
        run(tmp_path, callbacks=[stop_at(3)])
    tokenizer = tiny_tokenizer()
    fewer = pairs()[:-8]
    with pytest.raises(ConfigError, match="the data, the tokenizer or the frozen model differ"):
        train(config_for(tmp_path, resume="auto"), (tiny_llama(len(tokenizer)), tokenizer), fewer)
    with pytest.raises(ConfigError, match="the data, the tokenizer or the frozen model differ"):
        train(config_for(tmp_path, resume="auto"), (tiny_llama(len(tokenizer), seed=5), tokenizer), pairs())


def test_cli_resume_takes_where_to_write_from_the_command_line_never_the_checkpoint(tmp_path, finished_run):
    import yaml

    source = _copy_run(finished_run, tmp_path / "run")
    checkpoint = source / "checkpoints" / "step-000003"
    stored = yaml.safe_load((checkpoint / "config.yaml").read_text())
    stored["train"]["output_dir"] = str(tmp_path / "victim")
    stored["model"]["model_cache_dir"] = str(tmp_path / "victim-cache")
    rewrite(checkpoint, "config.yaml", yaml.safe_dump(stored).encode(), True)
    (source / "config.yaml").unlink()  # so the checkpoint's config is the one continued
    parser = cli.build_parser()
    config = cli._train_config(parser.parse_args(["train", "--resume", str(checkpoint)]))
    assert config.train.output_dir == str(source) and config.model.model_cache_dir is None
    config = cli._train_config(parser.parse_args(["train", "--resume", str(checkpoint), "--output-dir", "elsewhere"]))
    assert config.train.output_dir == "elsewhere"


def test_metrics_are_fsynced_with_each_checkpoint_and_gaps_are_reported(tmp_path, monkeypatch, caplog):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    with pytest.raises(Stop):
        run(tmp_path, callbacks=[stop_at(3)])
    assert str(tmp_path / "metrics.jsonl") in synced
    monkeypatch.setattr(os, "fsync", real_fsync)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join([lines[0], lines[2]]) + "\n")  # step 2 lost
    with caplog.at_level(logging.WARNING):
        run(tmp_path, resume="auto")
    assert "no records of steps [2]" in caplog.text
    (tmp_path / "metrics.jsonl").write_text('{"step": "1"}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1: not a metrics record \\('step' is '1'"):
        run(tmp_path, resume="auto")


def test_one_process_at_a_time_trains_a_run_directory(tmp_path):
    from disentanglement.run_dir import run_lock

    # held as another process training here would hold it (flock is per open file)
    with run_lock(tmp_path), pytest.raises(ConfigError, match=f"is being trained by pid {os.getpid()}"):
        run(tmp_path, max_steps=2)
    assert run(tmp_path, max_steps=2).final_step == 2  # released, and .lock is no run artefact
    assert run(tmp_path, max_steps=2, overwrite=True).final_step == 2
