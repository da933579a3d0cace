"""Useful floating-point operations of a training step through a frozen Llama-style decoder.

A step with a frozen decoder runs its forward over ``[z][x][y]`` (``P`` latent positions, prompt, response)
and a backward that takes *input* gradients only: each linear layer's ``dX = dY W^T`` (as many FLOPs as
its forward), no ``dW`` (the weights are frozen). Counted per sequence at its own length (padding is not
useful work), for a decoder of ``L`` layers, hidden size ``H``, MLP size ``I``, query width
``q = heads x head_dim`` and key/value width ``kv = kv_heads x head_dim``:

* linear layers, forward: ``2 T L (H q + 2 H kv + q H + 3 H I)`` (q, k, v, o; gate, up, down);
* attention, forward: ``QK^T`` and ``AV``, each ``2 head_dim`` FLOPs per head per (query, key) pair:
  ``2 L q T (T + 1)`` over the causal pairs (``attention="causal"``, the useful ones), or
  ``4 L q T^2`` over all pairs (``"full"``, what a dense kernel computes);
* LM head: ``2 H V`` per scored position (the response tokens).

Backward (input gradients): linear layers and the head as their forward, attention twice its forward
(``dQ`` and ``dK`` from ``dS``; ``dA`` and ``dV`` from ``dO``). The frozen pass is one forward over
``[x][y]`` (no latent), the head at the response tokens. The CVAE's own small heads are left out
(a few thousand parameters against millions).

LoRA adapters (``decoder_training: lora``; :class:`Lora`) add, per adapted projection of shape ``(in, out)``
and rank ``r``, ``2 T L r (in + out)`` forward FLOPs (``x A^T``, then ``(x A^T) B^T``) and twice that backward:
the input gradient through the adapter and the gradients of ``A`` and ``B``, the only weights that train.
The adapters-off reference is the cached frozen pass, which they do not touch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        """From a Hugging Face Llama-style config (``num_key_value_heads`` and ``head_dim`` optional)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
        )

    @property
    def linear_params_per_layer(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate

    def linear_shapes(self) -> list[tuple[int, int]]:
        """``(in, out)`` of each linear layer of one decoder layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def lora_params_per_layer(self, lora: Lora) -> int:
        """The weights of one decoder layer's LoRA adapters: ``r (in + out)`` per adapted projection."""
        shapes = dict(zip(LLAMA_PROJECTIONS, self.linear_shapes(), strict=True))
        unknown = sorted(set(lora.modules) - set(shapes))
        if unknown:
            raise ValueError(f"LoRA modules {unknown}: flops.py counts the Llama projections {LLAMA_PROJECTIONS}")
        return sum(lora.rank * (shapes[m][0] + shapes[m][1]) for m in lora.modules)


#: the names of :meth:`DecoderShape.linear_shapes`'s projections in a Llama-style decoder layer
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Lora:
    """LoRA adapters of rank ``rank`` on the projections named ``modules`` (of :data:`LLAMA_PROJECTIONS`) of every
    decoder layer."""

    rank: int
    modules: tuple[str, ...]


Attention = Literal["causal", "full"]


def forward_flops(
    shape: DecoderShape, length: int, scored: int, attention: Attention = "causal", lora: Lora | None = None
) -> dict[str, int]:
    """One sequence of ``length`` positions through the decoder, the head at ``scored`` positions (and ``lora``'s
    adapters, where given)."""
    q = shape.heads * shape.head_dim
    pairs = length * (length + 1) // 2 if attention == "causal" else length * length
    out = {
        "linear": 2 * length * shape.layers * shape.linear_params_per_layer,
        "attention": 2 * 2 * shape.layers * q * pairs,
        "head": 2 * shape.hidden * shape.vocab * scored,
    }
    if lora is not None:
        out["lora"] = 2 * length * shape.layers * shape.lora_params_per_layer(lora)
    return out


def input_backward_flops(
    shape: DecoderShape, length: int, scored: int, attention: Attention = "causal", lora: Lora | None = None
) -> dict[str, int]:
    """The backward of :func:`forward_flops` that takes input gradients only (frozen weights), and with ``lora``
    the adapters' input and weight gradients (twice their forward)."""
    forward = forward_flops(shape, length, scored, attention, lora)
    out = {"linear": forward["linear"], "attention": 2 * forward["attention"], "head": forward["head"]}
    if lora is not None:
        out["lora"] = 2 * forward["lora"]
    return out


def step_flops(
    shape: DecoderShape,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    latent_tokens: int,
    *,
    frozen_pass: bool = False,
    backward: bool = True,
    attention: Attention = "causal",
    lora: Lora | None = None,
) -> dict[str, int]:
    """A batch's useful FLOPs by part: ``forward``, ``backward`` (input gradients), ``frozen_pass`` (with
    ``frozen_pass``: one no-grad pass over ``[x][y]`` in the step), each split into linear, attention and head
    (and with ``lora`` the adapters', in the forward and backward; ``<part>_<kind>``), and ``total``.
    ``latent_tokens`` = 0 with ``backward=False`` and ``frozen_pass=False`` is the frozen pass alone."""
    out: dict[str, int] = {}

    def add(part: str, flops: dict[str, int]) -> None:
        for kind, value in flops.items():
            out[f"{part}_{kind}"] = out.get(f"{part}_{kind}", 0) + value

    for prompt, response in zip(prompt_lengths, response_lengths, strict=True):
        length = latent_tokens + prompt + response
        add("forward", forward_flops(shape, length, response, attention, lora))
        if backward:
            add("backward", input_backward_flops(shape, length, response, attention, lora))
        if frozen_pass:
            add("frozen_pass", forward_flops(shape, prompt + response, response, attention))
    for part in ("forward", "backward", "frozen_pass"):
        keys = [k for k in out if k.startswith(part + "_")]
        if keys:
            out[part] = sum(out[k] for k in keys)
    out["total"] = sum(out.get(part, 0) for part in ("forward", "backward", "frozen_pass"))
    return out


def job_flops(
    shape: DecoderShape,
    train: Sequence[tuple[int, int]],
    validation: Sequence[tuple[int, int]],
    latent_tokens: int,
    *,
    steps: int,
    batch_size: int,
    validated: Sequence[tuple[int, int]],
    validations: int,
    verdict_decodes: int,
    shared_prefix_positions: int = 0,
    frozen: Sequence[tuple[int, int]] | None = None,
    lora: Lora | None = None,
) -> dict[str, float]:
    """Useful FLOPs of a training run by phase, from its examples' ``(prompt, response)`` lengths:

    - ``frozen_pass``: one forward over ``[x][y]`` of every example of ``frozen`` (default: train and validation;
      the pass runs over each distinct example once, :func:`.features.first_copies`), less the linear
      layers of the ``shared_prefix_positions`` that it computes once per batch instead of once per row
      (:func:`.features.shared_prefix_positions`; the attention they save is left counted);
    - ``steps``: ``steps x batch_size`` examples, each the mean training example's forward over ``[z][x][y]``
      and input-gradient backward (the batches are drawn at random: the mean is the expectation);
    - ``validation``: ``validations`` times a forward under the posterior latent of each example of
      ``validated`` (the examples one validation scores: the first ``eval_batches x batch_size``);
    - ``verdict``: ``verdict_decodes`` forwards of every validation example (the discrete latent's exact prior
      mixture decodes each example under each code; the posterior's and the bound's are among them).

    With ``lora`` the steps, validation and verdict count the adapters too; the frozen pass is the reference's,
    the adapters off.

    Also ``total``. The mean over examples is exact for the linear layers and the head (linear in length),
    the expectation of the attention's pairs over uniformly drawn examples."""

    def total(pairs: Sequence[tuple[int, int]], latent: int, backward: bool, adapters: Lora | None = lora) -> int:
        if not pairs:
            return 0
        prompts, responses = zip(*pairs, strict=True)
        return step_flops(shape, prompts, responses, latent, backward=backward, lora=adapters)["total"]

    prefix = shared_prefix_positions * forward_flops(shape, 1, 0)["linear"]
    passed = [*train, *validation] if frozen is None else frozen
    out = {
        "frozen_pass": float(total(passed, 0, False, None) - prefix),
        "steps": total(train, latent_tokens, True) / max(1, len(train)) * steps * batch_size,
        "validation": float(total(validated, latent_tokens, False) * validations),
        "verdict": float(total(validation, latent_tokens, False) * verdict_decodes),
    }
    out["total"] = sum(out.values())
    return out
