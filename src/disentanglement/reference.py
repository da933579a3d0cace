"""The z-free reference ``p_base(y_t | x, y_<t)`` and its one forward pass.

The reference is the model that scores a response without ``z``: the frozen decoder itself
(``decoder_training: frozen``), the decoder with its LoRA adapters disabled (``lora``), or a
frozen copy made before the decoder trains (``full``). :class:`ZFreeReference` says which and
reaches it; :func:`reference_hidden_states` is the one forward every caller runs on it (the
training features pass, the prompts' prior features, the seed notes' scoring helper). Shapes: ``B``
sequences of ``T`` tokens, ``H`` hidden size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` in eval mode inside the block; its own train/eval mode restored afterwards."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def unused_logits(inputs: torch.Tensor) -> torch.Tensor:
    """``logits_to_keep`` for a forward whose own logits are not used: position 0 as an index tensor.

    The model's head then gets a contiguous ``[B, 1, H]`` copy. ``logits_to_keep=1`` gives it a strided
    view instead, on which a linear layer runs as a batched matmul against its weight expanded over the
    batch (for bf16 weights on the CPU a copy of the ``[V, H]`` weight per example: seconds per pass).
    """
    return torch.zeros(1, dtype=torch.long, device=inputs.device)


#: The shortest token prefix shared by every row of a batch that :func:`reference_hidden_states` computes once
#: (below it a second decoder call costs more than it saves).
MIN_SHARED_PREFIX = 8


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading tokens every row of ``input_ids [B, T]`` has in common, all of them unmasked, kept one
    short of the shortest row (so that every row has a token of its own after it); 0 for a single row.

    A chat template's system turn is such a prefix: SmolLM2-Instruct's is 23 tokens of every chatterbot pair's
    56 or so."""
    B, T = input_ids.shape
    if B < 2 or T < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(dim=0) & attention_mask.bool().all(dim=0)  # [T]
    common = int(same.long().cumprod(0).sum())
    return min(common, int(attention_mask.sum(dim=1).min()) - 1)


def cache_of(out) -> object:
    """The key/value cache of a transformers forward's output (``cache``, formerly ``past_key_values``)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def forward_sharing_prefix(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    output_hidden_states: bool = True,
    keep_cache: bool = False,
    share: bool = True,
) -> tuple[tuple[torch.Tensor, ...] | None, object | None]:
    """One forward of ``model`` over right-padded ``input_ids [B, T]``: ``(hidden_states, cache)``, the ``L + 1``
    hidden states ``[B, T, H]`` (None without ``output_hidden_states``) and, with ``keep_cache``, the key/value
    cache of all ``T`` positions (else None). The model's own head does not run.

    A prefix that every row shares (:func:`shared_prefix_length`, at least :data:`MIN_SHARED_PREFIX` tokens:
    a chat template's system turn) runs once, as one row; the rows then continue from its keys and values.
    Causal attention makes that the same computation (up to the kernels' rounding), on fewer positions. With
    gradients, the prefix's row gets the gradients of every row that reads it. ``share=False`` runs one pass:
    callers pass it for a model whose layers keep no plain key/value cache (linear attention, hybrids), and for a
    trained model in training mode (every row must draw its own dropout); and a checkpointed layer with
    gradients drops the cache."""
    common = dict(output_hidden_states=output_hidden_states, logits_to_keep=unused_logits(input_ids))
    shared = shared_prefix_length(input_ids, attention_mask) if share else 0
    if shared < MIN_SHARED_PREFIX:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=keep_cache, **common)
        return (out.hidden_states if output_hidden_states else None), (cache_of(out) if keep_cache else None)
    B, T = input_ids.shape
    prefix = model(input_ids=input_ids[:1, :shared], use_cache=True, **common)
    cache = cache_of(prefix)
    cache.batch_repeat_interleave(B)  # the prefix's keys and values, for every row
    positions = torch.arange(shared, T, device=input_ids.device).unsqueeze(0).expand(B, -1)
    rest = model(
        input_ids=input_ids[:, shared:],
        attention_mask=attention_mask,  # past and present positions, as the cache expects
        position_ids=positions,
        cache=cache,
        use_cache=True,
        **common,
    )
    hidden = None
    if output_hidden_states:
        hidden = tuple(
            torch.cat([before.expand(B, -1, -1), after], dim=1)
            for before, after in zip(prefix.hidden_states, rest.hidden_states, strict=True)
        )
    return hidden, (cache if keep_cache else None)


@torch.no_grad()
def reference_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The hidden states of one no-grad, eval-mode forward of ``model`` over ``input_ids [B, T]``
    (:func:`forward_sharing_prefix`: a prefix every row shares runs once).

    Returns ``hidden_states``: ``L + 1`` tensors ``[B, T, H]`` (the embeddings, then every layer; the
    last after the final norm). The model's own head does not run (callers apply it where they need
    it, chunked); its train/eval mode is restored.

    Callers score with ``get_output_embeddings()`` on these states, so a model whose forward post-processes
    its logits (Gemma-2's soft-capping, Granite's or Cohere's logit scale) is scored without that step.
    """
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logits_scaling", "logit_scale"):
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__} post-processes its logits ({name}={value}); the z-free reference's "
                "chunked head does not, so its scores would not be the model's"
            )
    from .memory import plain_cache  # memory imports this module

    with eval_mode(model):
        hidden, _ = forward_sharing_prefix(model, input_ids, attention_mask, share=plain_cache(model))
    return hidden


class ZFreeReference:
    """Which model is the z-free reference of a CVAE's decoder, built by :func:`models.build_cvae`.

    ``copy`` (``full`` training) is kept outside the CVAE's module tree, so it is never in its
    ``state_dict``, ``parameters()`` or a data-parallel wrapper; :meth:`apply` moves it with the CVAE.
    """

    def __init__(self, decoder: nn.Module, *, adapters_off: bool = False, copy: nn.Module | None = None) -> None:
        if adapters_off and copy is not None:
            raise ValueError("a z-free reference is either the adapter-free decoder or a frozen copy, not both")
        self.decoder = decoder
        self.adapters_off = adapters_off
        self.copy = copy.requires_grad_(False).eval() if copy is not None else None

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        """The reference module inside the block (the decoder's adapters disabled while in it)."""
        if self.copy is not None:
            yield self.copy
        elif self.adapters_off:
            with self.decoder.disable_adapter():
                yield self.decoder
        else:
            yield self.decoder

    def move(self, fn) -> None:
        """A device or dtype move of the CVAE (its ``nn.Module._apply``), reaching the copy."""
        if self.copy is not None:
            self.copy._apply(fn)
