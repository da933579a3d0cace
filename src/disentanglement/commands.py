"""Subcommands that work on a trained checkpoint: ``eval``, ``generate``, ``inspect`` and ``encode``.

    disentangle eval CHECKPOINT [--data validation|train|chatterbot|FILE.jsonl] [--output report.json]
    disentangle generate CHECKPOINT --prompt "..." [--slot S | --codes 0,2 | --all-combinations] [...]
    disentangle inspect CHECKPOINT [--data ...] --index I [--output-dir DIR]
    disentangle inspect CHECKPOINT --explore [--data ...] [--output PAGE.html]   # explorer.py
    disentangle encode CHECKPOINT [--data ...] --output latents.jsonl             # encode.py

``CHECKPOINT`` is a checkpoint directory (``RUN/checkpoints/step-NNNNNN``) or a run directory
(its latest complete checkpoint is used). Each subcommand has a ``run_*`` function that the parser
calls and that tests call with an injected ``model_and_tokenizer`` (the decoder and tokenizer the
checkpoint's trainable weights are loaded onto).

Data (``--data``): ``validation`` (default) and ``train`` rebuild the run's own split
deterministically from its stored config (``trainer.prepare_data``); ``chatterbot`` or a ``.jsonl``
path is loaded with the run's keys, chat template and truncation. ``--max-examples`` keeps a
seeded subset.

``eval`` and ``inspect`` check their numeric options and ``--data`` before the model loads
(:func:`check_data_option` reads only the checkpoint's ``config.yaml``), so a typo in a flag or a
malformed data file fails in a second, not after the checkpoint has loaded.

Each subcommand's flags are built from one frozen options dataclass (:data:`SUBCOMMAND_OPTIONS`:
:class:`EvalOptions`, :class:`GenerateOptions`, :class:`InspectOptions`, :class:`EncodeOptions`, sharing
:class:`CheckpointOptions` and :class:`DataOptions`) with ``config.option``, as ``train``'s are built from
the config dataclasses: each default is stated once, in its field, and a field cannot lack its flag.
The ``run_*`` functions take such an instance, with keyword overrides on top.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .config import (
    HelpFormatter,
    Scoring,
    base_type,
    field_flag,
    flag_metavar,
    flag_spellings,
    literal_values,
    option,
    register_flag_aliases,
)

if TYPE_CHECKING:  # the heavy modules (torch, transformers) load when a command runs, not for --help
    from .config import RunConfig
    from .data import Example

logger = logging.getLogger(__name__)

SPLITS = ("validation", "train")


# --------------------------------------------------------------------------- shared helpers


def resolve_run(checkpoint: str | Path) -> tuple[Path, Path]:
    """``(checkpoint_dir, run_dir)`` of a checkpoint directory or a run directory (see ``checkpoints.py``)."""
    from .checkpoints import resolve_run as resolve

    return resolve(checkpoint)


def stored_features(model, examples, pad_token_id: int, batch_size: int, progress: bool = True, state=None):
    """The frozen-pass features of ``examples`` through the user's feature cache (``feature_store``: its
    folder and size limit from the environment or the defaults), shared with training runs on the same
    weights and examples."""
    from .feature_store import load_or_build_features

    return load_or_build_features(
        model, examples, pad_token_id, None, batch_size=batch_size, progress=progress, state=state
    )


def load_checkpoint(checkpoint: str | Path, model_and_tokenizer=None, device: str = "auto", state=None):
    """``(model, tokenizer, config, trainer_state, checkpoint_dir, run_dir)``, the model in eval mode on ``device``
    (several processes, ``state``: on this process's device).

    Loads through ``trainer.load_trained`` (looked up at call time, so tests can replace it).
    """
    from . import trainer

    checkpoint_dir, run_dir = resolve_run(checkpoint)
    target = trainer.choose_device(device) if state is None else state.device
    model, tokenizer, config, state = trainer.load_trained(checkpoint_dir, model_and_tokenizer, device=target)
    model = model.to(target).eval()
    return model, tokenizer, config, state, checkpoint_dir, run_dir


def load_examples(
    data: str | None, config: RunConfig, tokenizer: Any, max_examples: int | None = None, seed: int = 0
) -> tuple[list[Example], str]:
    """The examples named by ``--data`` (see the module docstring) and a description of them."""
    from .data import limit_examples, load_pairs, tokenize_pairs
    from .trainer import prepare_data

    data = data or "validation"
    if data in SPLITS:
        prepared = prepare_data(config, tokenizer)
        examples = prepared.validation if data == "validation" else prepared.train
        description = f"{data} split of {config.data.data}"
    else:
        pairs = load_pairs(dataclasses.replace(config.data, data=data))
        examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
        description = data
    if max_examples is not None:
        if max_examples < 1:
            raise ValueError(f"--max-examples must be >= 1, got {max_examples}")
        examples = limit_examples(examples, max_examples, seed)
        description += f" (at most {max_examples} examples, seed {seed})"
    if not examples:
        raise ValueError(f"no examples in {description}")
    return examples, description


def check_writable_target(path: str | Path, flag: str, directory: bool = False) -> None:
    """Fail now, before the model loads, if ``path`` (a file, or with ``directory`` a folder) cannot be
    written: a file where a folder is needed on the way to it, or a folder that is not writable."""
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a directory")
    if not directory and path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; expected a file path")
    ancestor = path if directory else path.parent
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {path}: {ancestor} is a file, so nothing can be written under it")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {ancestor} is not writable")


def _check_at_least(flag: str, value: int | None, low: int, *, optional: bool = False) -> None:
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
            _check_at_least(flag, value, int(self.low))
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


#: The range of every numeric option of ``eval``, ``generate``, ``inspect`` and ``encode`` (by field name):
#: :func:`check_numeric_options` checks them before any model loads; a numeric field missing here is a test
#: failure (tests/test_reliability.py walks every options dataclass).
OPTION_RANGES: dict[str, Range] = {
    "seed": Range(0),
    "max_examples": Range(1),
    "prior_samples": Range(1),
    "exact_limit": Range(0),
    "batch_size": Range(1),
    "iw_samples": Range(1),
    "generation_prompts": Range(1),
    "generation_max_new_tokens": Range(1),
    "generation_latents": Range(2),
    "index": Range(0),
    "alpha": Range(0, integer=False),
    "explore_examples": Range(1),
    "explore_prompts": Range(0),
    "explore_tokens": Range(1),
    "clusters": Range(1),
    "row": Range(0),
    "code_examples": Range(0),
    "slot": Range(0),
    "max_combinations": Range(1),
    "steps": Range(1),
    "traverse": Range(0),
    "num_samples": Range(1),
    "temperature": Range(0, integer=False, low_open=True),
    "top_p": Range(0, 1, integer=False, low_open=True),
    "max_new_tokens": Range(1),
}


def numeric_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of an options dataclass whose type is an int or a float (optional or not)."""
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls) if base_type(hints[f.name]) in (int, float)]


