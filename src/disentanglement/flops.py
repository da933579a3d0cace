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


Attention = Literal["causal", "full"]


def forward_flops(shape: DecoderShape, length: int, scored: int, attention: Attention = "causal") -> dict[str, int]:
    """One sequence of ``length`` positions through the decoder, the head at ``scored`` positions."""
    q = shape.heads * shape.head_dim
    pairs = length * (length + 1) // 2 if attention == "causal" else length * length
    return {
        "linear": 2 * length * shape.layers * shape.linear_params_per_layer,
        "attention": 2 * 2 * shape.layers * q * pairs,
        "head": 2 * shape.hidden * shape.vocab * scored,
    }


def input_backward_flops(
    shape: DecoderShape, length: int, scored: int, attention: Attention = "causal"
) -> dict[str, int]:
    """The backward of :func:`forward_flops` that takes input gradients only (frozen weights)."""
    forward = forward_flops(shape, length, scored, attention)
    return {"linear": forward["linear"], "attention": 2 * forward["attention"], "head": forward["head"]}


def step_flops(
    shape: DecoderShape,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    latent_tokens: int,
    *,
    frozen_pass: bool = False,
    backward: bool = True,
    attention: Attention = "causal",
) -> dict[str, int]:
    """A batch's useful FLOPs by part: ``forward``, ``backward`` (input gradients), ``frozen_pass`` (with
    ``frozen_pass``: one no-grad pass over ``[x][y]`` in the step), each split into linear, attention and head
    (``<part>_<kind>``), and ``total``. ``latent_tokens`` = 0 with ``backward=False`` and ``frozen_pass=False``
    is the frozen pass alone."""
    out: dict[str, int] = {}

    def add(part: str, flops: dict[str, int]) -> None:
        for kind, value in flops.items():
            out[f"{part}_{kind}"] = out.get(f"{part}_{kind}", 0) + value

    for prompt, response in zip(prompt_lengths, response_lengths, strict=True):
        length = latent_tokens + prompt + response
        add("forward", forward_flops(shape, length, response, attention))
        if backward:
            add("backward", input_backward_flops(shape, length, response, attention))
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

    Also ``total``. The mean over examples is exact for the linear layers and the head (linear in length),
    the expectation of the attention's pairs over uniformly drawn examples."""

    def total(pairs: Sequence[tuple[int, int]], latent: int, backward: bool) -> int:
        if not pairs:
            return 0
        prompts, responses = zip(*pairs, strict=True)
        return step_flops(shape, prompts, responses, latent, backward=backward)["total"]

    prefix = shared_prefix_positions * forward_flops(shape, 1, 0)["linear"]
    out = {
        "frozen_pass": float(total([*train, *validation] if frozen is None else frozen, 0, False) - prefix),
        "steps": total(train, latent_tokens, True) / max(1, len(train)) * steps * batch_size,
        "validation": float(total(validated, latent_tokens, False) * validations),
        "verdict": float(total(validation, latent_tokens, False) * verdict_decodes),
    }
    out["total"] = sum(out.values())
    return out
