"""Decoders of real models' shapes with random weights (``testing.MODEL_SHAPES``) and the benchmark that
times them (``benchmarks/step_cost.py --model config:NAME``, ``--models``), without running a real size."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from disentanglement import testing
from disentanglement.testing import MODEL_SHAPES, parameter_count, random_llama

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "step_cost.py"
#: The published parameter counts (tied embeddings counted once), as the model cards give them rounded.
PUBLISHED_MILLIONS = {"smollm2-135m": 134.5, "smollm2-360m": 361.8, "smollm2-1.7b": 1711.4, "llama-1b": 1235.8}


@functools.cache
def load_benchmark():
    """``benchmarks/step_cost.py`` as a module (registered, as its dataclasses need)."""
    spec = importlib.util.spec_from_file_location("step_cost", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_every_shape_has_its_published_parameter_count_on_the_meta_device(name):
    model = random_llama(name, dtype=torch.bfloat16, device="meta")
    assert all(p.is_meta for p in model.parameters()), "nothing is allocated"
    assert parameter_count(model) == MODEL_SHAPES[name]["parameters"]
    assert round(parameter_count(model) / 1e6, 1) == PUBLISHED_MILLIONS[name]
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings"
    shape = MODEL_SHAPES[name]
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size) == (
        shape["hidden_size"],
        shape["num_hidden_layers"],
        shape["intermediate_size"],
        shape["vocab_size"],
    )
    assert (config.num_attention_heads, config.num_key_value_heads) == (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    assert config.rope_parameters["rope_theta"] == shape["rope_theta"]


def test_a_shrunk_variant_builds_random_weights_in_the_dtype_asked_for():
    model = random_llama("smollm2-135m", dtype=torch.bfloat16, num_hidden_layers=1, vocab_size=512)
    again = random_llama("smollm2-135m", dtype=torch.bfloat16, num_hidden_layers=1, vocab_size=512)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = dict(model.named_parameters())
    assert 0.018 < float(weights["model.embed_tokens.weight"].detach().float().std()) < 0.022
    assert torch.equal(weights["model.norm.weight"], torch.ones(576, dtype=torch.bfloat16))
    for name, value in again.named_parameters():  # seeded
        assert torch.equal(value, weights[name]), name
    with torch.no_grad():
        logits = model(input_ids=torch.randint(3, 512, (2, 7))).logits
    assert logits.shape == (2, 7, 512) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="unknown model shape 'nope'"):
        random_llama("nope")


def test_the_benchmark_accepts_config_models_and_refuses_others():
    step_cost = load_benchmark()
    assert step_cost.model_argument("config:smollm2-360m") == "config:smollm2-360m"
    assert step_cost.model_argument("embedded") == "embedded"
    for bad in ("config:gpt-5", "config:", "smollm2-135m"):
        with pytest.raises(Exception, match="unknown model"):
            step_cost.model_argument(bad)


def test_the_models_table_runs_end_to_end_on_a_shrunk_shape(monkeypatch, capsys):
    """``--models`` with ``--gradient-checkpointing`` on a 2-layer, hidden-32 shape: every case runs, the
    checkpointed case (g) leaves the decoder as it found it, and the last line is the JSON of the rows."""
    shrunk = dict(MODEL_SHAPES["smollm2-135m"], hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    shrunk.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    monkeypatch.setitem(testing.MODEL_SHAPES, "shrunk", shrunk)
    step_cost = load_benchmark()
    step_cost.main(
        [
            "--models",
            "config:shrunk",
            "--batch-size",
            "2",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--skip-memory",
            "--gradient-checkpointing",
        ]
    )
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])
    assert [row["model"] for row in rows] == ["config:shrunk"]
    row = rows[0]
    assert set(row["ms"]) == {"f", "a", "c", "e", "g"}
    assert all(value > 0 for value in row["ms"].values())
    assert row["c_over_f"] > 0 and row["g_over_c"] > 0 and row["frozen_pass_tokens_per_s"] > 0
    assert "Step cost against decoder size" in out and "config:shrunk" in out


def test_the_checkpointed_case_checkpoints_and_then_turns_it_off():
    step_cost = load_benchmark()
    decoder = testing.tiny_llama(64)
    seen = []

    def step(batch):
        seen.append(decoder.is_activation_checkpointing)

    step_cost.checkpointed_step(step, decoder)(None)
    assert seen == [True] and not decoder.is_activation_checkpointing


def test_the_peft_case_trains_only_its_virtual_tokens_on_a_copy_of_the_decoder():
    """(t): the loss the step itself backpropagates is the mean cross-entropy of the response tokens after
    the virtual tokens (computed here by hand, padding included); the step moves the virtual tokens and
    nothing of the shared decoder."""
    from disentanglement.config import build_config
    from disentanglement.data import Example, collate

    step_cost = load_benchmark()
    decoder = testing.tiny_llama(64)
    before = {name: value.clone() for name, value in decoder.state_dict().items()}
    config = build_config({"latent_tokens": 3})
    model_b = step_cost.seeded_cvae(step_cost.cvae_config("b"), decoder, torch.device("cpu"))
    step = step_cost.peft_step(decoder, config, model_b)
    model = step.model
    prompt = model.prompt_encoder["default"].embedding.weight
    assert prompt.shape == (3, decoder.config.hidden_size)
    batch = collate([Example([5, 6, 7], [8, 9], None, "a"), Example([5, 6], [10, 11, 12, 13], None, "b")], 0)
    assert not batch.attention_mask.all(), "the shorter row is padded"
    start = prompt.detach().clone()
    losses = []
    forward = model.forward

    def recording(*args, **kwargs):  # the loss the step computes and backpropagates
        out = forward(*args, **kwargs)
        losses.append(out.loss.detach())
        return out

    model.forward = recording
    step(batch)

    # by hand: the virtual tokens prepended, cross-entropy over the response tokens only
    with torch.no_grad():
        embeds = torch.cat([start.expand(2, -1, -1), decoder.get_input_embeddings()(batch.input_ids)], dim=1)
        mask = torch.cat([torch.ones(2, 3, dtype=batch.attention_mask.dtype), batch.attention_mask], dim=1)
        logits = decoder(inputs_embeds=embeds, attention_mask=mask).logits[:, 3:-1]
        targets = batch.input_ids[:, 1:].masked_fill(batch.target_mask[:, 1:] == 0, -100)
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert int((targets != -100).sum()) == 6, "2 + 4 response tokens, no prompt or padding"
    assert len(losses) == 1 and torch.allclose(losses[0], expected, atol=1e-5)

    assert not torch.equal(prompt.detach(), start), "the virtual tokens train"
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["prompt_encoder.default.embedding.weight"]
    for name, value in decoder.state_dict().items():  # the other cases' decoder is as it was
        assert torch.equal(value, before[name]), name
    assert model.base_model is not decoder, "peft wraps its own copy"


def test_the_main_table_with_peft_reports_the_cvae_step_over_peft(capsys):
    step_cost = load_benchmark()
    step_cost.main(
        ["--model", "tiny", "--batch-size", "2", "--repeats", "2", "--warmup", "0", "--threads", "1"]
        + ["--device", "cpu", "--dtype", "float32", "--skip-memory", "--skip-scaling", "--peft"]
    )
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert "t" in summary["ms"] and summary["ms"]["t"] > 0
    assert summary["c_over_t"] == pytest.approx(summary["ms"]["c"] / summary["ms"]["t"], rel=1e-3)
    assert summary["b_over_t_paired"] > 0 and summary["c_over_t_paired"] > 0 and summary["d_over_t_paired"] > 0
    assert "beside peft prompt tuning (t)" in out


def test_peft_is_refused_with_the_models_table():
    step_cost = load_benchmark()
    with pytest.raises(SystemExit):
        step_cost.main(["--models", "config:smollm2-135m", "--dtype", "float32", "--peft"])