def check_numeric_options(options: Any) -> None:
    """Every numeric option of ``options`` in its :data:`OPTION_RANGES` range (None where the field allows it),
    else a ``ValueError`` naming the flag: before the model loads."""
    hints = typing.get_type_hints(type(options))
    for f in numeric_fields(type(options)):
        value = getattr(options, f.name)
        if value is None and type(None) in typing.get_args(hints[f.name]):
            continue
        OPTION_RANGES[f.name].check(field_flag(f), value)


def check_data_option(checkpoint: str | Path, data: str | None) -> None:
    """Fail on a ``--data`` that cannot be loaded, before any model loads (see the module docstring).

    Resolves the checkpoint and reads only its ``config.yaml`` (the run's keys): a ``.jsonl`` path
    is read and validated as :func:`load_examples` will read it (a missing file, a directory, a
    file not named ``.jsonl``, an invalid line); ``validation``/``train`` need the run's own data
    file to still exist; ``chatterbot`` needs the corpus installed.
    """
    from .config import load_run_config
    from .data import chatterbot_corpus_dir, load_pairs

    data = data or "validation"
    checkpoint_dir, _ = resolve_run(checkpoint)
    if data == "chatterbot":
        chatterbot_corpus_dir()
        return
    config = load_run_config(checkpoint_dir / "config.yaml")
    if data in SPLITS:
        source = config.data.data
        if source == "chatterbot":
            chatterbot_corpus_dir()
        elif not Path(source).expanduser().is_file():
            raise FileNotFoundError(
                f"--data {data} rebuilds the run's split from its data file {source}, which is not a file here; "
                "pass the data file itself as --data FILE.jsonl"
            )
        return
    load_pairs(dataclasses.replace(config.data, data=data))


