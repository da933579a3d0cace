"""A faster backward for the decoder's attention on the CPU: the forward stays torch's SDPA call.

On the CPU, the backward of ``torch.nn.functional.scaled_dot_product_attention`` (its flash kernel) is far
slower than its forward: for SmolLM2-135M's shapes in bf16 (batch 8, 9 heads, 104 positions, head size 64)
about 127 ms against 3 ms per layer on one core, so that attention took 38% of a training step whose
attention is 1% of the FLOPs (``benchmarks/step_cost.py --profile``). :class:`SdpaInputGradient` runs the
same SDPA forward (the same call, so the same outputs and loss, bit for bit) and computes the backward
from the softmax it recomputes, with batched matmuls in the inputs' dtype (AMX in bf16) and the softmax
algebra in float32 (measured on one core at those shapes: 54 ms against SDPA's 110 ms per layer, forward
and backward; in float32 SDPA's own backward is as fast, so float32 keeps it):

    S = scale Q K^T + mask,  P = softmax(S)  (float32),  O = P V
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(P * dP)),   dQ = scale dS K,   dK = scale dS^T Q

Masked entries get float32's lowest value instead of minus infinity (a fully masked row gives a uniform
row and no NaN, as SDPA's kernel does). The gradients equal SDPA's own to rounding (tested against a
float64 reference).

:func:`fast_attention_backward` is the scope in which a model that uses transformers' ``"sdpa"``
attention gets this function during a forward with gradients on the CPU; elsewhere (CUDA, no grad,
dropout, an attention other than SDPA) the call goes to transformers' own function unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F


class SdpaInputGradient(torch.autograd.Function):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)`` with the
    backward computed from the recomputed softmax (module docstring). ``q, k, v``: ``[B, h, T, d]`` (k and v
    with as many heads as q); ``mask``: boolean (True = attend) or additive, broadcastable to ``[B, h, T, S]``."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, causal):
        groups = q.shape[1] // k.shape[1]  # > 1: grouped key/value heads (SDPA's enable_gqa)
        extra = {"enable_gqa": True} if groups > 1 else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal, **extra)
        ctx.save_for_backward(q, k, v, mask if mask is not None else torch.empty(0))
        ctx.has_mask, ctx.scale, ctx.causal, ctx.groups = mask is not None, scale, causal, groups
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask = ctx.saved_tensors
        work = q.dtype  # the matmuls in the inputs' dtype (bf16: AMX), the softmax algebra in float32
        if ctx.groups > 1:
            k, v = k.repeat_interleave(ctx.groups, dim=1), v.repeat_interleave(ctx.groups, dim=1)
        scale = ctx.scale if ctx.scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, h, T, S]
        lowest = torch.finfo(torch.float32).min
        if ctx.has_mask:
            scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask.float()
        if ctx.causal:
            t, s = scores.shape[-2:]
            keep = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(0)  # SDPA: top-left aligned
            scores = scores.masked_fill(~keep, lowest)
        p = torch.softmax(scores.clamp_min(lowest), dim=-1)  # float32
        grad_out = grad_out.to(work)
        grad_v = torch.matmul(p.to(work).transpose(-1, -2), grad_out)
        grad_p = torch.matmul(grad_out, v.transpose(-1, -2)).float()
        grad_s = (p * (grad_p - (p * grad_p).sum(-1, keepdim=True))).to(work)
        grad_q = torch.matmul(grad_s, k) * scale
        grad_k = torch.matmul(grad_s.transpose(-1, -2), q) * scale
        if ctx.groups > 1:  # each key/value head's gradient: the sum over the query heads that share it
            b, h, s_len, d = grad_k.shape
            grad_k = grad_k.view(b, h // ctx.groups, ctx.groups, s_len, d).sum(2)
            grad_v = grad_v.view(b, h // ctx.groups, ctx.groups, s_len, grad_v.shape[-1]).sum(2)
        return grad_q, grad_k, grad_v, None, None, None


def _wants_input_gradient(query, key, attention_mask, dropout: float, kwargs: dict) -> bool:
    """CPU, half precision (in float32 SDPA's own backward is as fast), gradients on, nothing but a mask."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and (attention_mask is not None or key.shape[2] == query.shape[2])
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and query.shape[2] > 1
    )


def _attention(original):
    from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        if not _wants_input_gradient(query, key, attention_mask, dropout, kwargs):
            return original(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1 and not use_gqa_in_sdpa(attention_mask, key, value):
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # as transformers' SDPA path does
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal and attention_mask is None)
        out = SdpaInputGradient.apply(query, key, value, attention_mask, scaling, causal)
        return out.transpose(1, 2).contiguous(), None  # [B, T, h, d], as transformers' function returns

    return attention


@contextlib.contextmanager
def fast_attention_backward(model: torch.nn.Module, in_eval_mode: bool = False) -> Iterator[None]:
    """Inside the block, ``model``'s SDPA attention (transformers' ``"sdpa"``) runs through
    :class:`SdpaInputGradient` on the CPU with gradients on; outside, and for other models or devices,
    nothing changes, and so with activation checkpointing, unless the caller runs the model in eval mode
    (``in_eval_mode``: transformers checkpoints a layer only in training mode). The backward may run after the
    block: the choice is made at the forward."""
    config = getattr(model, "config", None)
    checkpointed = getattr(model, "is_activation_checkpointing", False) and not in_eval_mode
    if getattr(config, "_attn_implementation", None) != "sdpa" or checkpointed:
        # Checkpointed layers run their forward again in the backward, outside this block, with transformers'
        # function, whose saved tensors differ from SdpaInputGradient's: the two must not mix.
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had, before = "sdpa" in local, local.get("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _attention(ALL_ATTENTION_FUNCTIONS["sdpa"])
    try:
        yield
    finally:
        if had:
            local["sdpa"] = before
        else:
            del local["sdpa"]
