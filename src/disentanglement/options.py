"""The options of the subcommands that work on a checkpoint: ``eval``, ``generate``, ``inspect`` and ``encode``.

Each subcommand's flags are built from one frozen options dataclass (:data:`SUBCOMMAND_OPTIONS`:
:class:`EvalOptions`, :class:`GenerateOptions`, :class:`InspectOptions`, :class:`EncodeOptions`,
:class:`RefitOptions`, sharing
:class:`CheckpointOptions` and :class:`DataOptions`) with ``config.option``, as ``train``'s are built from
the config dataclasses: each default is stated once, in its field, and a field cannot lack its flag.
``commands.py``'s ``run_*`` functions take such an instance, with keyword overrides on top.

Every numeric field states the values it accepts (its :class:`Range`, made with :func:`ranged`), and an
instance checks them when it is made (``__post_init__``, as the config dataclasses do), so a flag out of range
is a ``ValueError`` naming it while the command line is read, before any model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from .config import (
    Scoring,
    base_type,
    field_flag,
    flag_metavar,
    flag_spellings,
    literal_values,
    option,
    register_flag_aliases,
)


def check_at_least(flag: str, value: int | None, low: int, *, optional: bool = False) -> None:
    """A ``ValueError`` naming ``flag`` unless ``value`` is an integer >= ``low`` (or None when optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class Range:
    """The values a numeric option accepts: ``low`` (excluded with ``low_open``) up to ``high`` (included)."""

    low: float
    high: float | None = None
    integer: bool = True
    low_open: bool = False

    def check(self, flag: str, value: Any) -> None:
        """A ``ValueError`` naming ``flag``, what it must be and what it got, unless ``value`` is in range."""
        if self.integer:
            check_at_least(flag, value, int(self.low))
            return
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > self.low if self.low_open else value >= self.low)
        ok = ok and (self.high is None or value <= self.high)
        if not ok:
            low = f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
            what = f"in ({self.low:g}, {self.high:g}]" if self.high is not None and self.low_open else low
            if self.high is not None and not self.low_open:
                what = f"in [{self.low:g}, {self.high:g}]"
            raise ValueError(f"{flag} must be a finite number {what}, got {value!r}")


def ranged(default: Any, help: str, accepts: Range, flag: str | None = None, **argparse_kwargs: Any) -> Any:
    """:func:`config.option` of a numeric field, with the values it ``accepts`` (``metadata["range"]``,
    checked when an instance is made)."""
    made = option(default, help, flag, **argparse_kwargs)
    made.metadata = types.MappingProxyType({**made.metadata, "range": accepts})
    return made


def option_range(f: dataclasses.Field) -> Range | None:
    """The :class:`Range` of a field made with :func:`ranged` (None for any other field)."""
    return f.metadata.get("range")


