"""``ModelConfig.gradient_checkpointing``: activation checkpointing of the decoder's layers changes
memory, never the math. Tiny Llama decoders built in-process, for every ``decoder_training``."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from disentanglement.cli import build_parser
from disentanglement.config import ConfigError, build_config, config_from_namespace, load_run_config, write_run_config
from disentanglement.losses import TERM_WEIGHT_FIELDS
from disentanglement.models import build_cvae, enable_activation_checkpointing
from disentanglement.resume import check_resume_config
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.trainer import train
from helpers import prompt_batch, tiny_gpt2, tiny_llama, trainer_config

ALL_TERMS = dict.fromkeys(TERM_WEIGHT_FIELDS.values(), 0.5)
#: Checkpointing recomputes the same operations on the same inputs (float32): equal to float rounding.
RTOL, ATOL = 1e-5, 1e-6


def checkpoint_calls(decoder) -> list[int]:
    """Count the calls of every checkpointed layer's checkpoint function (``[count]``, updated in place)."""
    calls = [0]
    for module in decoder.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is not None and getattr(module, "gradient_checkpointing", False):

            def counted(*args, _func=func, **kwargs):
                calls[0] += 1
                return _func(*args, **kwargs)

            module._gradient_checkpointing_func = counted
    return calls


def loss_and_gradients(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the continuous latent samples
    out = model(batch, None, step=2)  # features None: the no-grad frozen pass runs inside
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads


@pytest.mark.parametrize("decoder_training", ["frozen", "lora", "full"])
@pytest.mark.parametrize(("latent", "placement"), [("discrete", "prefix"), ("continuous", "between")])
def test_checkpointing_gives_the_same_loss_and_gradients(tokenizer, decoder_training, latent, placement):
    config = build_config(
        dict(
            ALL_TERMS,
            preset="raw",  # the recipe this test was written against (the defaults before issue 23)
            zfree_reference_scale=2.0,
            decoder_training=decoder_training,
            latent=latent,
            latent_placement=placement,
            lora_target_modules=["q_proj", "v_proj", "down_proj"],
        )
    )
    torch.manual_seed(0)
    model = build_cvae(config, tiny_llama(len(tokenizer))).train()
    if decoder_training == "lora":
        for name, param in model.decoder.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)  # B = 0 would leave every lora_A gradient 0
    batch = prompt_batch(tokenizer)
    loss, grads = loss_and_gradients(model, batch)
    assert model.decoder.is_activation_checkpointing is False

    enable_activation_checkpointing(model.decoder)
    calls = checkpoint_calls(model.decoder)
    model.frozen_pass(batch)
    assert calls[0] == 0, "the no-grad z-free pass is not checkpointed"
    checkpointed_loss, checkpointed_grads = loss_and_gradients(model, batch)
    assert calls[0] == 2, "each of the 2 layers ran checkpointed, once (one decode)"
    if decoder_training == "frozen":  # the layers' training flags are set for the forward only
        assert not any(m.training for m in model.decoder.modules())

    torch.testing.assert_close(checkpointed_loss, loss, rtol=RTOL, atol=ATOL)
    assert grads.keys() == checkpointed_grads.keys()
    trained = [n for n in grads if n.startswith("decoder.")]
    assert bool(trained) == (decoder_training != "frozen")
    if decoder_training == "lora":
        assert trained and all("lora_" in n for n in trained)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0 or not name.startswith("decoder."), name
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=RTOL, atol=ATOL, msg=name)


def test_a_frozen_gpt2_keeps_its_dropout_off_when_checkpointed(tokenizer):
    """GPT-2's blocks hold dropout modules (p = 0.1): only the blocks' own flags are set for the forward,
    so the checkpointed frozen decoder computes in eval mode, as without checkpointing."""
    config = build_config(dict(ALL_TERMS, preset="raw", zfree_reference_scale=2.0))
    torch.manual_seed(0)
    model = build_cvae(config, tiny_gpt2(len(tokenizer))).train()
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.decoder.modules())
    batch = prompt_batch(tokenizer)
    loss, grads = loss_and_gradients(model, batch)
    enable_activation_checkpointing(model.decoder)
    calls = checkpoint_calls(model.decoder)
    checkpointed_loss, checkpointed_grads = loss_and_gradients(model, batch)
    assert calls[0] == 2
    torch.testing.assert_close(checkpointed_loss, loss, rtol=RTOL, atol=ATOL)
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=RTOL, atol=ATOL, msg=name)


