"""The encoder's own LoRA adapters on the reference LM (``LatentConfig.encoder_lora_layers``).

By default the encoder reads states of the frozen pass, cached once per data set: it can only pool what the
frozen model already computed. With ``encoder_lora_layers = N`` the encoder's features come instead from a pass of
the reference LM over ``[x][y]`` with low-rank adapters of the encoder's own on the top ``N`` layers up to the
features' layer, run every step with gradients (not cacheable): the encoder can change the states it pools.

Each adapted projection ``W`` (``encoder_lora_target_modules``, the attention's query and value by default)
computes ``W x + (alpha / r) B A x`` inside :meth:`EncoderAdapters.active`, and ``W x`` outside it: the adapters
are forward hooks on the reference's own modules, added for the encoder's pass and removed after it, so the
decoder (the same module for a frozen decoder) and the z-free reference never see them. ``B`` starts at zero,
so before training the adapted pass is the frozen pass and the encoder starts from the cached view.
The adapters train with the encoder heads (``encoder_lr``); they are the CVAE's own parameters
(``encoder_adapters.*``), saved with its checkpoint, whatever the decoder's training.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
import torch.nn as nn

#: The layer index in a module's name: ``model.layers.3.self_attn.q_proj`` (Llama), ``transformer.h.3.attn`` (GPT-2).
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def _features(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear projection: ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2; weight ``[in, out]``)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return tuple(module.weight.shape)
    return None


def _model_name(model: nn.Module) -> str:
    """The model's class, under a peft wrapper its base model's (``LlamaForCausalLM``, not ``PeftModel``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__


def adapted_modules(model: nn.Module, targets: list[str], layers: range) -> dict[str, nn.Module]:
    """The projections of ``model`` the adapters hook, by a key that names their layer and target
    (``"3.q_proj"``): modules named ``targets`` in the decoder layers ``layers``; for a peft-wrapped model, the
    wrapped layer's ``base_layer`` (what runs with peft's own adapters disabled)."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        target = parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]
        match = _LAYER_INDEX.search(name + ".")
        if target not in targets or match is None or int(match.group(1)) not in layers:
            continue
        if _features(module) is None:  # a peft wrapper: its base_layer is hooked instead
            continue
        key = f"{match.group(1)}.{target}"
        if key in found:
            raise ValueError(
                f"two modules of {_model_name(model)} are projection {target!r} of layer {match.group(1)} "
                f"({name} and another): the encoder's adapters need one per layer and name"
            )
        found[key] = module
    return found


class EncoderAdapters(nn.Module):
    """LoRA adapters ``(A, B)`` per adapted projection of the reference's top ``num_layers`` layers up to the
    features' layer ``last_layer`` (the ``hidden_states`` index, ``1 .. L``; layer ``i`` of the model makes
    ``hidden_states[i + 1]``)."""

    def __init__(
        self,
        model: nn.Module,
        num_layers: int,
        last_layer: int,
        targets: list[str],
        rank: int,
        alpha: float,
    ) -> None:
        super().__init__()
        if last_layer < 1:
            raise ValueError(
                "LatentConfig.encoder_lora_layers needs features from a transformer layer (encoder_layer >= 1 or "
                f"negative), not the token embeddings (hidden_states[{last_layer}])"
            )
        if num_layers > last_layer:
            raise ValueError(
                f"LatentConfig.encoder_lora_layers is {num_layers}, but the features' layer hidden_states[{last_layer}] "
                f"has {last_layer} transformer layers below it: set at most {last_layer}"
            )
        self.layers = range(last_layer - num_layers, last_layer)
        self.targets = list(targets)
        self.scaling = alpha / rank
        modules = adapted_modules(model, self.targets, self.layers)
        if not modules:
            raise ValueError(
                f"LatentConfig.encoder_lora_target_modules {self.targets} name no linear projection in layers "
                f"{self.layers.start}..{self.layers.stop - 1} of {_model_name(model)}"
            )
        self.down = nn.ParameterDict()  # A: [r, in], Kaiming-uniform as peft starts it
        self.up = nn.ParameterDict()  # B: [out, r], zero: the adapted pass starts as the frozen one
        # A's random start is drawn from a generator of its own: the rest of the CVAE (the heads, the codebook)
        # starts from the same draws with and without the adapters, so that a seed's runs compare.
        generator = torch.Generator().manual_seed(int(torch.initial_seed()) % 2**63)
        for key, module in modules.items():
            d_in, d_out = _features(module)
            bound = 1 / d_in**0.5  # peft's start: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))
            down = (torch.rand(rank, d_in, generator=generator) * 2 - 1) * bound
            self.down[self._name(key)] = nn.Parameter(down)
            self.up[self._name(key)] = nn.Parameter(torch.zeros(d_out, rank))

    @staticmethod
    def _name(key: str) -> str:
        return key.replace(".", "_")  # ParameterDict keys cannot hold dots

    def is_zero(self) -> bool:
        """Whether every ``B`` is still zero (the start): the adapted pass is then exactly the frozen one."""
        return all(not bool(up.any()) for up in self.up.values())

    def delta(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``(alpha / r) B A x`` for one projection's input ``x [.., in]``, in ``x``'s dtype."""
        down, up = self.down[self._name(key)], self.up[self._name(key)]
        return (x.to(down.dtype) @ down.T @ up.T * self.scaling).to(x.dtype)

    @contextlib.contextmanager
    def active(self, model: nn.Module) -> Iterator[None]:
        """Inside the block, ``model``'s adapted projections add their adapter's output."""
        modules = adapted_modules(model, self.targets, self.layers)
        if set(map(self._name, modules)) != set(self.down.keys()):
            raise ValueError("the encoder's adapters were built for another model's projections")
        handles = [
            module.register_forward_hook(lambda _m, args, out, key=key: out + self.delta(key, args[0]))
            for key, module in modules.items()
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
