"""The step's useful-FLOP formula (flops.py) against a hand count and against torch's own FLOP counter on a
tiny Llama (forward, and the backward with frozen weights: input gradients only)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from disentanglement.flops import DecoderShape, forward_flops, input_backward_flops, job_flops, step_flops


def test_hand_count_of_a_tiny_decoder():
    # H 4, I 6, 1 layer, 2 heads of 2, 1 key/value head, V 10; one sequence of 3 positions, 1 scored.
    shape = DecoderShape(hidden=4, intermediate=6, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10)
    # q 4x4, k and v 4x2, o 4x4, gate and up 4x6, down 6x4: 16 + 8 + 8 + 16 + 24 + 24 + 24 = 120 weights
    assert shape.linear_params_per_layer == 120
    forward = forward_flops(shape, length=3, scored=1)
    assert forward["linear"] == 2 * 3 * 120  # a multiply and an add per weight per position
    # causal pairs (0,0) (1,0) (1,1) (2,0) (2,1) (2,2): 6; per pair and head 2 x 2 for QK^T and again for AV
    assert forward["attention"] == 6 * 2 * (2 * 2 + 2 * 2)
    assert forward["head"] == 2 * 4 * 10
    assert forward_flops(shape, 3, 1, "full")["attention"] == 9 * 2 * 8
    backward = input_backward_flops(shape, 3, 1)
    assert backward == {"linear": 720, "attention": 192, "head": 80}
    # A batch: latent 1 + prompt 1 + response 1, and latent 1 + prompt 2 + response 2 (length 5, 2 scored).
    step = step_flops(shape, [1, 2], [1, 2], latent_tokens=1, frozen_pass=True)
    long = forward_flops(shape, 5, 2)
    assert step["forward"] == sum(forward.values()) + sum(long.values())
    assert step["backward"] == 720 + 192 + 80 + long["linear"] + 2 * long["attention"] + long["head"]
    frozen = sum(forward_flops(shape, 2, 1).values()) + sum(forward_flops(shape, 4, 2).values())
    assert step["frozen_pass"] == frozen
    assert step["total"] == step["forward"] + step["backward"] + frozen


def test_a_jobs_flops_by_phase_counted_by_hand():
    """job_flops: the frozen pass over every example, the steps as the mean training example's forward and
    backward times the examples drawn, validation and verdict as forwards under the latent."""
    shape = DecoderShape(hidden=4, intermediate=6, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10)
    train, validation = [(1, 1), (2, 2)], [(3, 1)]

    def fwd(length, scored):
        return sum(forward_flops(shape, length, scored).values())

    def fwd_bwd(length, scored):
        return fwd(length, scored) + sum(input_backward_flops(shape, length, scored).values())

    counts = dict(steps=3, batch_size=2, validated=validation, validations=5, verdict_decodes=4)
    job = job_flops(shape, train, validation, 1, **counts)
    assert job["frozen_pass"] == fwd(2, 1) + fwd(4, 2) + fwd(4, 1)
    assert job["steps"] == (fwd_bwd(3, 1) + fwd_bwd(5, 2)) / 2 * 3 * 2
    assert job["validation"] == fwd(5, 1) * 5
    assert job["verdict"] == fwd(5, 1) * 4
    assert job["total"] == pytest.approx(sum(job[k] for k in ("frozen_pass", "steps", "validation", "verdict")))
    empty = job_flops(shape, train, [], 1, steps=3, batch_size=2, validated=[], validations=0, verdict_decodes=4)
    assert empty["validation"] == empty["verdict"] == 0
    # a shared prefix computed once per batch: 3 positions fewer, each the linear layers' 2 x (q 4x4, k and v
    # 4x2, o 4x4, the MLP's three 4x6) = 240 FLOPs
    shared = job_flops(shape, train, validation, 1, **counts, shared_prefix_positions=3)
    assert job["frozen_pass"] - shared["frozen_pass"] == 3 * 240
    assert {k: shared[k] for k in ("steps", "validation", "verdict")} == {
        k: job[k] for k in ("steps", "validation", "verdict")
    }
    # the pass over each distinct example once: a copy of the first training example adds nothing to it
    copied = job_flops(shape, [*train, (1, 1)], validation, 1, **counts, frozen=[*train, *validation])
    assert copied["frozen_pass"] == job["frozen_pass"]


def test_the_formula_matches_torchs_flop_counter_on_a_tiny_llama():
    model = counted_llama()
    config = model.config
    shape = DecoderShape.from_config(config)
    length, scored = 11, 4
    inputs = torch.randn(1, length, config.hidden_size, requires_grad=True)
    forward_count, backward_count = counted_flops(model, inputs, scored)
    expected_forward = forward_flops(shape, length, scored, "full")
    expected_backward = input_backward_flops(shape, length, scored, "full")
    assert forward_count == sum(expected_forward.values())
    assert backward_count == sum(expected_backward.values())
    assert all(p.grad is None for p in model.parameters()) and inputs.grad is not None


def test_lora_adapters_counted_by_hand_and_by_torchs_counter():
    """LoRA adapters: ``r (in + out)`` weights per adapted projection, ``2 T L`` times that forward and twice it
    backward (the input gradient through the adapter, and A's and B's own); a job counts them in its steps,
    validation and verdict but not in the frozen pass (the reference, adapters off). Then against torch's
    counter on a tiny Llama with peft's adapters."""
    from peft import LoraConfig, get_peft_model

    from disentanglement.flops import Lora

    shape = DecoderShape(hidden=4, intermediate=6, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10)
    lora = Lora(rank=2, modules=("q_proj", "v_proj"))
    assert shape.lora_params_per_layer(lora) == 2 * (4 + 4) + 2 * (4 + 2)  # q 4x4, v 4x2
    assert forward_flops(shape, 3, 1, lora=lora) == {**forward_flops(shape, 3, 1), "lora": 2 * 3 * 28}
    assert input_backward_flops(shape, 3, 1, lora=lora)["lora"] == 2 * 2 * 3 * 28
    with pytest.raises(ValueError, match="c_attn"):
        shape.lora_params_per_layer(Lora(2, ("c_attn",)))
    counts = dict(steps=3, batch_size=2, validated=[(3, 1)], validations=5, verdict_decodes=4)
    train, validation = [(1, 1), (2, 2)], [(3, 1)]
    plain, adapted = (
        job_flops(shape, train, validation, 1, **counts),
        job_flops(shape, train, validation, 1, **counts, lora=lora),
    )
    assert adapted["frozen_pass"] == plain["frozen_pass"]
    # per example of T = 1 + prompt + response positions: 2 T 28 forward, 4 T 28 backward; T = 3 and 5, mean 4
    assert adapted["steps"] - plain["steps"] == 6 * 4 * 28 * 3 * 2
    assert adapted["validation"] - plain["validation"] == 5 * 2 * 5 * 28
    assert adapted["verdict"] - plain["verdict"] == 4 * 2 * 5 * 28

    base = counted_llama()
    config = base.config
    model = get_peft_model(base, LoraConfig(r=3, lora_alpha=6, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    shape = DecoderShape.from_config(config)
    lora = Lora(rank=3, modules=("q_proj", "v_proj"))
    length, scored = 11, 4
    inputs = torch.randn(1, length, config.hidden_size, requires_grad=True)
    forward_count, backward_count = counted_flops(base, inputs, scored)
    assert forward_count == sum(forward_flops(shape, length, scored, "full", lora).values())
    assert backward_count == sum(input_backward_flops(shape, length, scored, "full", lora).values())
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)


def counted_llama() -> LlamaForCausalLM:
    """A tiny frozen Llama whose attention is the eager path's dense matmuls over all (query, key) pairs ("full"
    attention, which torch's counter sees)."""
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def counted_flops(model: LlamaForCausalLM, inputs: torch.Tensor, scored: int) -> tuple[int, int]:
    """torch's count of the model's forward over ``inputs`` (embeddings), the head at the last ``scored``
    positions, and of the backward from them."""
    with FlopCounterMode(display=False) as forward_counter:
        hidden = model.model(inputs_embeds=inputs).last_hidden_state
        logits = model.lm_head(hidden[:, -scored:])
    with FlopCounterMode(display=False) as backward_counter:
        logits.float().logsumexp(-1).sum().backward()
    return forward_counter.get_total_flops(), backward_counter.get_total_flops()
