"""Build a CVAE of the configured family around a loaded decoder."""

from __future__ import annotations

import copy

import torch.nn as nn

from .config import RunConfig
from .continuous_cvae import ContinuousCVAE
from .cvae_base import CVAEBase
from .reference import ZFreeReference
from .shared_discrete_cvae import SharedDiscreteCVAE

LATENT_FAMILIES: dict[str, type[CVAEBase]] = {"discrete": SharedDiscreteCVAE, "continuous": ContinuousCVAE}


def build_cvae(config: RunConfig, decoder: nn.Module) -> CVAEBase:
    """Wrap ``decoder`` for the configured decoder training and latent family.

    ``frozen``: the decoder's weights never train and it is its own z-free reference.
    ``lora``: LoRA adapters (peft) train; the reference is the same model with adapters disabled.
    ``full``: every decoder weight trains; the reference is a frozen copy made here.
    """
    training = config.model.decoder_training
    if training == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=config.model.lora_r,
            lora_alpha=config.model.lora_alpha,
            lora_dropout=config.model.lora_dropout,
            target_modules=list(config.model.lora_target_modules),
            bias="none",
        )
        decoder.requires_grad_(False)
        decoder = get_peft_model(decoder, lora)
        reference = ZFreeReference(decoder, adapters_off=True)
    elif training == "full":
        reference = ZFreeReference(decoder, copy=copy.deepcopy(decoder))
        decoder.requires_grad_(True)
    else:
        reference = ZFreeReference(decoder)
    family = LATENT_FAMILIES[config.latent.latent]
    return family(
        decoder,
        config.latent,
        config.reconstruction,
        config.kl,
        config.divergence,
        decoder_training=training,
        reference=reference,
    )
