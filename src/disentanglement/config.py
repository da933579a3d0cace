"""Configuration: one validated dataclass per concern, a config file, and the flags derived from them.

Every field carries its help text in ``metadata``; the command-line flags are generated from the
fields (``--field-name``), except the flags that the seed notes fix (``flag`` in metadata), so a
field cannot lack its flag. A YAML or JSON file holds a whole config, either flat (keys are the
field names) or nested by section (``reconstruction: {token_weight_alpha: 1.0}``); flags
override the file. Field names and flag names are interchangeable: a config key, a sweep's ``--set`` or
``--cell`` may name a field by its flag (``token-weighted-reconstruction-weight`` for
``token_weighted_weight``), and a flag may be spelled as its field's name (``--token-weighted-weight``,
``--token_weighted_weight``); see :data:`FIELD_ALIASES` and :func:`register_flag_aliases`. A preset
(:data:`PRESETS`: ``--preset NAME``, or ``preset: NAME`` in a file) names a recipe and goes under both: dataclass
defaults < preset < config file < flags; the dataclass defaults are the ``"default"`` preset's. Validation runs on
construction and names the field, the value and the range:
every value is first checked against its field's type hint (a bool must be a real ``true``/``false``,
not the string ``"false"``; an int is not a bool or 1.5; a float accepts ints; a ``list[str]`` is a
list of strings, not one string), then against its range. A config file may not give a key twice
(duplicate keys in one mapping, or a field both flat and in its section); errors in values read from
a file name the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


def option(default: Any, help: str, flag: str | None = None, **argparse_kwargs: Any) -> Any:
    """A dataclass field with its help text and, where the seed notes fix it, its flag name.

    ``argparse_kwargs`` (kept in ``metadata["argparse"]``) are what a subcommand's flag needs beyond
    the type, default and choices its hint gives: ``group`` (the argument group's title), ``metavar``.
    Only the subcommands' options dataclasses use them (``options.add_option_arguments``); the ``train``
    flags of :class:`RunConfig` come from :func:`add_config_arguments`, which refuses them.
    ``default=dataclasses.MISSING`` makes the field, and its flag, required.
    """
    metadata: dict[str, Any] = {"help": help}
    if flag is not None:
        metadata["flag"] = flag
    if argparse_kwargs:
        metadata["argparse"] = argparse_kwargs
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class ConfigError(ValueError):
    """A configuration value, key or file that is not what was expected.

    ``field`` is the name of the config field the error is about, when there is one (so that
    :func:`resolve_config` can say whether the value came from the config file).
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


_TYPE_WORDS: dict[Any, str] = {
    bool: "a boolean (true/false)",
    int: "an integer",
    float: "a number",
    str: "a string",
    type(None): "null",
}


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the type ``hint`` (bool, int, float, str, None, list[...], unions, Literal)."""
    if _is_union(hint):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return True  # the allowed values are checked by _check_types
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    raise TypeError(f"config type check does not know the type hint {hint!r}")  # a new kind of field


def _describe(hint: Any) -> str:
    """``int | None`` -> ``'an integer or null'``; ``list[str]`` -> ``'a list of strings'``."""
    if _is_union(hint):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return "one of " + str(list(typing.get_args(hint)))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(item, repr(item))
    return _TYPE_WORDS.get(hint, repr(hint))


def _check_types(cfg: Any) -> None:
    """Every field of the dataclass ``cfg`` against its type hint, a ``Literal`` field's value among its values;
    :class:`ConfigError` naming the first bad one."""
    hints = typing.get_type_hints(type(cfg))
    section = type(cfg).__name__
    for f in dataclasses.fields(cfg):
        hint, value = hints[f.name], getattr(cfg, f.name)
        if _matches(value, hint):
            allowed = literal_values(hint)
            if allowed and value not in allowed:
                raise ConfigError(f"{section}.{f.name} must be one of {list(allowed)}, got {value!r}", field=f.name)
            continue
        message = f"{section}.{f.name} must be {_describe(hint)}, got {value!r} ({type(value).__name__})"
        listed = base_type(hint)  # list[str] | None: its list
        if typing.get_origin(listed) is list and isinstance(value, list):
            bad = next(v for v in value if not _matches(v, typing.get_args(listed)[0]))
            message += f" (item {bad!r} is {type(bad).__name__})"
        elif typing.get_origin(listed) is list and isinstance(value, str):
            message += f"; write a list: [{value}] in a config file, {field_flag(f)} {value} on the command line"
        raise ConfigError(message, field=f.name)


def _number(
    cfg: Any,
    name: str,
    *,
    low: float | None = None,
    low_open: bool = False,
    high: float | None = None,
    high_open: bool = False,
    integer: bool = False,
    optional: bool = False,
) -> None:
    value = getattr(cfg, name)
    section = type(cfg).__name__
    if value is None:
        if optional:
            return
        raise ConfigError(f"{section}.{name} must be set, got None", field=name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{section}.{name} must be a number, got {value!r}", field=name)
    if integer and not float(value).is_integer():
        raise ConfigError(f"{section}.{name} must be an integer, got {value!r}", field=name)
    if not math.isfinite(value):
        raise ConfigError(f"{section}.{name} must be finite, got {value!r}", field=name)
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(f"{section}.{name} must be {'>' if low_open else '>='} {low}, got {value!r}", field=name)
    if high is not None and (value >= high if high_open else value > high):
        raise ConfigError(f"{section}.{name} must be {'<' if high_open else '<='} {high}, got {value!r}", field=name)


def literal_values(hint: Any) -> tuple[Any, ...]:
    """The values of a ``Literal[...]`` hint (or of ``Literal[...] | None``, with None); ``()`` otherwise."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg) + ((None,) if type(None) in typing.get_args(hint) else ())
    return ()


#: The fields a preset sets: the objective (the six reconstruction weights and alpha), the encoder's view, the
#: straight-through's centring, how the decoder trains (frozen, LoRA adapters or the whole decoder, at its rate),
#: where the code goes and how the codebook starts, the decoder-posterior term and the number of steps.
RECIPE_FIELDS = (
    "reconstruction_weight",
    "sequence_reconstruction_weight",
    "token_weighted_weight",
    "normalized_concentration_corrected_token_weighted_weight",
    "normalized_inverse_surprisal_token_weighted_weight",
    "zfree_relative_weight",
    "token_weight_alpha",
    "encoder_view",
    "centered_straight_through",
    "decoder_training",
    "decoder_lr",
    "latent_placement",
    "codebook_init",
    "decoder_posterior_weight",
    "decoder_posterior_start",
    "decoder_posterior_target",
    "max_steps",
)
#: The recipe fields that are numbers >= 0: the six weights and alpha.
_WEIGHT_FIELDS = RECIPE_FIELDS[:7]
#: The objective and the view: what a preset given with ``--resume`` changes over the stored config (the
#: straight-through's centring, the decoder's training, the code's placement, the codebook's start, the
#: decoder-posterior term and the steps stay the run's, unless a flag or the file sets them).
OBJECTIVE_FIELDS = RECIPE_FIELDS[:8]


def _recipe(**values: Any) -> dict[str, Any]:
    """A preset's values: every recipe field; unless given, the six weights 0, the straight-through uncentred, the
    decoder frozen (decoder_lr 1e-4), the code before the prompt (prefix), the codebook started at k-means, no
    decoder-posterior term and 200 steps."""
    recipe: dict[str, Any] = {name: 0.0 for name in RECIPE_FIELDS[:6]}
    recipe.update(centered_straight_through=False, decoder_training="frozen", decoder_lr=1e-4)
    recipe.update(latent_placement="prefix", codebook_init="kmeans", max_steps=200)
    recipe.update(decoder_posterior_weight=0.0, decoder_posterior_start=0, decoder_posterior_target="hard")
    recipe.update(values)
    assert set(recipe) == set(RECIPE_FIELDS), sorted(set(recipe) ^ set(RECIPE_FIELDS))
    return recipe


#: The objective and view of the recipes since issue 22 (terms 1 + 3 at alpha 2, the token_weighted view): the
#: "default" and "frozen" presets', and what the centered-* presets add to.
_DEFAULT_OBJECTIVE: dict[str, Any] = dict(
    reconstruction_weight=1.0, token_weighted_weight=1.0, token_weight_alpha=2.0, encoder_view="token_weighted"
)

#: The default recipe: that objective, the centred straight-through wherever there is one (None: the discrete latent
#: with nearest codes; LatentConfig.centered_straight_through), LoRA adapters on the decoder at 1e-3, 240 steps.
_DEFAULT: dict[str, Any] = dict(
    _DEFAULT_OBJECTIVE, centered_straight_through=None, decoder_training="lora", decoder_lr=1e-3, max_steps=240
)

#: The centred straight-through and the whole decoder fine-tuned over the default objective: preset centered-full,
#: and what preset steer adds to.
_CENTERED_FULL: dict[str, Any] = dict(
    _DEFAULT_OBJECTIVE, centered_straight_through=True, decoder_training="full", decoder_lr=5e-5
)

#: Named recipes (``train --preset NAME``, ``sweep --preset NAME``, ``preset: NAME`` in a config file). Each sets
#: every field of :data:`RECIPE_FIELDS`. THE ONE PLACE the default recipe is written: the dataclass defaults of
#: those fields are ``PRESETS[DEFAULT_PRESET]``'s values, so a bare ``disentangle train``, ``--preset default`` and
#: ``configs/default.yaml`` train the same recipe; to change the default recipe, edit ``_DEFAULT`` here (tests pin
#: the measured values: tests/test_presets.py).
#: Precedence: dataclass defaults < preset < config file < flags.
PRESETS: dict[str, dict[str, Any]] = {
    # The default since issue 22's item 3 (docs/what-the-cvae-adds.md, sections 8, 33 and 34): terms 1 + 3 at alpha 2
    # with the encoder pooling by term 3's shares, the centred straight-through and LoRA adapters on the decoder (the
    # z-free reference: the adapters off), 240 steps. On prompts training never saw it takes two-factor's rare word
    # and style-in-echo's hidden style at NMI 1.000 on every seed, every code writes its value in every generation,
    # and the posterior NLL is 0.15-0.84 x raw reconstruction's with the same adapters. Term 3 takes the surprising
    # factor; term 1 trains every token, so the likelihood stays and the codes steer.
    "default": _recipe(**_DEFAULT),
    # The default's name in the tables (docs/what-the-cvae-adds.md's centered-lora-240): the same recipe.
    "centered-lora": _recipe(**_DEFAULT),
    # The default before the adapters (issue 22 item 1 to section 34): the same objective and view, the decoder
    # frozen, the straight-through uncentred, 200 steps. Cheaper (no adapters to train) but on held-out prompts it
    # takes style-in-echo's style on no seed at 0.9 and two-factor's word at 0.76-0.80 on two of three.
    "frozen": _recipe(**_DEFAULT_OBJECTIVE),
    # Term 3 alone at alpha 2 with the same view: the default before issue 22 (the thesis tables' recipe).
    "term3": _recipe(token_weighted_weight=1.0, token_weight_alpha=2.0, encoder_view="token_weighted"),
    # The seed notes' recipe: the token-weighted term added to the raw term (not replacing it), alpha 1, the
    # mean of the response states as the encoder's view (the tables' "terms 1 + 3, alpha 1" rows).
    "seed": _recipe(
        reconstruction_weight=1.0, token_weighted_weight=1.0, token_weight_alpha=1.0, encoder_view="mean_last"
    ),
    # Raw reconstruction: term 1 only, the mean view (the tables' baseline rows; the defaults before issue 23).
    "raw": _recipe(reconstruction_weight=1.0, token_weight_alpha=1.0, encoder_view="mean_last"),
    # The default objective with the centred straight-through and the whole decoder fine-tuned (float32; the
    # reference: a frozen copy): where the content the prompt predicts outweighs a hidden style in term 3's weights,
    # the decoder learns the content and the latent takes the style (style-in-content: NMI 0.52 over three seeds at
    # 240 steps of 8, k-means of the view 0.02, LoRA adapters 0.39; docs/what-the-cvae-adds.md, section 12). With
    # --latent-placement between --codebook-init random it takes and steers chatterbot-style's first-token marker
    # (NMI 0.53 in the mean of five seeds, k-means 0.03; section 15) and style-in-content's style (0.63 over three
    # seeds, read back from 0.91 of guided generations; section 16). Each step trains every decoder
    # weight, and the run holds the reference's copy and AdamW's moments of the whole decoder.
    "centered-full": _recipe(**_CENTERED_FULL),
    # centered-full with the code between prompt and response from a random codebook, 240 steps, and from step 180
    # the encoder taught the decoder's own likeliest code (the hard target): it takes two-factor's rare word and
    # style-in-echo's style on every seed of rows training had seen, whose codes write their factor in 31-32 of 32
    # generations there and style-in-content's in 0.94-0.97 guided, and beats k-means of its view on DailyDialog's
    # act by +0.059 over three seeds at K = 8 (docs/what-the-cvae-adds.md, sections 20-22). Discrete with nearest
    # codes only; K^M - 1 more decodes a step from step 180.
    "steer": _recipe(
        **_CENTERED_FULL,
        latent_placement="between",
        codebook_init="random",
        decoder_posterior_weight=1.0,
        decoder_posterior_start=180,
        max_steps=240,
    ),
}
#: One line per preset for ``--help`` and error messages.
PRESET_SUMMARIES: dict[str, str] = {
    "default": "terms 1 + 3 at alpha 2, encoder_view token_weighted, the centred straight-through, LoRA adapters "
    "at decoder_lr 1e-3, 240 steps (takes the surprising factor, steers, keeps the likelihood)",
    "centered-lora": "the default, by its name in the tables",
    "frozen": "the default's objective and view with the decoder frozen and the straight-through uncentred, 200 "
    "steps (the default before section 34; cheaper, weaker)",
    "term3": "term 3 only at alpha 2, encoder_view token_weighted (the default before issue 22)",
    "seed": "terms 1 + 3 at alpha 1, encoder_view mean_last (the seed notes' recipe)",
    "raw": "term 1 only (token-mean NLL), alpha 1, encoder_view mean_last (the baseline)",
    "centered-full": "terms 1 + 3 at alpha 2 plus centered_straight_through and the whole decoder fine-tuned at "
    "decoder_lr 5e-5 (the latent takes a style that the content outweighs; give it --max-steps 240)",
    "steer": "centered-full with the code between prompt and response from a random codebook, 240 steps, the "
    "encoder taught the decoder's likeliest code from step 180 (takes and steers a hidden factor on every seed; "
    "discrete, nearest codes)",
}
DEFAULT_PRESET = "default"


def _default(name: str) -> Any:
    """The dataclass default of a recipe field: the default preset's value."""
    return PRESETS[DEFAULT_PRESET][name]


def presets_help() -> str:
    """``NAME: summary; ...`` of every preset."""
    return "; ".join(f"{name}: {PRESET_SUMMARIES[name]}" for name in PRESETS)


def preset_values(name: Any) -> dict[str, Any]:
    """The field values of preset ``name``; :class:`ConfigError` listing the presets for an unknown one."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; the presets are {presets_help()}", field="preset")
    return dict(PRESETS[name])


@dataclass
class ReconstructionLossConfig:
    """Weights of the six reconstruction terms and the token-weighting parameters (docs/design.md sections 3-4)."""

    reconstruction_weight: float = option(
        _default("reconstruction_weight"), "Weight of the raw token-mean reconstruction term."
    )
    sequence_reconstruction_weight: float = option(
        _default("sequence_reconstruction_weight"), "Weight of the sequence-sum reconstruction term."
    )
    token_weighted_weight: float = option(
        _default("token_weighted_weight"),
        "Weight of the surprisal-share token-weighted reconstruction term.",
        flag="--token-weighted-reconstruction-weight",
    )
    normalized_concentration_corrected_token_weighted_weight: float = option(
        _default("normalized_concentration_corrected_token_weighted_weight"),
        "Weight of the concentration-corrected token-weighted term, divided by c_base.",
        flag="--normalized-concentration-corrected-token-weighted-reconstruction-weight",
    )
    normalized_inverse_surprisal_token_weighted_weight: float = option(
        _default("normalized_inverse_surprisal_token_weighted_weight"),
        "Weight of the inverse-surprisal token-weighted ablation term, divided by c_base.",
    )
    zfree_relative_weight: float = option(
        _default("zfree_relative_weight"), "Weight of the token-mean term divided by c_base."
    )
    token_weight_alpha: float = option(
        _default("token_weight_alpha"),
        "Temperature alpha >= 0 of the surprisal share b_t^alpha (0 gives uniform weights).",
        flag="--token-weighted-reconstruction-alpha",
    )
    token_weight_eps: float = option(
        1e-6, "Floor (> 0) on z-free surprisal, or on the token_weight_source signal, before the power."
    )
    token_weight_source: Literal["surprisal", "entropy", "dynamic"] = option(
        "surprisal",
        "What the token weights are a tempered share of: 'surprisal' = the reference's b_t (as in the seed notes); "
        "'entropy' = the reference's predictive entropy at the position; 'dynamic' = the training "
        "model's own current per-token NLL l_t (detached, recomputed every step).",
    )
    token_weight_interpolation: float = option(
        1.0,
        "lambda in [0, 1]: token weights (1 - lambda) m_t/n_b + lambda pi_t (0 = uniform, 1 = the share itself).",
    )
    zfree_reference_scale: float | None = option(
        None,
        "c_base, the global z-free reference scale; estimated on the training set when unset.",
        flag="--zfree-reference-scale",
    )

    def __post_init__(self) -> None:
        _check_types(self)
        for name in _WEIGHT_FIELDS:  # the six weights and alpha are >= 0
            _number(self, name, low=0)
        _number(self, "token_weight_eps", low=0, low_open=True)
        _number(self, "token_weight_interpolation", low=0, high=1)
        _number(self, "zfree_reference_scale", low=0, low_open=True, optional=True)


#: decoder_posterior_weight: at most this many code combinations (K^M), each one decoder pass a step.
DECODER_POSTERIOR_LIMIT = 64


@dataclass
class LatentConfig:
    """The latent variable: family, size, injection and the discrete assignment recipe."""

    latent: Literal["discrete", "continuous"] = option("discrete", "Latent family.")
    latent_placement: Literal["prefix", "between", "memory"] = option(
        _default("latent_placement"),
        "Where the latent embeddings go: 'prefix' = [z][x][y], 'between' = [x][z][y] (P soft input embeddings); "
        "'memory' = P key/value memory slots in every attention layer (Optimus-style), given to the decoder as a "
        "past-key-value cache in front of [x][y]: the decoder's own keys and values of the per-slot latent "
        "embeddings plus one learned linear map per layer (zero at the start, trained at encoder_lr); the "
        "sequence's positions are not shifted "
        "(alignment offsets 0) and the attention mask gains P leading ones. Needs a decoder whose layers all use "
        "full attention with a standard cache (Llama- or GPT-2-style; not sliding-window, linear-attention or "
        "encoder-decoder models).",
    )
    latent_tokens: int = option(
        4, "Number P of soft latent embeddings injected into the decoder (memory slots for placement 'memory')."
    )
    num_slots: int = option(1, "Discrete: number M of latent slots.")
    codebook_size: int = option(4, "Discrete: number K of codes in the shared codebook.")
    code_dim: int = option(64, "Discrete: dimension of each code of the shared codebook.")
    latent_dim: int = option(16, "Continuous: dimension of the Gaussian latent.")
    encoder_hidden: int = option(256, "Hidden width of the encoder and prior heads.")
    prior: Literal["learned", "fixed"] = option(
        "learned", "'learned' conditional prior p(z|x), or 'fixed' (uniform / standard normal)."
    )
    assignment: Literal["nearest", "gumbel"] = option(
        "nearest",
        "Discrete code choice: 'nearest' code with straight-through gradients, codebook and "
        "commitment losses and dead-code restart (default, measured to learn), or 'gumbel' sampling.",
    )
    posterior_temperature: float = option(
        1.0, "Discrete: posterior logits are -squared distance to the codes over this temperature."
    )
    gumbel_temperature: float = option(1.0, "Gumbel-softmax temperature at step 0.")
    gumbel_temperature_min: float = option(0.5, "Gumbel-softmax temperature after annealing.")
    gumbel_anneal_steps: int = option(1000, "Steps of exponential annealing to the minimum temperature.")
    straight_through: bool = option(True, "Gumbel: hard one-hot forward with soft gradients.")
    batch_prior_kl: bool = option(
        False, "Discrete: KL between the batch-averaged posterior and the prior instead of per example."
    )
    codebook_init: Literal["kmeans", "random", "prior_kmeans", "view_kmeans"] = option(
        _default("codebook_init"),
        "Discrete: start the codebook at k-means centroids of the initial encoder outputs over the training set "
        "(measured: random starts often merge two factors into one code), at random, or 'prior_kmeans': each "
        "code at the mean initial encoder output of one k-means cluster of the prior features (the prompt's "
        "last hidden state), a start that says nothing of the encoder's view; 'view_kmeans': likewise of k-means of the "
        "encoder's view itself (the partition of eval's encoder_kmeans baseline); only 'kmeans' refreshes.",
    )
    codebook_refresh_every: int = option(
        25,
        "Discrete, k-means init: re-fit the codebook to k-means of the encoder outputs every this many steps "
        "during the first half of training, matching each new centroid to the nearest old code (0 = never).",
    )
    codebook_decoder_gradient: bool = option(
        True,
        "Nearest: the decoder's gradient reaches the chosen code (at latent_lr) as well as, straight through, the "
        "encoder output; off: the codes move by the codebook loss only (VQ-VAE's rule), so the decoder cannot drag "
        "a code away from the encoder outputs it was chosen for.",
    )
    decoder_code_table: bool = option(
        False,
        "Discrete, nearest: the decoder reads each code from a table of its own (K x code_dim, started equal to the "
        "codebook, trained at latent_lr by the decoder's gradient, reset with its code at a dead-code restart, kept "
        "by a k-means refresh, which keeps code identities) instead of from the codebook: the codebook then only "
        "assigns (nearest code, moved by the codebook loss), so the decoder can separate the codes' meanings as fast "
        "as it likes without moving the partition (codebook_decoder_gradient is then moot).",
    )
    centered_straight_through: bool | None = option(
        _default("centered_straight_through"),
        "Nearest: every gradient that reaches the encoder outputs straight through the chosen code (the decoder's, "
        "the bag-of-words loss's) arrives minus its mean over the batch, per slot: no common part that moves every "
        "output the same way, the drift that carried them all onto one code (docs/what-the-cvae-adds.md, section 6). "
        "The mean is over each process's batch of batch_size examples (each micro-batch when accumulating); the "
        "commitment loss is not centred. true needs the discrete latent, assignment nearest and batch_size >= 2; "
        "null (the default recipe's) centres wherever those hold and not elsewhere (the continuous latent, "
        "assignment gumbel, batch_size 1).",
    )
    codebook_loss_weight: float = option(1.0, "Nearest: weight of ||sg(e) - E_k||^2 (moves codes).")
    commitment_weight: float = option(0.25, "Nearest: weight of ||e - sg(E_k)||^2 (commits the encoder).")
    dead_code_steps: int = option(
        10, "Nearest: a code unused for this many steps restarts at a recent encoder output (0 = never)."
    )
    decoder_posterior_weight: float = option(
        _default("decoder_posterior_weight"),
        "Discrete: weight of KL(r || q), which trains the encoder's posterior q(k | x, y) (the softmax of its "
        "logits) towards r(k | x, y), the exact posterior of the codes under the current decoder: "
        "r ∝ p(k | x) p(y | x, k), every code's sequence likelihood scored by a decoder pass without gradients "
        "(K^M - 1 more passes a step, the chosen code's reused), per slot the marginal. It reaches the encoder and "
        "the codebook, not the decoder, and reads the response's every token, so a factor decided at one position "
        "(a suffix) counts in full (0 = off).",
    )
    decoder_posterior_start: int = option(
        _default("decoder_posterior_start"),
        "Discrete: the first training step with decoder_posterior_weight's term (the codes mean something first).",
    )
    decoder_posterior_target: Literal["soft", "hard"] = option(
        _default("decoder_posterior_target"),
        "Discrete, decoder_posterior_weight: 'hard' = the cross-entropy -log q(k* | x, y) of the decoder's likeliest "
        "code k* = argmax r, whose gradient reaches the encoder only (the codebook, which the decoder reads, stays "
        "where the decoder's losses put it); 'soft' = KL(r || q), whose gradient reaches the encoder and the codebook "
        "(measured worse: docs/what-the-cvae-adds.md, section 18).",
    )
    bow_weight: float = option(0.0, "Weight of the bag-of-words loss predicting response tokens from z.")
    bow_token_weighting: Literal["uniform", "token_weighted"] = option(
        "uniform",
        "How bow_weight's loss weighs the response's tokens: 'uniform' = each token 1/n (Zhao, Zhao and Eskenazi "
        "2017); 'token_weighted' = term 3's weights pi_t, whatever their source (token_weight_alpha, "
        "token_weight_eps, token_weight_source, token_weight_interpolation): with the default surprisal source z "
        "is made to predict the words the reference finds surprising.",
    )
    word_dropout: float = option(
        0.0,
        "In [0, 1): in training, the share of response tokens the decoder reads as a zero vector instead of their "
        "embedding (Bowman et al. 2016's word dropout: what it cannot read it must take from z), drawn per token "
        "every step; the targets, the z-free reference and the encoder keep every token, and evaluation and "
        "generation never drop.",
    )
    encoder_view: Literal["mean_last", "token_weighted", "attention", "token_weighted_attention"] = option(
        _default("encoder_view"),
        "What the encoder q(z|x,y) pools of the reference's hidden states over the response, always "
        "concatenated with the last token's state: 'mean_last' = their mean (the seed notes' view); 'token_weighted' = "
        "sum_t pi_t h_t with term 3's token weights pi_t (token_weight_alpha, token_weight_eps, "
        "token_weight_source, token_weight_interpolation; for token_weight_source 'dynamic', which changes "
        "every step, the surprisal shares), computed in the frozen pass and cached; 'attention' = a learned "
        "query's softmax attention over the response positions (keys LayerNorm'ed, padding masked; the query "
        "starts at 0, i.e. at the mean, and trains at encoder_lr); its per-token states are cached, about "
        "4 x hidden size bytes per response token; 'token_weighted_attention' = that attention with log pi_t "
        "(token_weighted's weights) added to its logits, so it starts exactly at the token_weighted pool and "
        "its query can move it away.",
    )
    encoder_block: Literal["none", "mlp", "transformer"] = option(
        "none",
        "A trainable block over the cached per-token response states before the attention views' pool (only with "
        "encoder_view 'attention' or 'token_weighted_attention'): 'mlp' = a gated MLP per token, 'transformer' = one "
        "pre-norm transformer layer (self-attention over the response, then that MLP); both residual, their last "
        "projection zero at the start, so training starts from the view itself; trains at encoder_lr.",
    )
    encoder_lora_layers: int = option(
        0,
        "0 = the encoder pools the frozen pass's cached states. N > 0 = it pools the states of a pass of the "
        "reference LM over [x][y] with LoRA adapters of its own (encoder_lora_rank, on "
        "encoder_lora_target_modules) on the top N layers up to encoder_layer, run every step with gradients "
        "(not cacheable: one more forward and backward of those layers per step); the adapters start at zero, "
        "so the encoder starts from the cached view, and train at encoder_lr.",
    )
    encoder_lora_rank: int = option(8, "Rank of the encoder's LoRA adapters (encoder_lora_layers > 0).")
    encoder_lora_target_modules: list[str] = option(
        ["q_proj", "v_proj"], "Module names that get the encoder's LoRA adapters (encoder_lora_layers > 0)."
    )
    encoder_layer: int = option(
        -1,
        "Which hidden state of the reference the encoder and prior features come from: hidden_states[layer] "
        "(-1 = the last layer, after the final norm; 0 = the token embeddings; checked against the model's "
        "number of layers L: -(L+1) .. L). The z-free surprisal always comes from the last layer.",
    )

    def __post_init__(self) -> None:
        _check_types(self)
        if self.encoder_block != "none" and self.encoder_view not in ("attention", "token_weighted_attention"):
            raise ConfigError(
                f"LatentConfig.encoder_block {self.encoder_block!r} works on the per-token states that only the "
                f"attention views keep: set encoder_view to 'attention' or 'token_weighted_attention' (got "
                f"{self.encoder_view!r})",
                field="encoder_block",
            )
        for name in (
            "latent_tokens",
            "num_slots",
            "codebook_size",
            "code_dim",
            "latent_dim",
            "encoder_hidden",
            "encoder_lora_rank",
        ):
            _number(self, name, low=1, integer=True)
        if self.latent == "discrete" and self.codebook_size < 2:
            raise ConfigError(
                f"LatentConfig.codebook_size must be >= 2, got {self.codebook_size}", field="codebook_size"
            )
        for name in ("posterior_temperature", "gumbel_temperature", "gumbel_temperature_min"):
            _number(self, name, low=0, low_open=True)
        for name in (
            "gumbel_anneal_steps",
            "dead_code_steps",
            "codebook_refresh_every",
            "encoder_lora_layers",
            "decoder_posterior_start",
        ):
            _number(self, name, low=0, integer=True)
        for name in ("codebook_loss_weight", "commitment_weight", "bow_weight", "decoder_posterior_weight"):
            _number(self, name, low=0)
        _number(self, "word_dropout", low=0, high=1, high_open=True)
        if self.decoder_posterior_weight > 0 and self.latent == "discrete":
            combinations = self.codebook_size**self.num_slots
            if combinations > DECODER_POSTERIOR_LIMIT:
                raise ConfigError(
                    f"LatentConfig.decoder_posterior_weight scores every combination of codes, "
                    f"codebook_size ** num_slots = {self.codebook_size} ** {self.num_slots} = {combinations}, more "
                    f"than {DECODER_POSTERIOR_LIMIT} (each but the chosen one a decoder pass a step): use fewer codes or "
                    "slots, or set it to 0",
                    field="decoder_posterior_weight",
                )
        if self.encoder_lora_layers and not (
            self.encoder_lora_target_modules and all(map(str.strip, self.encoder_lora_target_modules))
        ):
            raise ConfigError(
                "LatentConfig.encoder_lora_target_modules must name at least one module for the encoder's adapters, "
                f"got {self.encoder_lora_target_modules!r}",
                field="encoder_lora_target_modules",
            )


@dataclass
class KLConfig:
    """KL between posterior and prior: beta schedule, free bits, per-token scaling."""

    beta: float = option(0.02, "Maximum KL weight beta.")
    beta_schedule: Literal["constant", "linear", "cyclical"] = option(
        "linear", "constant beta; linear warm-up from 0; or cyclical warm-ups (Fu et al. 2019)."
    )
    beta_warmup_steps: int = option(50, "Linear: steps from 0 to beta. Cyclical: rising part of each cycle.")
    beta_cycle_steps: int = option(200, "Cyclical: length of one cycle in steps.")
    free_bits: float = option(0.0, "Free bits in nats per latent dimension (continuous) or slot (discrete).")
    kl_per_token: bool = option(False, "Divide each example's KL by its number of response tokens n_b.")

    def __post_init__(self) -> None:
        _check_types(self)
        _number(self, "beta", low=0)
        _number(self, "free_bits", low=0)
        _number(self, "beta_warmup_steps", low=0, integer=True)
        _number(self, "beta_cycle_steps", low=1, integer=True)
        if self.beta_schedule == "cyclical" and self.beta_warmup_steps > self.beta_cycle_steps:
            raise ConfigError(
                f"KLConfig.beta_warmup_steps ({self.beta_warmup_steps}) must be <= beta_cycle_steps "
                f"({self.beta_cycle_steps}) for a cyclical schedule",
                field="beta_warmup_steps",
            )


@dataclass
class DivergenceConfig:
    """Token-weighted inter-latent divergence (discrete only, docs/design.md section 5)."""

    divergence_weight: float = option(0.0, "Weight of the divergence term (maximised: enters with a minus sign).")
    divergence: Literal["js", "kl"] = option(
        "js", "Per-token divergence: Jensen-Shannon or KL(posterior || alternative)."
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _number(self, "divergence_weight", low=0)


@dataclass
class ModelConfig:
    """The pretrained causal LM and how much of it trains."""

    model: str | None = option(
        None, "Local Hugging Face directory, .gguf file, or cached hub id; default: the embedded SmolLM2-135M."
    )
    model_cache_dir: str | None = option(
        None, "Where a dequantised GGUF is cached as safetensors (default: ~/.cache/disentanglement)."
    )
    decoder_training: Literal["frozen", "lora", "full"] = option(
        _default("decoder_training"),
        "Decoder weights: 'frozen'; 'lora' = LoRA adapters train (reference = adapters off); or 'full' = every "
        "decoder weight trains (reference = a frozen copy).",
    )
    lora_r: int = option(8, "LoRA rank.")
    lora_alpha: float = option(16.0, "LoRA scaling alpha.")
    lora_dropout: float = option(0.0, "LoRA dropout.")
    lora_target_modules: list[str] | None = option(
        None,
        "Module names that get LoRA adapters; null (the default): peft's choice for the architecture, the "
        "attention's query and value projections (q_proj and v_proj for Llama, SmolLM2 included; c_attn for GPT-2).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        "Decoder weights dtype: auto = bfloat16 on CUDA and on a CPU with bf16 matmul instructions "
        "(AMX-BF16, AVX512-BF16), else float32, and float32 for decoder_training full; bfloat16 halves the "
        "decoder's memory. The CVAE's heads, optimizer state and every loss stay float32.",
    )
    gradient_checkpointing: bool = option(
        False,
        "Activation (gradient) checkpointing of the decoder's layers in the training steps (transformers' "
        "non-reentrant checkpointing): each layer keeps only its input and recomputes the rest in the backward, "
        "trading about one more decoder forward per step for the activation memory; the same loss and gradients. "
        "For every decoder_training, frozen included (its backward still runs through the decoder to the "
        "latent). The no-grad frozen (z-free) pass is unaffected. Not with latent_placement 'memory'.",
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _number(self, "lora_r", low=1, integer=True)
        _number(self, "lora_alpha", low=0, low_open=True)
        _number(self, "lora_dropout", low=0, high=1)
        if (
            self.decoder_training == "lora"
            and self.lora_target_modules is not None
            and not (self.lora_target_modules and all(map(str.strip, self.lora_target_modules)))
        ):
            raise ConfigError(
                f"ModelConfig.lora_target_modules must name at least one module for LoRA, got {self.lora_target_modules!r}",
                field="lora_target_modules",
            )


@dataclass
class DataConfig:
    """Prompt/response pairs: source, keys, chat template, length caps and the split."""

    data: str = option("chatterbot", "A JSONL file, or 'chatterbot' for the built-in English corpus.")
    prompt_key: str = option("prompt", "JSONL key of the prompt.")
    response_key: str = option("response", "JSONL key of the response.")
    label_key: str = option("label", "JSONL key of the optional label.")
    chat_template: bool = option(True, "Apply the tokenizer's chat template when it has one.")
    max_prompt_tokens: int = option(64, "Prompt cap in tokens; longer prompts keep their last tokens.")
    max_response_tokens: int = option(64, "Response cap in tokens; longer responses keep their first tokens.")
    validation_fraction: float = option(0.1, "Fraction of examples held out for validation.")
    max_examples: int | None = option(None, "Use at most this many examples (after shuffling by seed).")

    def __post_init__(self) -> None:
        _check_types(self)
        _number(self, "max_prompt_tokens", low=1, integer=True)
        _number(self, "max_response_tokens", low=1, integer=True)
        _number(self, "validation_fraction", low=0, high=0.9)
        _number(self, "max_examples", low=1, integer=True, optional=True)


@dataclass
class TrainConfig:
    """Optimisation, logging and checkpointing."""

    output_dir: str = option("runs/default", "Run directory: metrics, config and checkpoints.")
    max_steps: int = option(_default("max_steps"), "Optimizer steps.")
    batch_size: int = option(8, "Examples per micro-batch.")
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.")
    group_by_length: bool = option(
        False,
        "Batch examples of similar length (megabatches of 50 batches sorted by length, the batches shuffled; every "
        "example once per epoch): less padding, but where a factor goes with length a batch holds one value of it, "
        "which can stop the latent from learning it (measured: benchmarks/README.md, Speed); with several processes the "
        "last one gets the longest slice of each batch. Off: uniform shuffling.",
    )
    encoder_lr: float = option(1e-3, "Learning rate of the encoder and prior heads.")
    latent_lr: float = option(3e-2, "Learning rate of the codebook and latent projection (prompt-tuning rate).")
    codebook_lr: float | None = option(
        None,
        "Learning rate of the discrete CVAE's codebook alone, in an optimizer group of its own (None: latent_lr, in "
        "the latent projection's group, as before; in a group of its own at latent_lr when encoder_hold_steps is "
        "set). Changeable on resume only between two values (not from or to None: that changes the groups).",
    )
    decoder_lr: float = option(_default("decoder_lr"), "Learning rate of LoRA adapters or decoder weights.")
    encoder_hold_steps: int = option(
        0,
        "Steps at the start during which the encoder's optimizer group (encoder and prior heads, the attention view's "
        "query and block, the bag-of-words head) and the discrete codebook stay at their start (learning rate 0; no "
        "dead-code restart or k-means refresh either) while the latent projection learns to decode each code; from "
        "then they train with their own warm-up (whose first factor is 0, as every group's at step 0) and the cosine "
        "decay to max_steps. Not with latent_placement 'memory'. Measured: docs/what-the-cvae-adds.md.",
    )
    weight_decay: float = option(0.0, "AdamW weight decay.")
    warmup_steps: int = option(10, "Linear learning-rate warm-up before the cosine decay.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (the norm before clipping is logged).")
    seed: int = option(0, "Seed for the split, initialisation, sampling and data order.")
    save_every: int = option(50, "Checkpoint every this many steps (and at the end).")
    eval_every: int = option(100, "Validate every this many steps (0 = only at the end).")
    eval_batches: int = option(8, "Validation batches per evaluation.")
    keep_checkpoints: int = option(2, "Complete checkpoints kept (older ones are deleted).")
    resume: str | None = option(
        None,
        "'auto' = the newest checkpoint in output_dir that reads back completely, or a checkpoint path; "
        "refused if a field that changes what is trained differs from the checkpoint's.",
    )
    overwrite: bool = option(
        False, "Replace the run already in output_dir (its checkpoints, metrics and config; the feature cache stays)."
    )
    tensorboard: bool = option(False, "Also log to TensorBoard under output_dir/tensorboard.")
    max_nonfinite_steps: int = option(5, "Stop with a diagnostic after this many consecutive non-finite losses.")
    max_loss_ratio: float = option(
        100.0,
        "Stop with a diagnostic when the token-mean reconstruction exceeds this many times c_base, or the loss this "
        "many times its running median (0 = never).",
    )
    feature_cache: bool = option(
        True, "Run the frozen pass once per data set and reuse it (off: one frozen pass every step)."
    )
    feature_cache_dir: str | None = option(
        None,
        "The frozen-pass cache shared by every run (default: $DISENTANGLEMENT_FEATURE_CACHE, else "
        "~/.cache/disentanglement/features); keyed by the reference's weights and each example's token ids.",
    )
    feature_cache_max_gb: float | None = option(
        None,
        "Size limit of the frozen-pass cache in GB; the least recently used entries go first "
        "(default: $DISENTANGLEMENT_FEATURE_CACHE_MAX_GB, else 20).",
    )
    device: Literal["auto", "cpu", "cuda"] = option("auto", "auto = CUDA with bf16 when present, else CPU.")
    progress: bool = option(True, "Show a progress bar.")

    def __post_init__(self) -> None:
        _check_types(self)
        if not self.output_dir.strip():
            raise ConfigError("TrainConfig.output_dir must name a directory, got ''", field="output_dir")
        for name in (
            "max_steps",
            "batch_size",
            "gradient_accumulation_steps",
            "save_every",
            "eval_batches",
            "keep_checkpoints",
            "max_nonfinite_steps",
        ):
            _number(self, name, low=1, integer=True)
        for name in ("warmup_steps", "eval_every", "seed", "encoder_hold_steps"):
            _number(self, name, low=0, integer=True)
        _number(self, "feature_cache_max_gb", low=0, low_open=True, optional=True)
        _number(self, "codebook_lr", low=0, low_open=True, optional=True)
        for name in ("encoder_lr", "latent_lr", "decoder_lr", "max_grad_norm"):
            _number(self, name, low=0, low_open=True)
        _number(self, "weight_decay", low=0)
        _number(self, "max_loss_ratio", low=0)
        if self.encoder_hold_steps >= self.max_steps:
            raise ConfigError(
                f"TrainConfig.encoder_hold_steps must be below max_steps ({self.max_steps}), got "
                f"{self.encoder_hold_steps}: the encoder would never train",
                field="encoder_hold_steps",
            )


@dataclass(frozen=True)
class Scoring:
    """How scoring a trained CVAE estimates what it cannot enumerate (``evaluation.score_batch``): the
    ``iw_samples`` posterior samples of the importance-weighted bound, the ``prior_samples`` latents of
    the prior mixture when it is not exact, and ``exact_limit``, the largest number of discrete code
    combinations the prior mixture enumerates exactly. The defaults of ``eval``, ``encode`` and
    ``inspect``."""

    iw_samples: int = 8
    prior_samples: int = 16
    exact_limit: int = 64

    def __post_init__(self) -> None:
        for name, low in (("iw_samples", 1), ("prior_samples", 1), ("exact_limit", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"Scoring.{name} must be an integer >= {low}, got {value!r}", field=name)


#: The default :class:`Scoring` (frozen, so one instance serves as every function's default).
DEFAULT_SCORING = Scoring()


@dataclass
class RunConfig:
    """A whole run: one section per concern."""

    reconstruction: ReconstructionLossConfig = field(default_factory=ReconstructionLossConfig)
    latent: LatentConfig = field(default_factory=LatentConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.divergence.divergence_weight > 0 and self.latent.latent != "discrete":
            raise ConfigError(
                f"DivergenceConfig.divergence_weight is {self.divergence.divergence_weight}, but the inter-latent "
                f"divergence exists only for the discrete latent (LatentConfig.latent is {self.latent.latent!r})",
                field="divergence_weight",
            )

        discrete_only = {
            "codebook_lr": self.train.codebook_lr is not None,
            "decoder_code_table": self.latent.decoder_code_table,
            "decoder_posterior_weight": self.latent.decoder_posterior_weight > 0,
        }
        for name, given in discrete_only.items():
            if given and self.latent.latent != "discrete":
                raise ConfigError(
                    f"{name} is set, but there is a codebook only with the discrete latent (LatentConfig.latent is "
                    f"{self.latent.latent!r})",
                    field=name,
                )
        if self.latent.centered_straight_through:  # true, not null (where it applies: centers_straight_through)
            if self.latent.latent != "discrete" or self.latent.assignment != "nearest":
                what = (
                    f"latent {self.latent.latent!r} has no nearest code"
                    if self.latent.latent != "discrete"
                    else f"assignment {self.latent.assignment!r} has no straight-through path"
                )
                raise ConfigError(
                    "LatentConfig.centered_straight_through centres the straight-through gradient of the nearest "
                    f"code: it needs the discrete latent with assignment 'nearest' ({what})",
                    field="centered_straight_through",
                )
            if self.train.batch_size < 2:
                raise ConfigError(
                    "LatentConfig.centered_straight_through needs TrainConfig.batch_size >= 2: the gradient minus its "
                    f"mean over a batch of {self.train.batch_size} is zero, and the encoder would never learn",
                    field="centered_straight_through",
                )
        if self.latent.decoder_posterior_weight > 0 and self.latent.decoder_posterior_start >= self.train.max_steps:
            raise ConfigError(
                f"LatentConfig.decoder_posterior_start ({self.latent.decoder_posterior_start}) must be below "
                f"TrainConfig.max_steps ({self.train.max_steps}) while decoder_posterior_weight is set "
                f"({self.latent.decoder_posterior_weight:g}): the term would never run; set decoder_posterior_start "
                "for your max_steps (preset steer starts it at 180 of 240 steps, 3/4 of the run), or "
                "decoder_posterior_weight 0",
                field="decoder_posterior_start",
            )
        if self.latent.decoder_posterior_weight > 0 and self.latent.assignment != "nearest":
            raise ConfigError(
                "LatentConfig.decoder_posterior_weight needs assignment 'nearest': the decoder's posterior reuses the "
                "training decode for the chosen code, and with 'gumbel' the decoder reads a sampled or soft mix of codes, "
                f"not the argmax code (got assignment {self.latent.assignment!r})",
                field="decoder_posterior_weight",
            )
        if self.latent.decoder_code_table and self.latent.assignment != "nearest":
            raise ConfigError(
                "LatentConfig.decoder_code_table needs assignment 'nearest' (the codebook assigns, the table is what "
                f"the decoder reads); with {self.latent.assignment!r} the soft weights mix the codebook itself",
                field="decoder_code_table",
            )
        if self.train.encoder_hold_steps and self.latent.latent_placement == "memory":
            raise ConfigError(
                "TrainConfig.encoder_hold_steps cannot be used with LatentConfig.latent_placement 'memory': the "
                "memory slots' projection trains in the encoder's optimizer group, which the hold holds",
                field="encoder_hold_steps",
            )
        if self.model.gradient_checkpointing and self.latent.latent_placement == "memory":
            raise ConfigError(
                "ModelConfig.gradient_checkpointing cannot be used with LatentConfig.latent_placement 'memory': "
                "transformers' checkpointed layers drop the past-key-value cache that holds the memory slots; "
                "use latent_placement 'prefix' or 'between', or turn gradient_checkpointing off",
                field="gradient_checkpointing",
            )

    @property
    def centers_straight_through(self) -> bool:
        """Whether the run centres the straight-through gradient: ``centered_straight_through`` where given; null
        (the default recipe's) wherever there is a nearest code's straight-through to centre and a batch to centre
        it over (the discrete latent, assignment nearest, batch_size >= 2)."""
        given = self.latent.centered_straight_through
        if given is not None:
            return given
        return self.latent.latent == "discrete" and self.latent.assignment == "nearest" and self.train.batch_size >= 2

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}  # type: ignore[misc]


def field_flag(f: dataclasses.Field) -> str:
    """The command-line flag of a config field."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def flag_spellings(name: str, flag: str) -> tuple[str | None, list[str]]:
    """The other option strings of a field named ``name`` whose flag is ``flag``: ``(alias, hidden)``.

    ``alias`` is ``--field-name`` where that differs from the flag (``--token-weighted-weight`` beside
    ``--token-weighted-reconstruction-weight``; the help text names it), else None; ``hidden`` (accepted, not
    listed in ``--help``) are the flag and the alias with underscores (``--token_weighted_weight``). So a config
    field's name works as a flag (:func:`register_flag_aliases`), and a flag's name as a config key
    (:data:`FIELD_ALIASES`)."""
    dashed = "--" + name.replace("_", "-")
    alias = dashed if dashed != flag else None
    spelled = [flag] + ([alias] if alias else [])
    hidden = [s for s in dict.fromkeys("--" + t[2:].replace("-", "_") for t in spelled) if s not in spelled]
    return alias, hidden


def _field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"config field {f.name} appears in two sections"
            index[f.name] = (section, f)
    return index


FIELDS = _field_index()


def _alias_index() -> dict[str, str]:
    """Every accepted spelling of a config field -> its name: the name, the flag without its dashes, and each
    with ``-`` for ``_`` and the other way round (``token-weighted-reconstruction-weight`` -> ``token_weighted_weight``)."""
    aliases: dict[str, str] = {}
    for name, (_, f) in FIELDS.items():
        flag = field_flag(f)[2:]
        for spelling in (name, name.replace("_", "-"), flag, flag.replace("-", "_")):
            assert aliases.get(spelling, name) == name, f"{spelling!r} names two config fields"
            aliases[spelling] = name
    return aliases


#: Spelling (field name or flag name, with ``_`` or ``-``) -> config field name.
FIELD_ALIASES = _alias_index()


def canonical_field(key: Any) -> str | None:
    """The config field that ``key`` names (a field name or a flag's name, with or without the leading ``--``,
    with ``_`` or ``-``), or None."""
    if not isinstance(key, str):
        return None
    return FIELD_ALIASES.get(key[2:] if key.startswith("--") else key)


def unknown_field_message(key: Any) -> str:
    """``unknown config field 'x'`` with the closest field names, if any."""
    import difflib

    close = difflib.get_close_matches(str(key).lstrip("-"), list(FIELD_ALIASES), n=3, cutoff=0.75)
    names = list(dict.fromkeys(FIELD_ALIASES[c] for c in close))
    return f"unknown config field {key!r}" + (f" (did you mean {' or '.join(map(repr, names))}?)" if names else "")


def base_type(hint: Any) -> Any:
    """``float | None`` -> ``float``; ``Literal[...]`` -> type of its values."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    if typing.get_origin(hint) is Literal:
        return type(typing.get_args(hint)[0])
    return hint


#: the words an optional field's flag takes for null
NULL_WORDS = ("null", "none")


def _optional(text: str, cast: Any) -> Any:
    return None if text.lower() in NULL_WORDS else cast(text)


def register_flag_aliases(
    parser: argparse.ArgumentParser, flag: str, aliases: list[str | None], negatable: bool = False
) -> None:
    """Record other spellings of ``flag`` in ``parser.flag_aliases`` (with ``--no-`` forms when ``negatable``);
    ``cli.ArgumentParser`` rewrites them to ``flag`` before parsing (they are not actions of their own, so
    ``--help`` and the parser's actions list each flag once)."""
    table = parser.__dict__.setdefault("flag_aliases", {})
    for alias in filter(None, aliases):
        pairs = [(alias, flag)] + ([("--no-" + alias[2:], "--no-" + flag[2:])] if negatable else [])
        for spelled, target in pairs:
            assert table.get(spelled, target) == target, f"{spelled} would stand for two flags"
            table[spelled] = target


def flag_metavar(flag: str) -> str:
    """``--token-weighted-reconstruction-weight`` -> ``TOKEN_WEIGHTED_RECONSTRUCTION_WEIGHT``."""
    return flag.lstrip("-").replace("-", "_").upper()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default printed once: not appended to a help text that already states one, and not for a
    default that says nothing (None, False); lines are not broken inside a hyphenated flag name."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        # not inside a flag's name: "--token-weighted-weight" stays on one line
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default is None or action.default is False:
            return help_text
        return super()._get_help_string(action)


class OptionalBooleanAction(argparse.BooleanOptionalAction):
    """The flag of a ``bool | None`` field: ``--flag`` (true), ``--no-flag`` (false), ``--flag {true,false,null}``
    (``none`` also for null, as for every optional field's flag)."""

    VALUES = {"true": True, "false": False, **dict.fromkeys(NULL_WORDS)}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nargs = "?"
        self.choices = list(self.VALUES)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        if option_string and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value, got {values!r}")
            setattr(namespace, self.dest, False)
        else:
            setattr(namespace, self.dest, True if values is None else self.VALUES[values])


class OptionalListAction(argparse.Action):
    """The flag of a ``list[...] | None`` field: ``--flag A B ...`` (the list), ``--flag none`` (or ``null``) alone."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        nulls = [v for v in values if v.lower() in NULL_WORDS]
        if nulls and len(values) > 1:
            parser.error(f"{option_string} takes {nulls[0]} alone (null) or a list without it, got {values}")
        setattr(namespace, self.dest, None if nulls else values)


def add_config_arguments(parser: argparse.ArgumentParser, sections: list[str] | None = None) -> None:
    """Add one flag per config field of the given sections (all by default).

    Flags default to ``argparse.SUPPRESS`` so that only what the user typed overrides the file.
    """
    for section, cls in SECTIONS.items():
        if sections is not None and section not in sections:
            continue
        group = parser.add_argument_group(f"{section} ({cls.__name__})")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert "argparse" not in f.metadata, f"{cls.__name__}.{f.name}: a config field takes no argparse extras"
            hint = hints[f.name]
            base = base_type(hint)
            optional = type(None) in typing.get_args(hint)
            kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = f.metadata["help"]
            # the default once: a help text that already states its default keeps its own words; None says nothing
            stated = "default" in help_text.lower() or default is None
            kwargs["help"] = help_text if stated else f"{help_text} (default: {default})"
            choices = [c for c in literal_values(hint) if c is not None]
            alias, hidden = flag_spellings(f.name, field_flag(f))
            if alias:
                kwargs["help"] += f" Also {alias}."
            if base is bool:
                kwargs["action"] = OptionalBooleanAction if optional else argparse.BooleanOptionalAction
            elif typing.get_origin(base) is list:
                kwargs["nargs"] = "+"
                kwargs["metavar"] = flag_metavar(field_flag(f))
                if optional:  # FLAG none (or null) alone: null
                    kwargs["action"] = OptionalListAction
            else:
                cast = base if base in (int, float, str) else str
                kwargs["type"] = (lambda text, c=cast: _optional(text, c)) if optional else cast
                if choices:  # listed in --help and the usage as {a,b,c}
                    kwargs["choices"] = choices
                else:
                    kwargs["metavar"] = flag_metavar(field_flag(f))
            group.add_argument(field_flag(f), **kwargs)
            register_flag_aliases(parser, field_flag(f), [alias, *hidden], negatable=base is bool)


class _DuplicateKey(Exception):
    """A key given twice in one mapping of a config file (``line`` and ``first_line`` are 1-based, or None)."""

    def __init__(self, key: Any, line: int | None = None, first_line: int | None = None) -> None:
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last),
    and that numbers are read as in YAML 1.2 and JSON (see the resolvers below: ``1e-3`` is a float, ``1_0``
    a string, ``017`` is 17).

    Keys merged in with ``<<`` may still be overridden, as YAML intends.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise _DuplicateKey(key, line, first)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# Numbers as in YAML 1.2's core schema (and JSON), not PyYAML's YAML 1.1: ``1_0`` and ``1:30`` are strings
# (1.1 reads 10 and 90), ``017`` is 17 (1.1: octal 15), ``0o17`` is 15, ``1e-3`` is a float (1.1: a string).
# Booleans and null stay PyYAML's (``yes``/``no`` are booleans, which a typed field then refuses or accepts).
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
YamlLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _construct_int_12(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 core integer: decimal (leading zeros allowed), ``0o`` octal or ``0x`` hexadecimal."""
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text, 10)


YamlLoader.add_constructor(_INT, _construct_int_12)


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of :func:`json.loads` that rejects a key given twice in one object."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Flat ``{field: value}`` from a YAML or JSON file (flat or nested by section), with ``preset`` when the
    file names one at its top level (:func:`build_config` applies it).

    A key given twice in one mapping, or a field given both flat and inside its section, is a
    :class:`ConfigError` naming the key and the file (PyYAML and ``json`` would silently keep the last).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc}") from exc
    try:
        raw = (
            json.loads(text, object_pairs_hook=_unique_json_object)
            if kind == "JSON"
            else yaml.load(text, Loader=YamlLoader)  # a SafeLoader subclass
        )
    except _DuplicateKey as dup:
        where = f" on line {dup.line} (first on line {dup.first_line})" if dup.line is not None else ""
        raise ConfigError(
            f"config file {path}: duplicate key {dup.key!r}{where}; each key may be given only once"
        ) from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path} is not valid {kind}: {exc}") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: expected a mapping of field names to values, got {type(raw).__name__}")
    flat: dict[str, Any] = {}
    given_as: dict[str, str] = {}

    def put(name: str, value: Any, spelled: str) -> None:
        if name in flat:
            raise ConfigError(
                f"config file {path}: field {name!r} is given twice (as {given_as[name]!r} and as {spelled!r}); "
                "each field may be given only once",
                field=name,
            )
        flat[name] = value
        given_as[name] = spelled

    for key, value in raw.items():
        if key == PRESET_KEY:
            put(key, value, key)
        elif key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                name = canonical_field(sub_key)  # a field's name or its flag's, with - or _
                if name is None or FIELDS[name][0] != key:
                    raise ConfigError(f"config file {path}: unknown key {key}.{sub_key}")
                put(name, sub_value, f"{key}.{sub_key}")
        elif canonical_field(key) is not None:
            put(canonical_field(key), value, key)
        elif key in SECTIONS:
            raise ConfigError(
                f"config file {path}: section {key!r} must be a mapping of its field names to values, "
                f"got {value!r} ({type(value).__name__})"
            )
        else:
            raise ConfigError(
                f"config file {path}: {unknown_field_message(key).replace('config field', 'key')} "
                "(expected a field name, a flag name or a section)"
            )
    return flat