def _slug(data: str | None) -> str:
    data = data or "validation"
    name = data if data in (*SPLITS, "chatterbot") else Path(data).stem
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _write_json(path: str | Path, obj: Any, root: str | Path | None = None) -> Path:
    """``obj`` as JSON at ``path``, never through a symbolic link (:func:`safe_io.write_json`; ``root``: the
    run directory when the path is the command's default inside it, whose folders must be real)."""
    from .safe_io import write_json

    return write_json(path, obj, root, indent=1, default=str)


# --------------------------------------------------------------------------- options


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
    group title to its description.
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
            target = groups[title] = parser.add_argument_group(title, (descriptions or {}).get(title))
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


def _with(cls: type, options: Any, overrides: dict[str, Any]) -> Any:
    """``options`` (default ``cls()``) with the keyword ``overrides`` (the ``run_*`` functions' keywords)."""
    return cls(**overrides) if options is None else dataclasses.replace(options, **overrides)


_DATA_HELP = "validation, train, chatterbot or a .jsonl file"


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Options of every subcommand that loads a checkpoint."""

    device: Literal["auto", "cpu", "cuda"] = option("auto", "where to run the model")
    seed: int = option(0, "seed of every sample drawn (results are deterministic)")


@dataclass(frozen=True, kw_only=True)
class DataOptions(CheckpointOptions):
    """Options of the subcommands that score a data set with a checkpoint: ``eval``, ``inspect``, ``encode``."""

    data: str = option("validation", _DATA_HELP)
    max_examples: int | None = option(None, "use at most this many examples of --data (seeded subset)")
    prior_samples: int = option(
        Scoring.prior_samples, "prior samples of the prior-mixture NLL (continuous, or too many code combinations)"
    )
    exact_limit: int = option(Scoring.exact_limit, "enumerate the discrete prior exactly up to this many combinations")
    batch_size: int = option(16, "examples per forward pass")
    progress: bool = option(True, "progress bars")

    def scoring(self) -> Scoring:
        """The :class:`config.Scoring` of these options (one posterior sample: no IW bound here)."""
        _check_at_least("--prior-samples", self.prior_samples, 1)
        _check_at_least("--exact-limit", self.exact_limit, 0)
        return Scoring(iw_samples=1, prior_samples=self.prior_samples, exact_limit=self.exact_limit)


@dataclass(frozen=True, kw_only=True)
class ScoringOptions(DataOptions):
    """Options of the subcommands that compute the importance-weighted bound: ``eval``, ``encode``."""

    iw_samples: int = option(Scoring.iw_samples, "posterior samples k of the IW bound")

    def scoring(self) -> Scoring:
        _check_at_least("--iw-samples", self.iw_samples, 1)
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
    generation_prompts: int = option(8, "held-out prompts generated for", group=_STEERING)
    generation_max_new_tokens: int = option(32, "greedy tokens per generation", group=_STEERING)
    generation_latents: int = option(8, "continuous: prior draws per prompt (recovery targets)", group=_STEERING)


@dataclass(frozen=True, kw_only=True)
class EncodeOptions(ScoringOptions):
    """``disentangle encode``."""

    output: str = option(REQUIRED, "where to write the rows: FILE.jsonl or FILE.parquet")


_EXPLORE = "corpus explorer (--explore)"
_EXPLORE_DESCRIPTION = (
    "one self-contained HTML page: per code (per slot) or per k-means cluster of posterior means, its share, "
    "label distribution, most confident examples with token heat maps, and greedy generations under it"
)


@dataclass(frozen=True, kw_only=True)
class InspectOptions(DataOptions):
    """``disentangle inspect`` (one example's token report and the run's plots, or with ``explore`` the
    corpus explorer page)."""

    index: int = option(0, "index of the example in --data")
    output_dir: str | None = option(None, "where to write (default RUN/inspect)")
    alpha: float | None = option(None, "token-weight alpha (default: the run's configured alpha)")
    plots: bool = option(True, "write the PNG plots")
    explore: bool = option(False, "write the corpus explorer page instead of one example's report", group=_EXPLORE)
    output: str | None = option(
        None,
        "the explorer page (default: OUTPUT_DIR/explorer.html, else RUN/inspect/explorer.html)",
        group=_EXPLORE,
    )
    explore_examples: int = option(3, "most confident examples shown per group", group=_EXPLORE)
    explore_prompts: int = option(3, "generate for the first N distinct prompts of --data", group=_EXPLORE)
    explore_prompt_texts: list[str] | None = option(
        None,
        "generate for this prompt instead (repeatable)",
        flag="--explore-prompt",
        group=_EXPLORE,
        metavar="TEXT",
    )
    explore_tokens: int = option(16, "new tokens per generation (greedy)", group=_EXPLORE)
    clusters: int | None = option(
        None, "continuous: k-means clusters (default: the first factor's values, else 8)", group=_EXPLORE
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
    row: int | None = option(
        None, "decode with row I's latent: its codes (discrete, as --codes) or its mu", group=_LATENT_FILE
    )
    attributes: list[str] | None = option(
        None,
        "continuous: add SCALE * (mean(mu | LABEL) - mean(mu)) over --latents to the latent (--row's mu, "
        "else the prompt's prior mean); LABEL is value or factor=value; repeatable",
        flag="--attribute",
        group=_LATENT_FILE,
        metavar="LABEL:SCALE",
    )
    code_examples: int = option(
        0,
        "discrete: show each generated code's N most typical responses of --latents (highest posterior)",
        group=_LATENT_FILE,
        metavar="N",
    )
    slot: int | None = option(
        None, "sweep every code of this slot (default 0 unless --codes is given)", group=_DISCRETE
    )
    codes: str | None = option(
        None, "force codes per slot, comma-separated, '-' = prior mode (e.g. 0,2 or -,3)", group=_DISCRETE
    )
    all_combinations: bool = option(False, "every combination of the unforced slots", group=_DISCRETE)
    max_combinations: int = option(64, "limit of --all-combinations", group=_DISCRETE)
    reference_response: str | None = option(
        None, "response whose posterior is used (posterior, interpolate)", group=_CONTINUOUS
    )
    reference_response_b: str | None = option(None, "second reference response (interpolate)", group=_CONTINUOUS)
    steps: int = option(5, "interpolation or traversal points, ends included", group=_CONTINUOUS)
    traverse: int | None = option(
        None, "traverse dimension DIM around the prior mean (or --row's mu)", group=_CONTINUOUS, metavar="DIM"
    )
    traverse_range: str = option("-3:3", "offsets of --traverse", flag="--range", group=_CONTINUOUS, metavar="LOW:HIGH")
    num_samples: int = option(1, "responses per latent (prior mode: latents drawn, one response each)")
    greedy: bool = option(False, "greedy decoding instead of sampling", group=_SAMPLING)
    temperature: float = option(0.7, "sampling temperature", group=_SAMPLING)
    top_p: float = option(0.9, "nucleus sampling mass", group=_SAMPLING)
    max_new_tokens: int = option(64, "new tokens per response at most", group=_SAMPLING)
    batch_size: int = option(16, "rows per generate call (left-padded)")
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
        return {**{name: getattr(self, name) for name in names}, "sampling": self.sampling()}


#: The options dataclass of each subcommand built here.
SUBCOMMAND_OPTIONS: dict[str, type] = {
    "eval": EvalOptions,
    "generate": GenerateOptions,
    "inspect": InspectOptions,
    "encode": EncodeOptions,
}


def _add_checkpoint(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint directory (RUN/checkpoints/step-NNNNNN) or run directory (latest checkpoint)"
    )


def _add_subcommand(subparsers, name: str, func, descriptions: dict[str, str] | None = None, **kwargs: Any) -> None:
    parser = subparsers.add_parser(name, formatter_class=HelpFormatter, **kwargs)
    _add_checkpoint(parser)
    add_option_arguments(parser, SUBCOMMAND_OPTIONS[name], descriptions)
    parser.set_defaults(func=func)


# --------------------------------------------------------------------------- eval


def run_eval(
    checkpoint: str | Path, options: EvalOptions | None = None, *, model_and_tokenizer=None, **overrides: Any
) -> tuple[dict, Path, Path]:
    """Evaluate a checkpoint (:func:`evaluation.evaluate`); write the JSON report and a Markdown summary.

    ``options`` (default :class:`EvalOptions`) with the keyword ``overrides`` on top (``run_eval(ckpt,
    data="train", iw_samples=4)``). ``output`` defaults to ``RUN/eval/eval_<data>.json``; the summary is the
    same path with ``.md``. With ``generation`` the report gets ``controllability``
    (:func:`controllability.controllability` on ``generation_prompts`` prompts of ``data``,
    ``generation_max_new_tokens`` greedy tokens, and ``generation_latents`` prior draws per prompt for a
    continuous model). Returns ``(report, json_path, markdown_path)``.
    """
    from .evaluation import evaluate
    from .report import write_markdown_summary

    options = _with(EvalOptions, options, overrides)
    # options first, before the model loads
    check_numeric_options(options)
    scoring = options.scoring()
    _check_at_least("--batch-size", options.batch_size, 1)
    _check_at_least("--max-examples", options.max_examples, 1, optional=True)
    if options.generation:
        _check_at_least("--generation-prompts", options.generation_prompts, 1)
        _check_at_least("--generation-max-new-tokens", options.generation_max_new_tokens, 1)
        _check_at_least("--generation-latents", options.generation_latents, 2)
    if options.output is not None and Path(options.output).is_dir():
        raise ValueError(f"--output {options.output} is a directory; expected the path of the JSON report")
    check_data_option(checkpoint, options.data)
    checkpoint_dir, run_dir = resolve_run(checkpoint)
    json_path = (
        Path(options.output) if options.output is not None else run_dir / "eval" / f"eval_{_slug(options.data)}.json"
    )
    check_writable_target(json_path, "--output")
    if options.output is None:  # RUN/eval must be a real folder of the run, not a link to elsewhere
        from .safe_io import ensure_dir

        ensure_dir(json_path.parent, run_dir)
    # Under ``accelerate launch --num_processes N`` the frozen pass and the scoring are shared out among
    # the processes and gathered; the main process alone writes the report.
    from . import distributed, trainer

    processes = distributed.process_state(cpu=trainer.choose_device(options.device).type == "cpu")
    main = distributed.is_main(processes)
    model, tokenizer, config, state, checkpoint_dir, run_dir = load_checkpoint(
        checkpoint, model_and_tokenizer, options.device, processes
    )
    examples, description = load_examples(options.data, config, tokenizer, options.max_examples, options.seed)
    cache = stored_features(
        model, examples, tokenizer.pad_token_id, options.batch_size, progress=options.progress and main, state=processes
    )
    body = evaluate(
        model,
        examples,
        cache,
        tokenizer.pad_token_id,
        scoring=scoring,
        batch_size=options.batch_size,
        seed=options.seed,
        progress=options.progress and main,
        state=processes,
    )
    report = {
        "title": f"Evaluation of {checkpoint_dir}",
        "checkpoint": str(checkpoint_dir),
        "step": state.get("step"),
        "data": description,
        **body,
    }
    from .verdict import judge

    result = judge(report)
    report["verdict"] = {"verdict": result["verdict"], "reason": result["reason"]}
    if not main:
        return report, json_path, json_path.with_suffix(".md")
    if options.generation:
        from .controllability import controllability
        from .encode import raw_pairs

        report["controllability"] = controllability(
            model,
            tokenizer,
            config,
            examples,
            cache,
            raw_pairs(options.data, config, examples),
            num_prompts=options.generation_prompts,
            max_new_tokens=options.generation_max_new_tokens,
            prior_latents=options.generation_latents,
            seed=options.seed,
            batch_size=options.batch_size,
            progress=options.progress,
        )
    _write_json(json_path, report, root=run_dir if options.output is None else None)
    md_path = write_markdown_summary(report, json_path.with_suffix(".md"))
    return report, json_path, md_path


def eval_summary_lines(report: dict) -> list[str]:
    """The headline numbers of an evaluation report, one per line, and the verdict (:func:`verdict.judge`):
    code usage or active units, each factor's NMI beside its baselines, then ``verdict: ...``."""
    lines = [
        f"examples: {report['examples']} ({report['response_tokens']} response tokens) from {report['data']}",
        f"latent gain:  {report['latent_gain_nats_per_token']:+.4f} nats/token "
        f"(token-weighted {report['token_weighted_latent_gain_nats_per_token']:+.4f}); prior as "
        f"{report['prior_mixture']['method']} over {report['prior_mixture']['latents']} latents",
        f"z-free gain:  {report['zfree_gain_nats_per_token']:+.4f} nats/token "
        f"(token-weighted {report['token_weighted_zfree_gain_nats_per_token']:+.4f})",
    ]
    if report["zfree_gain_nats_per_token"] < 0:  # seen with term 3 alone: its unweighted tokens drift
        lines.append(
            f"warning: under its posterior latent the decoder is worse than the z-free model "
            f"({report['posterior_nll_nats_per_token']:.4f} against {report['zfree_nll_nats_per_token']:.4f} "
            "nats/token): the objective leaves tokens it does not weight free to drift (term 3 or 4 without "
            "term 1); reconstruction_weight > 0 holds them"
        )
    lines += [
        f"IW NLL:       {report['iw_nll']['nats_per_token']:.4f} nats/token, perplexity "
        f"{report['iw_nll']['perplexity']:.3f}; KL {report['kl']['total']:.4f}; MI {report['mutual_information']:.4f}",
    ]
    if "code_perplexity" in report:
        lines.append(f"code perplexity per slot: {[round(v, 3) for v in report['code_perplexity']]}")
    from .verdict import judge, usage_line

    result = judge(report)
    lines.append(usage_line(result["usage"]))
    if "label_nmi" in report:
        lines.append(
            f"labels: NMI {report['label_nmi']:.3f}, ARI {report['label_ari']:.3f}, homogeneity "
            f"{report['label_homogeneity']:.3f}, completeness {report['label_completeness']:.3f}"
        )
    for name, entry in (report.get("factors") or {}).items():
        lines.append(
            f"factor {name}: NMI {entry['latent']['nmi']:.2f} (encoder k-means {entry['encoder_kmeans']['nmi']:.2f}, "
            f"prior k-means {entry['prior_kmeans']['nmi']:.2f}, random {entry['random']['nmi']:.2f})"
        )
    lines.append(f"verdict: {result['verdict']} ({result['reason']})")
    if "controllability" in report:
        from .controllability import summary_lines

        lines += summary_lines(report["controllability"])
    return lines


