"""Build a CVAE of the configured family around a loaded decoder."""

from __future__ import annotations

import copy
import dataclasses

import torch.nn as nn

from .config import ConfigError, RunConfig
from .continuous_cvae import ContinuousCVAE
from .cvae_base import CVAEBase
from .reference import ZFreeReference
from .shared_discrete_cvae import SharedDiscreteCVAE

LATENT_FAMILIES: dict[str, type[CVAEBase]] = {"discrete": SharedDiscreteCVAE, "continuous": ContinuousCVAE}


def enable_activation_checkpointing(decoder: nn.Module) -> None:
    """Checkpoint every layer of a transformers ``decoder`` (non-reentrant ``torch.utils.checkpoint``).

    Non-reentrant checkpointing needs no input that requires grad (the reentrant kind does, hence
    ``enable_input_require_grads``, a hook making the token embeddings require grad, which transformers
    adds when it turns checkpointing on and peft when it wraps a checkpointed model), so frozen weights,
    LoRA adapters and ``inputs_embeds`` carrying the latent all work as they are: the hook is removed
    again (it would only add backward work on the token positions). A peft model is checkpointed through
    its base model (attribute access reaches it). transformers checkpoints a layer only
    when it runs with gradients in training mode: the no-grad z-free pass is never checkpointed, and a
    frozen decoder (kept in eval mode) is checkpointed by :meth:`CVAEBase.decode`, which puts its
    layers, and only them, in training mode for the forward.
    """
    if not getattr(decoder, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"ModelConfig.gradient_checkpointing: the decoder {type(decoder).__name__} does not support "
            "activation checkpointing",
            field="gradient_checkpointing",
        )
    decoder.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    decoder.disable_input_require_grads()


def build_cvae(config: RunConfig, decoder: nn.Module) -> CVAEBase:
    """Wrap ``decoder`` for the configured decoder training and latent family.

    ``frozen``: the decoder's weights never train and it is its own z-free reference.
    ``lora``: LoRA adapters (peft) train; the reference is the same model with adapters disabled.
    ``full``: every decoder weight trains; the reference is a frozen copy made here.
    """
    training = config.model.decoder_training
    if training == "lora":
        from peft import LoraConfig, get_peft_model

        targets = config.model.lora_target_modules
        lora = LoraConfig(
            r=config.model.lora_r,
            lora_alpha=config.model.lora_alpha,
            lora_dropout=config.model.lora_dropout,
            target_modules=None if targets is None else list(targets),  # None: peft's for the architecture
            bias="none",
        )
        decoder.requires_grad_(False)
        try:
            decoder = get_peft_model(decoder, lora)
        except ValueError as error:  # no such modules, or peft knows no default for this architecture
            chosen = "peft's default for it" if targets is None else f"{targets}"
            raise ConfigError(
                f"ModelConfig.lora_target_modules ({chosen}): no LoRA adapters on {type(decoder).__name__} "
                f"(model_type {getattr(decoder.config, 'model_type', None)!r}): {error}; name its attention "
                "projections (e.g. q_proj v_proj, or c_attn), or set decoder_training frozen",
                field="lora_target_modules",
            ) from error
        reference = ZFreeReference(decoder, adapters_off=True)
    elif training == "full":
        reference = ZFreeReference(decoder, copy=copy.deepcopy(decoder))
        decoder.requires_grad_(True)
    else:
        reference = ZFreeReference(decoder)
    if config.model.gradient_checkpointing:
        # After peft's wrapping (which would add enable_input_require_grads' hook again) and after the full
        # decoder's frozen copy (which never needs checkpointing).
        enable_activation_checkpointing(decoder)
    family = LATENT_FAMILIES[config.latent.latent]
    # null centring (the default recipe's) resolved for this run: the model sees true or false
    latent = dataclasses.replace(config.latent, centered_straight_through=config.centers_straight_through)
    return family(
        decoder,
        latent,
        config.reconstruction,
        config.kl,
        config.divergence,
        decoder_training=training,
        reference=reference,
    )