#: The key that names a preset in a flat ``{field: value}`` dict and at the top of a config file.
PRESET_KEY = "preset"


def build_config(values: dict[str, Any] | None = None) -> RunConfig:
    """A validated :class:`RunConfig` from flat ``{field: value}`` (unknown keys are an error). A key may be a
    field's name or its flag's (``token-weighted-reconstruction-weight``), with ``-`` or ``_``.

    ``values`` may name a preset under ``"preset"``: its fields go under every field given, so the order is
    dataclass defaults < preset < ``values``.
    """
    values = dict(values or {})
    preset = preset_values(values.pop(PRESET_KEY)) if PRESET_KEY in values else {}
    given: dict[str, Any] = {}
    spelled: dict[str, Any] = {}
    for key, value in values.items():
        name = canonical_field(key)
        if name is None:
            raise ConfigError(unknown_field_message(key))
        if name in spelled:
            raise ConfigError(f"config field {name!r} is given twice (as {spelled[name]!r} and as {key!r})", field=name)
        spelled[name] = key
        given[name] = value
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in {**preset, **given}.items():
        per_section[FIELDS[name][0]][name] = value
    return RunConfig(**{s: SECTIONS[s](**kw) for s, kw in per_section.items()})


def resolve_config(config_file: str | Path | None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """File values, then command-line overrides on top, validated. A preset (``preset`` in the file or in
    ``overrides``, the override's winning) goes under both: dataclass defaults < preset < file < overrides.

    An invalid value that came from the file (not overridden) is reported as
    ``config file PATH: <the error>``.
    """
    file_values = read_config_file(config_file) if config_file else {}
    overrides = dict(overrides or {})
    values = {**file_values, **overrides}
    try:
        return build_config(values)
    except ConfigError as exc:
        if exc.field is not None and exc.field in file_values and exc.field not in overrides:
            raise ConfigError(f"config file {config_file}: {exc}", field=exc.field) from exc
        raise


def config_from_namespace(args: argparse.Namespace) -> RunConfig:
    """The config of a parsed command line: ``--config`` file, then every flag given."""
    overrides = {k: v for k, v in vars(args).items() if k in FIELDS or k == PRESET_KEY}
    return resolve_config(getattr(args, "config", None), overrides)


def load_run_config(path: str | Path) -> RunConfig:
    """Read back a resolved config written by :func:`write_run_config`."""
    return resolve_config(path)


def write_run_config(config: RunConfig, path: str | Path) -> None:
    from .safe_io import atomic_write

    atomic_write(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