def test_build_cvae_turns_it_on_for_the_decoder_only(tokenizer):
    model = build_cvae(build_config({"decoder_training": "full", "gradient_checkpointing": True}), tiny_llama(103))
    assert model.decoder.is_activation_checkpointing
    assert not model.reference.copy.is_activation_checkpointing  # the frozen reference copy never needs it
    lora = build_cvae(build_config({"decoder_training": "lora", "gradient_checkpointing": True}), tiny_llama(103))
    assert lora.decoder.base_model.model.is_activation_checkpointing
    for cvae in (model, lora):  # non-reentrant checkpointing needs no enable_input_require_grads hook
        assert not cvae.decoder.get_input_embeddings()._forward_hooks
    plain = build_cvae(build_config({}), tiny_llama(103))
    assert not plain.decoder.is_activation_checkpointing


def parse(*argv: str):
    """The config of ``disentangle train ARGV`` (the real command line's parser)."""
    return config_from_namespace(build_parser().parse_args(["train", *argv]))


def test_the_flag_round_trips_through_the_command_line_and_files(tmp_path):
    assert build_config({}).model.gradient_checkpointing is False
    parsed = parse("--gradient-checkpointing")
    assert parsed.model.gradient_checkpointing is True
    off = parse("--no-gradient-checkpointing")
    assert off.model.gradient_checkpointing is False
    path = tmp_path / "run.yaml"
    write_run_config(parsed, path)
    assert load_run_config(path) == parsed
    for suffix, text in (
        (".yaml", yaml.safe_dump({"model": {"gradient_checkpointing": True}})),
        (".json", json.dumps({"gradient_checkpointing": True})),
    ):
        file = tmp_path / f"file{suffix}"
        file.write_text(text)
        config = parse("--config", str(file))
        assert config.model.gradient_checkpointing is True
        over = parse("--config", str(file), "--no-gradient-checkpointing")
        assert over.model.gradient_checkpointing is False


def test_memory_placement_is_refused_up_front_naming_the_field():
    with pytest.raises(ConfigError, match="gradient_checkpointing.*latent_placement 'memory'") as info:
        build_config({"gradient_checkpointing": True, "latent_placement": "memory"})
    assert info.value.field == "gradient_checkpointing"
    build_config({"gradient_checkpointing": True, "latent_placement": "between"})


def test_checkpointing_may_change_on_resume(tmp_path):
    stored = build_config({"gradient_checkpointing": False})
    assert check_resume_config(stored, build_config({"gradient_checkpointing": True}), tmp_path) == {}


@pytest.mark.parametrize("decoder_training", ["frozen", "lora"])
def test_a_run_resumed_with_checkpointing_continues_the_same(tmp_path, tokenizer, decoder_training, monkeypatch):
    import transformers.modeling_utils

    calls = [0]
    real_checkpoint = transformers.modeling_utils.checkpoint

    def counted(*args, **kwargs):
        calls[0] += 1
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", counted)  # what enabling binds
    pairs = make_hidden_factor_pairs([f"tell me about topic {i}" for i in range(40)], kind="clean", seed=0)

    def run(output_dir, callbacks=(), **overrides):
        config = trainer_config(output_dir, decoder_training=decoder_training, **overrides)
        return train(config, (tiny_llama(len(tokenizer)), tokenizer), pairs, callbacks)

    class Stop(Exception):
        pass

    def stop_at_3(step, record):
        if step == 3:
            raise Stop

    straight = run(tmp_path / "straight")
    with pytest.raises(Stop):
        run(tmp_path / "resumed", callbacks=[stop_at_3])
    assert calls[0] == 0
    resumed = run(tmp_path / "resumed", resume="auto", gradient_checkpointing=True)
    assert calls[0] == 3 * 2, "steps 4-6 through the trainer ran both layers checkpointed"
    assert resumed.model.decoder.is_activation_checkpointing
    read = [
        [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("straight", "resumed")
    ]
    assert len(read[0]) == len(read[1]) == 6
    assert read[1] == pytest.approx(read[0], rel=1e-5, abs=1e-6)
    wa, wb = straight.model.trainable_state_dict(), resumed.model.trainable_state_dict()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=RTOL, atol=ATOL, msg=name)