def _eval_main(args: argparse.Namespace) -> int:
    report, json_path, md_path = run_eval(args.checkpoint, options_from(EvalOptions, args))
    from .distributed import is_main_process

    if not is_main_process():
        return 0
    print("\n".join(eval_summary_lines(report)))
    print(f"report:  {json_path}")
    print(f"summary: {md_path}")
    return 0


# --------------------------------------------------------------------------- generate


def run_generate(
    checkpoint: str | Path,
    prompts: list[str],
    *,
    output: str | Path | None = None,
    device: str = "auto",
    batch_size: int = 16,
    model_and_tokenizer=None,
    **options: Any,
) -> dict:
    """Generate from a checkpoint (:func:`generation.generate`; ``options`` are its keyword arguments,
    ``sampling`` a :class:`generation.SamplingOptions`; :meth:`GenerateOptions.generate_kwargs` gives them
    for a command line). Writes the result as JSON to ``output`` when given."""
    from .generation import generate, parse_range

    _check_at_least("--batch-size", batch_size, 1)
    if output is not None:
        check_writable_target(output, "--output")
    # the latent file and the steering options before the model loads
    if options.get("codes") is not None or options.get("slot") is not None or options.get("all_combinations"):
        from .config import load_run_config
        from .generation import check_codes_options
        from .latent_space import latent_space_of

        stored = load_run_config(resolve_run(checkpoint)[0] / "config.yaml")
        check_codes_options(
            latent_space_of(stored.latent.latent),
            options.get("slot"),
            options.get("codes"),
            options.get("all_combinations"),
        )
    if isinstance(options.get("latents"), str | Path):
        from .latent_file import read_latents

        options["latents"] = read_latents(options["latents"])
    if options.get("traverse") is not None:
        parse_range(options.get("traverse_range", (-3.0, 3.0)))
    if options.get("attributes"):
        from .latent_file import parse_attribute

        for spec in options["attributes"]:
            parse_attribute(spec)

    model, tokenizer, config, state, checkpoint_dir, _ = load_checkpoint(checkpoint, model_and_tokenizer, device)
    result = generate(model, tokenizer, config, prompts, batch_size=batch_size, **options)
    result = {"checkpoint": str(checkpoint_dir), "step": state.get("step"), **result}
    if output is not None:
        _write_json(output, result)
    return result


