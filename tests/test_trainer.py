"""The trainer on a tiny in-process model: logging, c_base, frozen weights, resume, atomic saves, errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from disentanglement import cli
from disentanglement.config import build_config
from disentanglement.losses import TERM_WEIGHT_FIELDS
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.trainer import TrainingDiverged, latest_checkpoint, load_trained, train
from helpers import tiny_llama, trainer_config


@pytest.fixture(scope="module")
def pairs():
    return make_hidden_factor_pairs([f"tell me about topic {i}" for i in range(40)], kind="clean", seed=0)


config_for = trainer_config


def run(tmp_path, tokenizer, pairs, callbacks=(), **overrides):
    return train(config_for(tmp_path, **overrides), (tiny_llama(len(tokenizer)), tokenizer), pairs, callbacks)


def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_every_term_logged_and_run_directory_written(tmp_path, tokenizer, pairs):
    result = run(tmp_path, tokenizer, pairs)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 7))
    for record in records:
        for term in TERM_WEIGHT_FIELDS:
            assert term in record
        for key in (
            "loss",
            "kl",
            "beta",
            "grad_norm",
            "lr_encoder",
            "lr_latent",
            "codes_used_slot_0",
            "codebook_loss",
            "commitment_loss",
        ):
            assert key in record
    assert "val_reconstruction_loss" in records[2] and "val_reconstruction_loss" not in records[1]
    assert (tmp_path / "config.yaml").is_file()
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step-000006" and result.checkpoint == checkpoint
    assert {p.name for p in checkpoint.iterdir()} >= {
        "model.safetensors",
        "optimizer.pt",
        "scheduler.json",
        "rng.safetensors",
        "trainer_state.json",
        "config.yaml",
    }
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["zfree_reference_scale"] == pytest.approx(result.zfree_reference_scale)
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert not any(k.startswith("decoder.") for k in weights), "a frozen decoder is not copied into checkpoints"
    assert "codebook" in weights and "code_last_used" in weights


def test_zfree_reference_scale_is_the_mean_training_base_loss(tmp_path, tokenizer, pairs):
    result = run(tmp_path, tokenizer, pairs, max_steps=1)
    reference = tiny_llama(len(tokenizer))
    losses = []
    with torch.no_grad():
        for example in result.data.train:
            ids = torch.tensor([example.prompt_ids + example.response_ids])
            logits = reference(input_ids=ids).logits[0]
            p = len(example.prompt_ids)
            losses.append(F.cross_entropy(logits[p - 1 : -1], ids[0, p:]).item())
    assert result.zfree_reference_scale == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    stats = json.loads((tmp_path / "data_stats.json").read_text())
    assert stats["zfree_reference_scale"] == pytest.approx(result.zfree_reference_scale)


def test_given_zfree_reference_scale_is_used(tmp_path, tokenizer, pairs):
    result = run(tmp_path, tokenizer, pairs, max_steps=1, zfree_reference_scale=7.5)
    assert result.zfree_reference_scale == 7.5
    record = read_metrics(tmp_path)[0]
    assert record["zfree_relative_reconstruction_loss"] == pytest.approx(record["reconstruction_loss"] / 7.5, rel=1e-5)


def test_frozen_decoder_bit_identical_and_never_gets_gradients(tmp_path, tokenizer, pairs):
    decoder = tiny_llama(len(tokenizer))
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    result = train(config_for(tmp_path), (decoder, tokenizer), pairs)
    for name, value in result.model.decoder.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in result.model.decoder.parameters())


@pytest.mark.parametrize("latent", ["discrete", "continuous", "discrete-held"])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, tokenizer, pairs, latent):
    """Stopped at step 3 and resumed: the same losses and weights as a run straight through; "discrete-held" with
    the codebook in a group of its own, the code table, and the stop inside encoder_hold_steps."""
    extra = {"latent": latent, "divergence_weight": 0.1 if latent == "discrete" else 0.0, "dead_code_steps": 2}
    if latent == "discrete-held":
        extra.update(latent="discrete", codebook_lr=1e-3, encoder_hold_steps=4, decoder_code_table=True)
    straight = run(tmp_path / "straight", tokenizer, pairs, **extra)

    class Stop(Exception):
        pass

    def stop_at_3(step, record):
        if step == 3:
            raise Stop

    with pytest.raises(Stop):
        run(tmp_path / "resumed", tokenizer, pairs, callbacks=[stop_at_3], **extra)
    resumed = run(tmp_path / "resumed", tokenizer, pairs, resume="auto", **extra)
    assert resumed.final_step == 6
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7), ra["step"]
    wa, wb = straight.model.trainable_state_dict(), resumed.model.trainable_state_dict()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-6, atol=1e-7, msg=name)


def test_interrupted_save_leaves_the_previous_checkpoint_usable(tmp_path, tokenizer, pairs, monkeypatch):
    import errno

    import disentanglement.checkpoints as checkpoints

    real_write = checkpoints.write_durably

    def failing_write(path, data):
        if path.name == "scheduler.json" and ".tmp-step-000006" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device (simulated)", str(path))
        return real_write(path, data)

    monkeypatch.setattr(checkpoints, "write_durably", failing_write)
    with pytest.raises(OSError, match="simulated") as raised:
        run(tmp_path, tokenizer, pairs)
    assert "step-000006" in str(raised.value) and "the last complete checkpoint is" in str(raised.value)
    assert str(tmp_path / "checkpoints" / "step-000003") in str(raised.value)
    monkeypatch.setattr(checkpoints, "write_durably", real_write)
    assert not (tmp_path / "checkpoints" / ".tmp-step-000006").exists(), "nothing partial is left behind"
    assert latest_checkpoint(tmp_path).name == "step-000003"
    model, _, _, state = load_trained(tmp_path, (tiny_llama(len(tokenizer)), tokenizer))
    assert state["step"] == 3
    resumed = run(tmp_path, tokenizer, pairs, resume="auto")
    assert resumed.final_step == 6 and latest_checkpoint(tmp_path).name == "step-000006"


def test_repeated_nonfinite_losses_stop_with_a_diagnostic(tmp_path, tokenizer, pairs):
    with pytest.raises(TrainingDiverged, match="consecutive non-finite"):
        run(
            tmp_path,
            tokenizer,
            pairs,
            encoder_lr=1e30,
            latent_lr=1e30,
            max_nonfinite_steps=2,
            max_grad_norm=1e30,
            warmup_steps=0,
        )


def test_bad_config_is_rejected_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import disentanglement.lm as lm

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(lm, "load_model_and_tokenizer", no_load)
    assert cli.main(["train", "--beta", "-1", "--output-dir", str(tmp_path)]) == 2
    assert "KLConfig.beta must be >= 0, got -1" in capsys.readouterr().err
    assert cli.main(["train", "--token-weighted-reconstruction-alpha", "nan"]) == 2
    assert "token_weight_alpha" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    assert cli.main(["train", "--data", str(bad), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text(
        '{"prompt": "a", "response": " "}\n{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": ""}\n'
    )
    assert cli.main(["train", "--data", str(empty), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "1" in err and "3" in err and "empty" in err.lower()


def test_cli_flags_override_the_config_file(tmp_path, monkeypatch, tokenizer, pairs):
    seen = {}

    def fake_train(config):
        seen["config"] = config
        raise SystemExit(0)

    import disentanglement.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "train", fake_train)
    config_file = tmp_path / "run.yaml"
    config_file.write_text("latent: continuous\nmax_steps: 50\nkl:\n  beta: 0.3\n")
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", str(config_file), "--max-steps", "7", "--seed", "3", "--resume", "auto"])
    config = seen["config"]
    assert config.latent.latent == "continuous" and config.kl.beta == 0.3
    assert config.train.max_steps == 7 and config.train.seed == 3 and config.train.resume == "auto"


def test_gradient_accumulation_equals_one_large_batch(tmp_path, tokenizer, pairs):
    common = dict(max_steps=2, dead_code_steps=0, max_grad_norm=1e9, eval_every=0, save_every=100)
    big = run(tmp_path / "big", tokenizer, pairs, batch_size=8, **common)
    accumulated = run(tmp_path / "acc", tokenizer, pairs, batch_size=4, gradient_accumulation_steps=2, **common)
    for name, value in big.model.trainable_state_dict().items():
        torch.testing.assert_close(accumulated.model.trainable_state_dict()[name], value, rtol=1e-5, atol=1e-6)
    a, b = read_metrics(tmp_path / "big"), read_metrics(tmp_path / "acc")
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-5)


def test_a_checkpoint_with_tensors_the_model_lacks_is_refused_by_name(tmp_path, tokenizer):
    # e.g. one written before the first release, whose heads' LayerNorm still had an affine
    from safetensors.torch import save_file

    from disentanglement.checkpoints import CheckpointError
    from disentanglement.models import build_cvae
    from disentanglement.trainer import load_trainable_weights

    config = build_config({})
    model = build_cvae(config, tiny_llama(len(tokenizer)))
    state = model.trainable_state_dict()
    state["encoder_norm.weight"] = torch.ones(2 * model.hidden_size)
    (tmp_path / "ckpt").mkdir()
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"))
    before = {k: v.clone() for k, v in model.trainable_state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model\.safetensors: does not fit this model: .*'encoder_norm\.weight'"):
        load_trainable_weights(model, tmp_path / "ckpt")
    after = model.trainable_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
