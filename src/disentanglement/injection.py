"""Latent injection: where the ``P`` latent embeddings enter the decoder, and the layout they give it.

Shapes: ``B`` examples; ``T`` z-free length of ``[x][y]``; ``P`` latent embeddings; conditioned length
``Tc = T + P`` (``Tc = T`` for the memory placement); ``H`` hidden size.

A linear projection (:func:`latent_projection`) turns the latent vector into ``P`` soft embeddings
``[B, P, H]``. :class:`LatentLayout` places them (``LatentConfig.latent_placement``): ``[z][x][y]``
(``prefix``) or ``[x][z][y]`` (``between``) in the decoder's input sequence, with the input ids, attention
and token masks and alignment offsets of the conditioned sequence; or, for ``memory``, as ``P`` key/value
slots of every attention layer (:class:`.memory.LatentMemory`, :func:`latent_memory`): the decoder then
sees ``[x][y]`` at its z-free positions, with the memory as a past-key-value cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .data import Batch
from .memory import LatentMemory, memory_geometry


def latent_projection(vector_dim: int, latent_tokens: int, embeddings: nn.Embedding) -> nn.Linear:
    """The map ``[B, L] -> [B, P * H]`` of the latent vector to ``P`` soft embeddings (bias zero), whose
    weights start so that the embeddings are on the scale of the token ``embeddings``."""
    H = embeddings.weight.shape[1]
    projection = nn.Linear(vector_dim, latent_tokens * H)
    # Latent embeddings start on the scale of the token embeddings (inputs of unit scale).
    embedding_std = float(embeddings.weight.detach().float().std())
    nn.init.normal_(projection.weight, std=embedding_std / vector_dim**0.5)
    nn.init.zeros_(projection.bias)
    return projection


def latent_memory(placement: str, hidden_size: int, decoder: nn.Module) -> LatentMemory | None:
    """latent_placement "memory": the slots' embeddings -> every layer's memory keys and values (else None)."""
    if placement == "memory":
        return LatentMemory(hidden_size, memory_geometry(decoder))
    return None


@dataclass(frozen=True)
class LatentLayout:
    """Where the ``P`` latent embeddings go in the decoder's input (``placement``: ``prefix``, ``between``
    or ``memory``), and the conditioned sequence that results."""

    placement: str
    latent_tokens: int  # P
    hidden_size: int  # H

    @property
    def sequence_latent_tokens(self) -> int:
        """How many latent positions the decoder's input sequence holds: ``P``, or 0 for the memory placement."""
        return 0 if self.placement == "memory" else self.latent_tokens

    def alignment_offsets(self, batch: Batch) -> torch.Tensor:
        """``[B]``: z-free position ``t`` of a response token is conditioned position ``t + offset``.

        Both sequence placements put the ``P`` latent embeddings before every response token; the memory
        placement leaves the sequence as it is (offset 0).
        """
        return torch.full(
            (batch.input_ids.shape[0],), self.sequence_latent_tokens, dtype=torch.long, device=batch.input_ids.device
        )

    def positions(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each conditioned position comes from, ``[B, Tc]`` each: ``is_latent``, the z-free
        position ``source`` of a token position, and the latent embedding index of a latent position."""
        B, T = batch.input_ids.shape
        P = self.sequence_latent_tokens
        device = batch.input_ids.device
        if P == 0:  # memory: the z-free layout itself
            source = torch.arange(T, device=device).expand(B, T)
            return torch.zeros(B, T, dtype=torch.bool, device=device), source, torch.zeros_like(source)
        if self.placement == "prefix":
            insert_at = torch.zeros(B, dtype=torch.long, device=device)
        else:
            insert_at = batch.prompt_lengths
        j = torch.arange(T + P, device=device).unsqueeze(0)  # [1, Tc]
        start = insert_at.unsqueeze(1)  # [B, 1]
        is_latent = (j >= start) & (j < start + P)  # [B, Tc]
        source = torch.where(j < start, j, j - P).clamp(0, T - 1)  # [B, Tc] z-free position
        latent_index = (j - start).clamp(0, P - 1)  # [B, Tc]
        return is_latent, source, latent_index

    def target_mask(self, batch: Batch) -> torch.Tensor:
        """The ``[B, Tc]`` token mask of the conditioned sequence (1 on response tokens), without decoding."""
        is_latent, source, _ = self.positions(batch)
        return batch.target_mask.gather(1, source).masked_fill(is_latent, 0)

    def inputs(
        self, batch: Batch, token_embeds: torch.Tensor, latent_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Insert ``P`` latent embeddings ``[B, P, H]`` into the z-free batch, whose token embeddings are
        ``token_embeds [B, T, H]``.

        Returns ``inputs_embeds [B, Tc, H]``, ``input_ids [B, Tc]`` (0 at latent positions),
        ``attention_mask [B, Tc]``, ``target_mask [B, Tc]`` and ``alignment_offsets [B]``. For the memory
        placement these are the z-free batch's own (``Tc = T``, offsets 0; the latent goes to
        :meth:`decoder_arguments`).
        """
        is_latent, source, latent_index = self.positions(batch)
        if self.placement == "memory":
            offsets = self.alignment_offsets(batch)
            return token_embeds, batch.input_ids, batch.attention_mask, batch.target_mask, offsets
        gathered_tokens = token_embeds.gather(1, source.unsqueeze(-1).expand(-1, -1, self.hidden_size))
        gathered_latent = latent_embeds.to(token_embeds.dtype).gather(
            1, latent_index.unsqueeze(-1).expand(-1, -1, self.hidden_size)
        )
        inputs_embeds = torch.where(is_latent.unsqueeze(-1), gathered_latent, gathered_tokens)
        input_ids = batch.input_ids.gather(1, source).masked_fill(is_latent, 0)
        attention_mask = batch.attention_mask.gather(1, source).masked_fill(is_latent, 1)
        target_mask = batch.target_mask.gather(1, source).masked_fill(is_latent, 0)
        return inputs_embeds, input_ids, attention_mask, target_mask, self.alignment_offsets(batch)

    def decoder_arguments(
        self,
        memory: LatentMemory | None,
        decoder: nn.Module,
        latent_embeds: torch.Tensor,
        attention_mask: torch.Tensor,
        dtype: torch.dtype,
    ) -> dict[str, object]:
        """The decoder's keyword arguments besides the input embeddings, for the ``[B, Tc]`` attention mask of
        :meth:`inputs`: the mask itself, or for the memory placement the memory's cache, its mask and the
        positions (:meth:`.memory.LatentMemory.decoder_inputs`)."""
        if memory is None:
            return {"attention_mask": attention_mask}
        # The z-free pass's positions 0 .. T-1 (right-padded rows), the memory in front of them.
        B, T = attention_mask.shape
        positions = torch.arange(T, device=attention_mask.device).expand(B, -1)
        return memory.decoder_inputs(decoder, latent_embeds, attention_mask, positions, dtype)