def numeric_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of an options dataclass whose type is an int or a float (optional or not)."""
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls) if base_type(hints[f.name]) in (int, float)]


def check_numeric_options(options: Any) -> None:
    """Every numeric option of ``options`` in its range (:func:`option_range`) (None where the field allows it),
    else a ``ValueError`` naming the flag: before the model loads."""
    hints = typing.get_type_hints(type(options))
    for f in numeric_fields(type(options)):
        value = getattr(options, f.name)
        if value is None and type(None) in typing.get_args(hints[f.name]):
            continue
        bound = option_range(f)
        if bound is None:  # a mistake in this module, not in the input: tests/test_reliability.py walks them all
            raise TypeError(f"{type(options).__name__}.{f.name} is numeric and has no range (make it with ranged())")
        bound.check(field_flag(f), value)


#: A field with no default: its flag is required.
REQUIRED: Any = dataclasses.MISSING


def add_option_arguments(
    parser: argparse.ArgumentParser, cls: type, descriptions: dict[str, str] | None = None
) -> None:
    """One flag per field of the options dataclass ``cls`` (``--field-name``, or the field's ``flag``), its
    default the field's (shown by ``ArgumentDefaultsHelpFormatter``), ``dest`` the field's name.

    As :func:`config.add_config_arguments` for ``train``: the type comes from the type hint, a ``Literal`` gives
    the choices; a bool that defaults to True gets ``--no-...`` (``BooleanOptionalAction``), one that defaults to
    False is a switch (``store_true``); a list is ``action="append"`` (repeat the flag). ``descriptions`` maps a
    group title to its description (default :data:`GROUP_DESCRIPTIONS`).
    """
    groups: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        extra = dict(f.metadata.get("argparse", {}))
        title = extra.pop("group", None)
        if title is None:
            target = parser
        elif title in groups:
            target = groups[title]
        else:
            target = groups[title] = parser.add_argument_group(
                title, (GROUP_DESCRIPTIONS if descriptions is None else descriptions).get(title)
            )
        hint = hints[f.name]
        base = base_type(hint)
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs["required"] = True
            default = None
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kwargs["default"] = default
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif typing.get_origin(base) is list:
            (item,) = typing.get_args(base)
            kwargs.update(action="append", type=item)
        else:
            kwargs["type"] = base if base in (int, float, str) else str
            choices = [c for c in literal_values(hint) if c is not None]
            if choices:
                kwargs["choices"] = choices
            if not choices:
                kwargs["metavar"] = flag_metavar(field_flag(f))  # named after the flag, not the field
        kwargs.update(extra)
        alias, hidden = flag_spellings(f.name, field_flag(f))
        target.add_argument(field_flag(f), **kwargs)
        # the field's name works as a flag too (--traverse-range for --range; accepted, not listed)
        negatable = kwargs.get("action") is argparse.BooleanOptionalAction
        register_flag_aliases(parser, field_flag(f), [alias, *hidden], negatable=negatable)


def options_from(cls: type, args: argparse.Namespace) -> Any:
    """The ``cls`` options of a parsed command line (every field has its flag)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def with_overrides(cls: type, options: Any, overrides: dict[str, Any]) -> Any:
    """``options`` (default ``cls()``) with the keyword ``overrides`` (the ``run_*`` functions' keywords)."""
    return cls(**overrides) if options is None else dataclasses.replace(options, **overrides)


_DATA_HELP = "validation, train, chatterbot or a .jsonl file"


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Options of every subcommand that loads a checkpoint."""

    device: Literal["auto", "cpu", "cuda"] = option("auto", "where to run the model")
    seed: int = ranged(0, "seed of every sample drawn (results are deterministic)", Range(0))

    def __post_init__(self) -> None:
        check_numeric_options(self)  # every subclass's fields too: a flag out of range fails before a model loads


@dataclass(frozen=True, kw_only=True)
class DataOptions(CheckpointOptions):
    """Options of the subcommands that score a data set with a checkpoint: ``eval``, ``inspect``, ``encode``."""

    data: str = option("validation", _DATA_HELP)
    max_examples: int | None = ranged(None, "use at most this many examples of --data (seeded subset)", Range(1))
    prior_samples: int = ranged(
        Scoring.prior_samples,
        "prior samples of the prior-mixture NLL (continuous, or too many code combinations)",
        Range(1),
    )
    exact_limit: int = ranged(
        Scoring.exact_limit, "enumerate the discrete prior exactly up to this many combinations", Range(0)
    )
    batch_size: int = ranged(16, "examples per forward pass", Range(1))
    progress: bool = option(True, "progress bars")

    def scoring(self) -> Scoring:
        """The :class:`config.Scoring` of these options (one posterior sample: no IW bound here)."""
        return Scoring(iw_samples=1, prior_samples=self.prior_samples, exact_limit=self.exact_limit)


@dataclass(frozen=True, kw_only=True)
class ScoringOptions(DataOptions):
    """Options of the subcommands that compute the importance-weighted bound: ``eval``, ``encode``."""

    iw_samples: int = ranged(Scoring.iw_samples, "posterior samples k of the IW bound", Range(1))

    def scoring(self) -> Scoring:
        return dataclasses.replace(super().scoring(), iw_samples=self.iw_samples)


_STEERING = "controllability (generate under each code or latent, re-encode)"


@dataclass(frozen=True, kw_only=True)
class EvalOptions(ScoringOptions):
    """``disentangle eval``."""

    output: str | None = option(None, "JSON report path (default RUN/eval/eval_<data>.json); .md next to it")
    generation: bool = option(
        False,
        "also measure controllability: code/latent recovery, label accuracy, distinct-n, z-free NLL",
        group=_STEERING,
    )
    generation_prompts: int = ranged(8, "held-out prompts generated for", Range(1), group=_STEERING)
    generation_max_new_tokens: int | None = ranged(
        None,
        "new tokens per generation at most (default: the run's response cap, data.max_response_tokens; a "
        "generation cut at it never wrote its end)",
        Range(1),
        group=_STEERING,
    )
    generation_no_repeat_ngram: int = ranged(
        0,
        "never the same run of this many tokens twice in one generation (breaks loops, as generate "
        "--no-repeat-ngram); 0: off",
        Range(0),
        group=_STEERING,
    )
    generation_temperature: float = ranged(
        0.0,
        "0: greedy generations; above 0: sampled at this temperature from the decoder's whole distribution "
        "(seeded by --seed, at the same --batch-size); at 1 their z-free NLL is comparable with the real responses'",
        Range(0, integer=False),
        group=_STEERING,
    )
    generation_top_p: float = ranged(
        1.0,
        "with --generation-temperature above 0: sample from the likeliest tokens whose probabilities first reach "
        "this mass (nucleus sampling, as generate --top-p); 1: the whole distribution",
        Range(0, 1, integer=False, low_open=True),
        group=_STEERING,
    )
    generation_samples: int = ranged(
        1,
        "generations per prompt and latent, each drawn on its own (needs --generation-temperature above 0): more "
        "generations to read a factor back from where the data has few distinct prompts",
        Range(1),
        group=_STEERING,
    )
    generation_latents: int = ranged(
        8, "continuous: prior draws per prompt (recovery targets)", Range(2), group=_STEERING
    )
    generation_guidance: float = ranged(
        0.0,
        "contrastive guidance of the generations: amplify by this factor what each code (draw, attribute vector) "
        "adds over the mixture of the prompt's latents of its slot (group); 0: none (docs/steering.md)",
        Range(0, integer=False),
        group=_STEERING,
    )
    generation_guidance_plausibility: float = ranged(
        0.1,
        "with --generation-guidance: only tokens at least this share of the latent's most likely token's probability",
        Range(0, 1, integer=False, low_open=True),
        group=_STEERING,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.generation_top_p < 1 and self.generation_temperature == 0:
            raise ValueError(
                f"--generation-top-p {self.generation_top_p:g} applies to sampling: set --generation-temperature "
                "above 0"
            )
        if self.generation_samples > 1 and self.generation_temperature == 0:
            raise ValueError(
                f"--generation-samples {self.generation_samples} draws several generations per prompt and latent: "
                "set --generation-temperature above 0 (greedy decoding writes the same text each time)"
            )


@dataclass(frozen=True, kw_only=True)
class EncodeOptions(ScoringOptions):
    """``disentangle encode``."""

    output: str = option(REQUIRED, "where to write the rows: FILE.jsonl or FILE.parquet")


_EXPLORE = "corpus explorer (--explore)"
_EXPLORE_DESCRIPTION = (
    "one self-contained HTML page: per code (per slot) or per k-means cluster of posterior means, its share, "
    "label distribution, most confident examples with token heat maps, and greedy generations under it"
)
#: The description of each argument group that has one, by its title (:func:`add_option_arguments`).
GROUP_DESCRIPTIONS = {_EXPLORE: _EXPLORE_DESCRIPTION}


@dataclass(frozen=True, kw_only=True)
class InspectOptions(DataOptions):
    """``disentangle inspect`` (one example's token report and the run's plots, or with ``explore`` the
    corpus explorer page)."""

    index: int = ranged(0, "index of the example in --data", Range(0))
    output_dir: str | None = option(None, "where to write (default RUN/inspect)")
    alpha: float | None = ranged(
        None, "token-weight alpha (default: the run's configured alpha)", Range(0, integer=False)
    )
    plots: bool = option(True, "write the PNG plots")
    explore: bool = option(False, "write the corpus explorer page instead of one example's report", group=_EXPLORE)
    output: str | None = option(
        None,
        "the explorer page (default: OUTPUT_DIR/explorer.html, else RUN/inspect/explorer.html)",
        group=_EXPLORE,
    )
    explore_examples: int = ranged(3, "most confident examples shown per group", Range(1), group=_EXPLORE)
    explore_prompts: int = ranged(3, "generate for the first N distinct prompts of --data", Range(0), group=_EXPLORE)
    explore_prompt_texts: list[str] | None = option(
        None,
        "generate for this prompt instead (repeatable)",
        flag="--explore-prompt",
        group=_EXPLORE,
        metavar="TEXT",
    )
    explore_tokens: int = ranged(16, "new tokens per generation (greedy)", Range(1), group=_EXPLORE)
    clusters: int | None = ranged(
        None, "continuous: k-means clusters (default: the first factor's values, else 8)", Range(1), group=_EXPLORE
    )


_LATENT_FILE = "latents read off data (an output of disentangle encode)"
_DISCRETE = "discrete latents"
_CONTINUOUS = "continuous latents"
_SAMPLING = "sampling (as transformers' generate)"
GENERATE_MODES = ("codes", "prior", "posterior", "interpolate", "row", "attribute", "traverse")


@dataclass(frozen=True, kw_only=True)
class GenerateOptions(CheckpointOptions):
    """``disentangle generate``: the prompts, :func:`generation.generate`'s keywords and the sampling options."""

    prompt: list[str] = option(REQUIRED, "a prompt (repeat for several)")
    mode: Literal["codes", "prior", "posterior", "interpolate", "row", "attribute", "traverse"] | None = option(
        None,
        "latents: codes (discrete default), prior (continuous default), posterior of --reference-response, "
        "interpolate (continuous) between two reference responses' posteriors; row, attribute, traverse "
        "(continuous; implied by --row, --attribute, --traverse)",
    )
    latents: str | None = option(None, "an encode file (.jsonl or .parquet) of this checkpoint", group=_LATENT_FILE)
    row: int | None = ranged(
        None, "decode with row I's latent: its codes (discrete, as --codes) or its mu", Range(0), group=_LATENT_FILE
    )
    attributes: list[str] | None = option(
        None,
        "continuous: add SCALE * (mean(mu | LABEL) - mean(mu)) over --latents to the latent (--row's mu, "
        "else the prompt's prior mean); LABEL is value or factor=value; repeatable",
        flag="--attribute",
        group=_LATENT_FILE,
        metavar="LABEL:SCALE",
    )
    code_examples: int = ranged(
        0,
        "discrete: show each generated code's N most typical responses of --latents (highest posterior)",
        Range(0),
        group=_LATENT_FILE,
        metavar="N",
    )
    slot: int | None = ranged(
        None, "sweep every code of this slot (default 0 unless --codes is given)", Range(0), group=_DISCRETE
    )
    codes: str | None = option(
        None, "force codes per slot, comma-separated, '-' = prior mode (e.g. 0,2 or -,3)", group=_DISCRETE
    )
    all_combinations: bool = option(False, "every combination of the unforced slots", group=_DISCRETE)
    max_combinations: int = ranged(64, "limit of --all-combinations", Range(1), group=_DISCRETE)
    reference_response: str | None = option(
        None, "response whose posterior is used (posterior, interpolate)", group=_CONTINUOUS
    )
    reference_response_b: str | None = option(None, "second reference response (interpolate)", group=_CONTINUOUS)
    steps: int = ranged(5, "interpolation or traversal points, ends included", Range(1), group=_CONTINUOUS)
    traverse: int | None = ranged(
        None, "traverse dimension DIM around the prior mean (or --row's mu)", Range(0), group=_CONTINUOUS, metavar="DIM"
    )
    traverse_range: str = option("-3:3", "offsets of --traverse", flag="--range", group=_CONTINUOUS, metavar="LOW:HIGH")
    num_samples: int = ranged(1, "responses per latent (prior mode: latents drawn, one response each)", Range(1))
    greedy: bool = option(False, "greedy decoding instead of sampling", group=_SAMPLING)
    temperature: float = ranged(0.7, "sampling temperature", Range(0, integer=False, low_open=True), group=_SAMPLING)
    top_p: float = ranged(0.9, "nucleus sampling mass", Range(0, 1, integer=False, low_open=True), group=_SAMPLING)
    max_new_tokens: int = ranged(64, "new tokens per response at most", Range(1), group=_SAMPLING)
    no_repeat_ngram: int = ranged(
        0,
        "never the same run of this many tokens twice in one response (breaks loops); 0: off",
        Range(0),
        group=_SAMPLING,
    )
    guidance: float = ranged(
        0.0,
        "contrastive guidance: amplify by this factor what each latent adds over the mixture of the prompt's "
        "latents (the codes swept, the draws, the traversal's points); 0: none (docs/steering.md)",
        Range(0, integer=False),
        group=_SAMPLING,
    )
    guidance_plausibility: float = ranged(
        0.1,
        "with --guidance: only tokens at least this share of the latent's most likely token's probability",
        Range(0, 1, integer=False, low_open=True),
        group=_SAMPLING,
    )
    batch_size: int = ranged(
        16, "rows per generate call (left-padded); with --guidance, streams: a row takes one per latent", Range(1)
    )
    progress: bool = option(True, "a progress bar over the responses")
    output: str | None = option(None, "write the generations and diversity as JSON here")
    json: bool = option(False, "print JSON instead of the text table")

    def sampling(self):
        """The :class:`generation.SamplingOptions` of these options (``seed`` included)."""
        from .generation import SamplingOptions

        return SamplingOptions(
            greedy=self.greedy,
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            no_repeat_ngram=self.no_repeat_ngram,
        )

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`generation.generate` (``sampling`` included, ``batch_size`` not)."""
        names = (
            "mode",
            "slot",
            "codes",
            "all_combinations",
            "max_combinations",
            "num_samples",
            "reference_response",
            "reference_response_b",
            "steps",
            "latents",
            "row",
            "attributes",
            "traverse",
            "traverse_range",
            "code_examples",
            "progress",
        )
        from .guidance import Guidance

        guidance = Guidance(self.guidance, self.guidance_plausibility) if self.guidance > 0 else None
        return {**{name: getattr(self, name) for name in names}, "sampling": self.sampling(), "guidance": guidance}


@dataclass(frozen=True, kw_only=True)
class RefitOptions(CheckpointOptions):
    """``disentangle refit-encoder`` (the encoder alone fit to the decoder's own posterior, :mod:`encoder_refit`)."""

    output_dir: str = option(REQUIRED, "the new run directory the refit writes (must not exist, or be empty)")
    data: str = option("train", "the pairs to fit on: " + _DATA_HELP + " (default: the run's training split)")
    max_examples: int | None = ranged(None, "use at most this many examples of --data (seeded subset)", Range(1))
    objective: Literal["nll", "target", "both"] = option(
        "nll",
        "nll: the decoder's NLL under the encoder's codes, in expectation (a wrong code costs what it costs the "
        "decoder); target: the run's decoder-posterior term (the decoder's likeliest code, every wrong one alike); "
        "both: each from the encoder as trained, keeping the fit of the lower held-out NLL under its codes",
    )
    epochs: int = ranged(30, "passes over the pairs", Range(1))
    lr: float = ranged(
        1e-4,
        "Adam's learning rate of the encoder (with --objective both, of the nll fit)",
        Range(0, integer=False, low_open=True),
    )
    target_lr: float = ranged(
        1e-3,
        "with --objective both: the target fit's learning rate",
        Range(0, integer=False, low_open=True),
    )
    holdout: float = ranged(
        0.1,
        "share of the pairs held out to choose the epoch kept, the one of the lowest NLL under its codes (0: the last)",
        Range(0, 0.5, integer=False),
    )
    batch_size: int = ranged(16, "examples per forward pass and per step", Range(1))
    posterior: str | None = option(
        None,
        "reuse the decoder's posterior an earlier refit of this checkpoint computed on this --data (its "
        "decoder_posterior.safetensors) instead of decoding every pair again",
    )
    encoder_view: Literal["attention", "token_weighted_attention"] | None = option(
        None,
        "widen the encoder before the fit: the attention pool over the response's per-token states, its query at "
        "zero so that the fit starts from the run's own pool (attention for a mean_last run, "
        "token_weighted_attention for a token_weighted one; default: the run's view)",
    )
    encoder_block: Literal["mlp", "transformer"] | None = option(
        None,
        "add a trainable block over the per-token states before the attention pool, the identity at the start "
        "(needs an attention view: the run's or --encoder-view; default: the run's block)",
    )
    progress: bool = option(True, "progress bars")


#: The options dataclass of each subcommand built here.
SUBCOMMAND_OPTIONS: dict[str, type] = {
    "eval": EvalOptions,
    "generate": GenerateOptions,
    "inspect": InspectOptions,
    "encode": EncodeOptions,
    "refit-encoder": RefitOptions,
}
