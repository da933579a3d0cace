"""attention_backward.py: SDPA's forward with a backward from the recomputed softmax. Its gradients against a
float64 reference (boolean, additive and causal masks, grouped key/value heads); in a CVAE step on a bf16 tiny
Llama the loss is SDPA's bit for bit and the gradients equal SDPA's own to rounding; no effect in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disentanglement import attention_backward
from disentanglement.attention_backward import SdpaInputGradient, fast_attention_backward
from disentanglement.config import build_config
from disentanglement.data import collate, tokenize_pairs
from disentanglement.features import build_feature_cache
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from helpers import tiny_llama, tiny_tokenizer


def reference_grads(q, k, v, mask, causal, grad):
    """float64 autograd through the textbook attention (keys/values repeated to the query heads)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    (torch.softmax(scores, -1) @ vv).backward(grad.double())
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind", ["bool", "additive", "causal", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_a_float64_reference(kind, dtype):
    torch.manual_seed(0)
    b, h, t, d = 3, 4, 9, 8
    kv = 2 if kind == "grouped" else h
    q, k, v = (torch.randn(b, n, t, d, dtype=dtype, requires_grad=True) for n in (h, kv, kv))
    lengths = torch.tensor([9, 6, 4])
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & (torch.arange(t) < lengths[:, None])[:, None, :]
    mask = allowed[:, None]  # [B, 1, T, T]
    if kind == "additive":
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    causal = kind == "causal"
    if causal:
        mask = None
    grad = torch.randn(b, h, t, d, dtype=dtype)
    out = SdpaInputGradient.apply(q, k, v, mask, None, causal)
    extra = {"enable_gqa": True} if kv < h else {}
    expected_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **extra)
    assert torch.equal(out, expected_out)  # the forward is SDPA's own call
    out.backward(grad)
    ref = reference_grads(q, k, v, None if kind == "additive" else mask, causal, grad)
    if kind == "additive":
        ref = reference_grads(q, k, v, allowed[:, None], False, grad)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0.05)
    for mine, expected in zip((q.grad, k.grad, v.grad), ref, strict=True):
        assert mine.shape == expected.shape and mine.dtype == dtype
        torch.testing.assert_close(mine.double(), expected, **tol)


def cvae_step_grads(dtype, fast: bool, monkeypatch, **settings):
    torch.manual_seed(0)  # the CVAE's heads are initialised alike in both runs
    tokenizer = tiny_tokenizer(chat_template=False)
    pairs = make_hidden_factor_pairs([f"say {'x' * (i % 4)} {i}" for i in range(8)], kind="clean")
    config = build_config(dict(chat_template=False, token_weighted_weight=1.0, token_weight_alpha=1.0, **settings))
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    model = build_cvae(config, tiny_llama(len(tokenizer)).to(dtype)).train()
    cache = build_feature_cache(model, examples, tokenizer.pad_token_id, 8, progress=False)
    model.zfree_reference_scale = 3.0
    batch = collate(examples, tokenizer.pad_token_id, indices=list(range(len(examples))))
    if not fast:  # transformers' own SDPA function throughout
        monkeypatch.setattr(attention_backward, "_wants_input_gradient", lambda *a, **k: False)
    calls = []
    original = SdpaInputGradient.backward
    monkeypatch.setattr(SdpaInputGradient, "backward", staticmethod(lambda ctx, g: calls.append(1) or original(ctx, g)))
    torch.manual_seed(0)
    out = model(batch, cache.features(batch, model.weighting_params))
    out.loss.backward()
    monkeypatch.undo()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, len(calls)


def test_a_bf16_cvae_step_has_sdpas_loss_and_its_gradients_to_rounding(monkeypatch):
    loss_fast, grads_fast, calls = cvae_step_grads(torch.bfloat16, True, monkeypatch)
    loss_sdpa, grads_sdpa, none = cvae_step_grads(torch.bfloat16, False, monkeypatch)
    assert calls == 2 and none == 0  # the tiny Llama's two layers took the new backward
    assert torch.equal(loss_fast, loss_sdpa)  # the same forward, bit for bit
    assert grads_fast.keys() == grads_sdpa.keys() and grads_fast
    for name, grad in grads_sdpa.items():
        scale = grad.abs().max().clamp_min(1e-6)
        assert (grads_fast[name] - grad).abs().max() / scale < 0.05, name


def test_float32_and_no_grad_keep_transformers_sdpa(monkeypatch):
    _, _, calls = cvae_step_grads(torch.float32, True, monkeypatch)
    assert calls == 0
    model = tiny_llama(40)
    with fast_attention_backward(model), torch.no_grad():  # no gradients: transformers' function
        model(input_ids=torch.tensor([[1, 5, 6, 7]]))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping  # restored after the block


def test_a_checkpointed_bf16_step_keeps_transformers_sdpa(monkeypatch):
    """With activation checkpointing the layers' forward runs again in the backward, after the scope: the
    fast path is skipped (its saved tensors differ from SDPA's), and the step computes (it raised before)."""
    loss, grads, calls = cvae_step_grads(torch.bfloat16, True, monkeypatch, gradient_checkpointing=True)
    assert calls == 0 and grads and torch.isfinite(loss)
    loss_sdpa, grads_sdpa, _ = cvae_step_grads(torch.bfloat16, False, monkeypatch)
    assert torch.equal(loss, loss_sdpa)  # checkpointing recomputes; the loss is the plain step's