def _generate_main(args: argparse.Namespace) -> int:
    from .generation import format_generations

    options = options_from(GenerateOptions, args)
    check_numeric_options(options)
    result = run_generate(
        args.checkpoint,
        options.prompt,
        output=options.output,
        device=options.device,
        batch_size=options.batch_size,
        **options.generate_kwargs(),
    )
    print(json.dumps(result, indent=1) if options.json else format_generations(result))
    if options.output:
        print(f"written: {options.output}")
    return 0


# --------------------------------------------------------------------------- inspect


def run_inspect(
    checkpoint: str | Path, options: InspectOptions | None = None, *, model_and_tokenizer=None, **overrides: Any
) -> dict[str, Any]:
    """Write the token report of example ``index`` of ``data`` and the run's plots.

    ``options`` (default :class:`InspectOptions`, whose explorer fields this ignores) with the keyword
    ``overrides`` on top. ``output_dir`` defaults to ``RUN/inspect``. Files: ``inspect_<index>.html`` and
    ``.json`` (the sidecar), ``training_curves.png``, ``kl.png``, ``schedules.png`` (from
    ``RUN/metrics.jsonl``), ``code_usage.png`` (discrete) and ``code_label_heatmap.png`` (labelled data), the
    last two over the whole ``data`` set. Returns ``{"html", "json", "plots"}`` (paths).
    """
    from .inspection import write_example_report, write_run_plots
    from .safe_io import ensure_dir

    options = _with(InspectOptions, options, overrides)
    # options first, before the model loads (the upper bound of --index needs the examples)
    check_numeric_options(options)
    _check_at_least("--index", options.index, 0)
    scoring = options.scoring()
    _check_at_least("--batch-size", options.batch_size, 1)
    _check_at_least("--max-examples", options.max_examples, 1, optional=True)
    alpha = options.alpha
    if alpha is not None and not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"--alpha must be a finite number >= 0, got {alpha!r}")
    if options.max_examples is not None and options.index >= options.max_examples:
        raise ValueError(
            f"--index {options.index} is outside [0, {options.max_examples}) for --max-examples {options.max_examples}"
        )
    if options.output_dir is not None and Path(options.output_dir).exists() and not Path(options.output_dir).is_dir():
        raise ValueError(f"--output-dir {options.output_dir} exists and is not a directory")
    check_data_option(checkpoint, options.data)
    check_writable_target(options.output_dir or resolve_run(checkpoint)[1] / "inspect", "--output-dir", directory=True)
    if options.output_dir is None:  # RUN/inspect must be a real folder of the run, not a link to elsewhere
        ensure_dir(resolve_run(checkpoint)[1] / "inspect", resolve_run(checkpoint)[1])
    model, tokenizer, config, state, checkpoint_dir, run_dir = load_checkpoint(
        checkpoint, model_and_tokenizer, options.device
    )
    examples, description = load_examples(options.data, config, tokenizer, options.max_examples, options.seed)
    if not 0 <= options.index < len(examples):
        raise ValueError(f"--index {options.index} is outside [0, {len(examples)}) for {description}")
    out_dir = Path(options.output_dir) if options.output_dir is not None else run_dir / "inspect"
    extra = {"checkpoint": str(checkpoint_dir), "step": state.get("step"), "data": description}
    html_path, json_path = write_example_report(
        out_dir,
        options.index,
        model,
        tokenizer,
        examples[options.index],
        extra_meta=extra,
        alpha=alpha,
        scoring=scoring,
        seed=options.seed,
    )
    written: list[Path] = []
    if options.plots:
        cache = stored_features(model, examples, tokenizer.pad_token_id, options.batch_size, progress=options.progress)
        written = write_run_plots(
            out_dir, model, examples, cache, tokenizer.pad_token_id, run_dir / "metrics.jsonl", seed=options.seed
        )
    return {"html": html_path, "json": json_path, "plots": written}


