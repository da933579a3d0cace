"""Latent key/value memory: ``latent_placement = "memory"`` (Optimus, Li et al. 2020; LangVAE).

Shapes: ``B`` examples, ``P`` memory slots (``latent_tokens``), ``H`` hidden size, ``Ly`` attention layers,
``Hkv`` key/value heads, ``Dh`` head dimension, ``T`` length of the sequence ``[x][y]``.

The prefix placement turns the latent vector into ``P`` soft input embeddings ``e [B, P, H]``
(``CVAEBase.latent_embeddings``). Here the same per-slot embeddings become a key and a value for every
attention layer (``CVAEBase.memory_keys_values``)::

    K_l, V_l = the decoder's own keys and values of layer l for the sequence e_1 .. e_P   # [B, Hkv, P, Dh]
    kv = W e_p + c,   W: H -> Ly * 2 * Hkv * Dh (LatentMemory, zero at the start)
    keys[l] = K_l + kv[..., l, 0],   values[l] = V_l + kv[..., l, 1]

and handed to the decoder as a ``transformers.DynamicCache`` holding ``P`` past positions in every
layer, so every query of every layer attends to the ``P`` memory slots besides the causal past of its
own sequence. The sequence itself is not shifted: its position ids are those of the z-free pass
(``0 .. T-1``), so the decoder's token positions, and the alignment offsets of the token weights, are
those of ``[x][y]`` (offsets 0); the attention mask gains ``P`` leading ones. The causal mask follows from
the cache: a query at sequence position ``t`` sits at cache index ``P + t`` and sees cache indices
``0 .. P + t``.

Why the decoder's own keys and values: memory slots from a randomly initialised per-layer map (Optimus's
design, for a decoder that is fine-tuned with it) are off the scale of the keys and values a frozen
decoder's attention expects. Measured on the frozen SmolLM2-135M (``benchmarks/placement.py``): such slots
made the posterior NLL worse than the z-free one (3.43 against 3.05 nats/token after 200 steps) and the
latent reached NMI 0.56 on a set the prefix learns in 25 steps. Read off the decoder (the keys a prefix of
the embeddings would give, their rotary positions ``0 .. P-1`` included), the slots start where the prefix
does; the per-layer map, Optimus's, learns from zero what differs per layer. Its parameter count is
``H x Ly x 2 x Hkv x Dh`` (SmolLM2-135M: 576 x 30 x 2 x 3 x 64, 6.6 M).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .config import ConfigError
from .reference import cache_of, unused_logits


@dataclass(frozen=True)
class MemoryGeometry:
    """What a key/value memory must match in the decoder: its attention layers, key/value heads and head size."""

    layers: int
    kv_heads: int
    head_dim: int

    @property
    def width(self) -> int:
        """Outputs of the memory projection per slot: a key and a value for every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim


def decoder_text_config(decoder: nn.Module):
    """The decoder's (text) config, for a cache of its layers; None without one."""
    config = getattr(decoder, "config", None)
    if config is None:
        return None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


#: plain_cache's answer per decoder (it builds a cache to find out: asked on every batch).
_PLAIN_CACHE: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def plain_cache(decoder: nn.Module) -> bool:
    """Whether every layer of ``decoder`` keeps a plain full-attention key/value cache (:func:`memory_geometry`
    accepts it): what a cache built from stored keys and values, or the memory placement, needs. The answer is
    kept per module object (a weak reference): a decoder whose config is edited in place after the first call
    keeps its first answer."""
    if decoder not in _PLAIN_CACHE:
        try:
            memory_geometry(decoder)
            _PLAIN_CACHE[decoder] = True
        except ConfigError:
            _PLAIN_CACHE[decoder] = False
    return _PLAIN_CACHE[decoder]


def memory_geometry(decoder: nn.Module) -> MemoryGeometry:
    """The cache geometry of a Hugging Face causal LM (peft-wrapped or not); :class:`ConfigError` where a
    latent memory does not apply: no config, an encoder-decoder or cross-attention model, or layers that do
    not all keep a plain full-attention cache (sliding-window, linear-attention or hybrid models)."""
    config = decoder_text_config(decoder)
    what = type(decoder).__name__
    if config is None:
        raise ConfigError(
            f"latent_placement 'memory' needs a Hugging Face decoder with a config; {what} has none",
            field="latent_placement",
        )
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ConfigError(
            f"latent_placement 'memory' needs a decoder-only model without cross-attention ({what})",
            field="latent_placement",
        )
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, hidden)):
        raise ConfigError(
            f"latent_placement 'memory' needs num_hidden_layers, num_attention_heads and hidden_size in the "
            f"decoder's config ({what}: {layers}, {heads}, {hidden})",
            field="latent_placement",
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    cache = DynamicCache(config=config)
    if len(cache.layers) not in (0, layers) or not all(type(layer) is DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise ConfigError(
            f"latent_placement 'memory' needs every attention layer to keep a full (not sliding-window or linear) "
            f"key/value cache; {what}'s cache has layers of kinds {kinds}",
            field="latent_placement",
        )
    return MemoryGeometry(layers, int(kv_heads), int(head_dim))


class LatentMemory(nn.Module):
    """The learned map from the ``P`` per-slot latent embeddings to each layer's memory keys and values."""

    def __init__(self, hidden_size: int, geometry: MemoryGeometry) -> None:
        super().__init__()
        self.geometry = geometry
        self.projection = nn.Linear(hidden_size, geometry.width)
        # Zero at the start: the memory is then the decoder's own keys and values of the latent embeddings
        # (CVAEBase.memory_keys_values), on the scale its attention expects.
        nn.init.zeros_(self.projection.weight)
        nn.init.zeros_(self.projection.bias)

    def forward(self, latent_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, P, H]`` -> ``(keys, values)``, each ``[Ly, B, Hkv, P, Dh]``."""
        g = self.geometry
        B, P, _ = latent_embeds.shape
        kv = self.projection(latent_embeds).view(B, P, g.layers, 2, g.kv_heads, g.head_dim)
        kv = kv.permute(2, 3, 0, 4, 1, 5)  # [Ly, 2, B, Hkv, P, Dh]
        return kv[:, 0], kv[:, 1]

    def keys_values(self, decoder: nn.Module, latent_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, P, H]`` latent embeddings -> the memory's ``(keys, values)``, ``[Ly, B, Hkv, P, Dh]`` each.

        ``decoder``'s own keys and values of the ``P`` embeddings read as a sequence of their own (positions
        ``0 .. P-1``: what every layer would attend to were they a prefix), plus this learned per-layer map
        (zero at the start, so that the memory starts where the prefix does).
        """
        B, P, _ = latent_embeds.shape
        dtype = decoder.get_input_embeddings().weight.dtype
        out = decoder(
            inputs_embeds=latent_embeds.to(dtype),
            attention_mask=torch.ones(B, P, dtype=torch.long, device=latent_embeds.device),
            use_cache=True,
            logits_to_keep=unused_logits(latent_embeds),
        )
        cache = cache_of(out)
        keys = torch.stack([layer.keys for layer in cache.layers])  # [Ly, B, Hkv, P, Dh]
        values = torch.stack([layer.values for layer in cache.layers])
        learned_keys, learned_values = self(latent_embeds)
        return keys.float() + learned_keys, values.float() + learned_values

    def decoder_inputs(
        self,
        decoder: nn.Module,
        latent_embeds: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> dict[str, object]:
        """The decoder's extra arguments: ``cache`` (the ``P`` memory slots of every layer, built fresh: the
        forward appends to it), ``attention_mask [B, P + T]`` (``P`` leading ones) and the sequence's own
        ``position_ids [B, T]``, for ``[B, P, H]`` latent embeddings and ``[B, T]`` masks."""
        if torch.is_grad_enabled() and getattr(decoder, "is_activation_checkpointing", False):
            # transformers' checkpointed layers drop the cache when they run with gradients
            raise ConfigError(
                "latent_placement 'memory' cannot run with activation (gradient) checkpointing on the decoder: "
                "its layers drop the past-key-value cache that holds the memory",
                field="latent_placement",
            )
        keys, values = self.keys_values(decoder, latent_embeds)  # [Ly, B, Hkv, P, Dh] each
        return {
            "cache": cache_from_layers(zip(keys.to(dtype), values.to(dtype), strict=True), decoder),
            "attention_mask": memory_attention_mask(attention_mask, latent_embeds.shape[1]),
            "position_ids": position_ids,
        }


def cache_from_layers(layers: Iterable[tuple[torch.Tensor, torch.Tensor]], decoder: nn.Module) -> DynamicCache:
    """A fresh ``DynamicCache`` of ``decoder`` holding ``(keys, values)`` ``[B, Hkv, S, Dh]`` per layer as its ``S``
    past positions (a new one per forward: the forward appends its own keys and values to it). The latent
    memory's: ``cache_from_layers(zip(keys, values, strict=True), decoder)`` of its stacked ``[Ly, ...]``."""
    return DynamicCache(ddp_cache_data=list(layers), config=decoder_text_config(decoder))


def memory_attention_mask(attention_mask: torch.Tensor, slots: int) -> torch.Tensor:
    """``[B, T]`` -> ``[B, P + T]``: the sequence's mask with ``P`` leading ones (every memory slot is seen)."""
    ones = attention_mask.new_ones(attention_mask.shape[0], slots)
    return torch.cat([ones, attention_mask], dim=1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, T]`` of left-padded rows: ``0, 1, ..`` from each row's first real token (padding 0).

    transformers' ``generate`` derives the same ids from the mask; for right-padded rows they are
    ``0 .. T-1`` on the real tokens, as the z-free pass sees them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