def _explore_main(checkpoint: str, options: InspectOptions) -> int:
    from .explorer import run_explore

    check_numeric_options(options)
    output = options.output
    if output is None and options.output_dir is not None:
        output = Path(options.output_dir) / "explorer.html"
    path = run_explore(
        checkpoint,
        data=options.data,
        output=output,
        examples_per_group=options.explore_examples,
        prompts=options.explore_prompt_texts,
        num_prompts=options.explore_prompts,
        max_new_tokens=options.explore_tokens,
        clusters=options.clusters,
        max_examples=options.max_examples,
        scoring=options.scoring(),
        seed=options.seed,
        batch_size=options.batch_size,
        device=options.device,
        progress=options.progress,
    )
    print(f"explorer: {path}")
    return 0


def _inspect_main(args: argparse.Namespace) -> int:
    options = options_from(InspectOptions, args)
    if options.explore:
        return _explore_main(args.checkpoint, options)
    if options.output is not None:
        raise ValueError("--output is the explorer page's path; use it with --explore (or --output-dir)")
    paths = run_inspect(args.checkpoint, options)
    print(f"token report: {paths['html']}")
    print(f"sidecar:      {paths['json']}")
    for path in paths["plots"]:
        print(f"plot:         {path}")
    return 0


# --------------------------------------------------------------------------- encode


def _encode_main(args: argparse.Namespace) -> int:
    from .encode import _encode_to_file

    options = options_from(EncodeOptions, args)
    path, count = _encode_to_file(args.checkpoint, options)
    print(f"wrote {count} rows to {path}")
    return 0


# --------------------------------------------------------------------------- the parsers


def add_subcommands(subparsers) -> None:
    """Register ``eval``, ``generate``, ``inspect`` and ``encode`` on the ``disentangle`` parser, their flags
    built from :data:`SUBCOMMAND_OPTIONS`."""
    _add_subcommand(
        subparsers,
        "eval",
        _eval_main,
        help="evaluate a checkpoint: gains, ELBO, IW bound, KL, MI, code usage, label agreement",
        description="Evaluate a checkpoint; write a JSON report and a Markdown summary next to it.",
    )
    _add_subcommand(
        subparsers,
        "generate",
        _generate_main,
        help="generate responses under chosen latents (codes, prior samples, posteriors, interpolations)",
        description="Generate responses to prompts under chosen latents; print a table (or JSON) and the "
        "diversity (distinct-1/2) across latents and samples.",
    )
    _add_subcommand(
        subparsers,
        "inspect",
        _inspect_main,
        {_EXPLORE: _EXPLORE_DESCRIPTION},
        help="token heat map of one example (HTML + JSON) and the run's plots (PNG)",
        description="Write a self-contained HTML page colouring one example's response tokens by z-free "
        "surprisal, token weight, inverse weight, conditioned NLL and gain (with a JSON sidecar), and PNG "
        "plots of the run: training curves, KL and schedules, code usage, code x label heat map.",
    )
    _add_subcommand(
        subparsers,
        "encode",
        _encode_main,
        help="read z off data: one row per example (codes or mu, posterior, prior, KL, latent gain)",
        description="Encode every example of --data with a checkpoint and write one row per example, in data "
        "order, to a .jsonl (or .parquet, with pyarrow) file: source, prompt, response, label, the posterior and "
        "prior latents, the per-example KL and latent gain (the numbers eval aggregates, for the same options).",
    )
