"""Subcommands that work on a trained checkpoint: ``eval``, ``generate`` and ``inspect``.

    disentangle eval CHECKPOINT [--data validation|train|chatterbot|FILE.jsonl] [--output report.json]
    disentangle generate CHECKPOINT --prompt "..." [--slot S | --codes 0,2 | --all-combinations] [...]
    disentangle inspect CHECKPOINT [--data ...] --index I [--output-dir DIR]
    disentangle inspect CHECKPOINT --explore [--data ...] [--output PAGE.html]   # explorer.py

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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def load_checkpoint(checkpoint: str | Path, model_and_tokenizer=None, device: str = "auto"):
    """``(model, tokenizer, config, trainer_state, checkpoint_dir, run_dir)``, the model in eval mode on ``device``.

    Loads through ``trainer.load_trained`` (looked up at call time, so tests can replace it).
    """
    from . import trainer

    checkpoint_dir, run_dir = resolve_run(checkpoint)
    model, tokenizer, config, state = trainer.load_trained(checkpoint_dir, model_and_tokenizer)
    model = model.to(trainer.choose_device(device)).eval()
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


def _write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, allow_nan=False, default=str) + "\n")
    return path


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint directory (RUN/checkpoints/step-NNNNNN) or run directory (latest checkpoint)"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to run the model")
    parser.add_argument("--seed", type=int, default=0, help="seed of every sample drawn (results are deterministic)")


# --------------------------------------------------------------------------- eval


def run_eval(
    checkpoint: str | Path,
    *,
    data: str | None = None,
    output: str | Path | None = None,
    max_examples: int | None = None,
    iw_samples: int = 8,
    prior_samples: int = 16,
    exact_limit: int = 64,
    seed: int = 0,
    batch_size: int = 16,
    device: str = "auto",
    progress: bool = True,
    generation: bool = False,
    generation_prompts: int = 8,
    generation_max_new_tokens: int = 32,
    generation_latents: int = 8,
    model_and_tokenizer=None,
) -> tuple[dict, Path, Path]:
    """Evaluate a checkpoint (:func:`evaluation.evaluate`); write the JSON report and a Markdown summary.

    ``output`` defaults to ``RUN/eval/eval_<data>.json``; the summary is the same path with ``.md``.
    With ``generation`` the report gets ``controllability`` (:func:`controllability.controllability` on
    ``generation_prompts`` prompts of ``data``, ``generation_max_new_tokens`` greedy tokens, and
    ``generation_latents`` prior draws per prompt for a continuous model).
    Returns ``(report, json_path, markdown_path)``.
    """
    from .evaluation import evaluate
    from .features import build_feature_cache
    from .report import write_markdown_summary

    # options first, before the model loads
    for flag, value in (("--iw-samples", iw_samples), ("--prior-samples", prior_samples), ("--batch-size", batch_size)):
        _check_at_least(flag, value, 1)
    _check_at_least("--exact-limit", exact_limit, 0)
    _check_at_least("--max-examples", max_examples, 1, optional=True)
    if generation:
        _check_at_least("--generation-prompts", generation_prompts, 1)
        _check_at_least("--generation-max-new-tokens", generation_max_new_tokens, 1)
        _check_at_least("--generation-latents", generation_latents, 2)
    if output is not None and Path(output).is_dir():
        raise ValueError(f"--output {output} is a directory; expected the path of the JSON report")
    check_data_option(checkpoint, data)
    checkpoint_dir, run_dir = resolve_run(checkpoint)
    json_path = Path(output) if output is not None else run_dir / "eval" / f"eval_{_slug(data)}.json"
    check_writable_target(json_path, "--output")
    model, tokenizer, config, state, checkpoint_dir, run_dir = load_checkpoint(checkpoint, model_and_tokenizer, device)
    examples, description = load_examples(data, config, tokenizer, max_examples, seed)
    model_device = next(model.parameters()).device
    cache = build_feature_cache(
        model, examples, tokenizer.pad_token_id, batch_size, model_device, progress, description="frozen pass"
    )
    body = evaluate(
        model,
        examples,
        cache,
        tokenizer.pad_token_id,
        iw_samples=iw_samples,
        prior_samples=prior_samples,
        exact_limit=exact_limit,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
    report = {
        "title": f"Evaluation of {checkpoint_dir}",
        "checkpoint": str(checkpoint_dir),
        "step": state.get("step"),
        "data": description,
        **body,
    }
    if generation:
        from .controllability import controllability
        from .encode import raw_pairs

        report["controllability"] = controllability(
            model,
            tokenizer,
            config,
            examples,
            cache,
            raw_pairs(data, config, examples),
            num_prompts=generation_prompts,
            max_new_tokens=generation_max_new_tokens,
            prior_latents=generation_latents,
            seed=seed,
            batch_size=batch_size,
        )
    _write_json(json_path, report)
    md_path = write_markdown_summary(report, json_path.with_suffix(".md"))
    return report, json_path, md_path


def eval_summary_lines(report: dict) -> list[str]:
    """The headline numbers of an evaluation report, one per line."""
    lines = [
        f"examples: {report['examples']} ({report['response_tokens']} response tokens) from {report['data']}",
        f"latent gain:  {report['latent_gain_nats_per_token']:+.4f} nats/token "
        f"(token-weighted {report['token_weighted_latent_gain_nats_per_token']:+.4f}); prior as "
        f"{report['prior_mixture']['method']} over {report['prior_mixture']['latents']} latents",
        f"z-free gain:  {report['zfree_gain_nats_per_token']:+.4f} nats/token "
        f"(token-weighted {report['token_weighted_zfree_gain_nats_per_token']:+.4f})",
        f"IW NLL:       {report['iw_nll']['nats_per_token']:.4f} nats/token, perplexity "
        f"{report['iw_nll']['perplexity']:.3f}; KL {report['kl']['total']:.4f}; MI {report['mutual_information']:.4f}",
    ]
    if "code_perplexity" in report:
        lines.append(f"code perplexity per slot: {[round(v, 3) for v in report['code_perplexity']]}")
    if "active_units" in report:
        lines.append(f"active units: {report['active_units']}")
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
    if "controllability" in report:
        from .controllability import summary_lines

        lines += summary_lines(report["controllability"])
    return lines


def _add_eval(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint: gains, ELBO, IW bound, KL, MI, code usage, label agreement",
        description="Evaluate a checkpoint; write a JSON report and a Markdown summary next to it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_common(parser)
    parser.add_argument("--data", default="validation", help="validation, train, chatterbot or a .jsonl file")
    parser.add_argument("--output", help="JSON report path (default RUN/eval/eval_<data>.json); .md next to it")
    parser.add_argument("--max-examples", type=int, help="evaluate at most this many examples (seeded subset)")
    parser.add_argument("--iw-samples", type=int, default=8, help="posterior samples k of the IW bound")
    parser.add_argument(
        "--prior-samples", type=int, default=16, help="prior samples (continuous, or too many code combinations)"
    )
    parser.add_argument(
        "--exact-limit", type=int, default=64, help="enumerate the discrete prior exactly up to this many combinations"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="examples per forward pass")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    steering = parser.add_argument_group("controllability (generate under each code or latent, re-encode)")
    steering.add_argument(
        "--generation",
        action="store_true",
        help="also measure controllability: code/latent recovery, label accuracy, distinct-n, z-free NLL",
    )
    steering.add_argument("--generation-prompts", type=int, default=8, help="held-out prompts generated for")
    steering.add_argument("--generation-max-new-tokens", type=int, default=32, help="greedy tokens per generation")
    steering.add_argument(
        "--generation-latents", type=int, default=8, help="continuous: prior draws per prompt (recovery targets)"
    )
    parser.set_defaults(func=_eval_main)


def _eval_main(args: argparse.Namespace) -> int:
    report, json_path, md_path = run_eval(
        args.checkpoint,
        data=args.data,
        output=args.output,
        max_examples=args.max_examples,
        iw_samples=args.iw_samples,
        prior_samples=args.prior_samples,
        exact_limit=args.exact_limit,
        seed=args.seed,
        batch_size=args.batch_size,
        device=args.device,
        progress=args.progress,
        generation=args.generation,
        generation_prompts=args.generation_prompts,
        generation_max_new_tokens=args.generation_max_new_tokens,
        generation_latents=args.generation_latents,
    )
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
    ``sampling`` a :class:`generation.SamplingOptions`). Writes the result as JSON to ``output`` when given."""
    from .generation import generate, parse_range

    if output is not None:
        check_writable_target(output, "--output")
    # the latent file and the steering options before the model loads
    if isinstance(options.get("latents"), str | Path):
        from .encode import read_latents

        options["latents"] = read_latents(options["latents"])
    if options.get("traverse") is not None:
        parse_range(options.get("traverse_range", (-3.0, 3.0)))
    if options.get("attributes"):
        from .encode import parse_attribute

        for spec in options["attributes"]:
            parse_attribute(spec)

    model, tokenizer, config, state, checkpoint_dir, _ = load_checkpoint(checkpoint, model_and_tokenizer, device)
    result = generate(model, tokenizer, config, prompts, batch_size=batch_size, **options)
    result = {"checkpoint": str(checkpoint_dir), "step": state.get("step"), **result}
    if output is not None:
        _write_json(output, result)
    return result


def _add_generate(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate responses under chosen latents (codes, prior samples, posteriors, interpolations)",
        description="Generate responses to prompts under chosen latents; print a table (or JSON) and the "
        "diversity (distinct-1/2) across latents and samples.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_common(parser)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument(
        "--mode",
        choices=("codes", "prior", "posterior", "interpolate", "row", "attribute", "traverse"),
        help="latents: codes (discrete default), prior (continuous default), posterior of --reference-response, "
        "interpolate (continuous) between two reference responses' posteriors; row, attribute, traverse "
        "(continuous; implied by --row, --attribute, --traverse)",
    )
    latent_file = parser.add_argument_group("latents read off data (an output of disentangle encode)")
    latent_file.add_argument("--latents", help="an encode file (.jsonl or .parquet) of this checkpoint")
    latent_file.add_argument(
        "--row", type=int, help="decode with row I's latent: its codes (discrete, as --codes) or its mu"
    )
    latent_file.add_argument(
        "--attribute",
        action="append",
        dest="attributes",
        metavar="LABEL:SCALE",
        help="continuous: add SCALE * (mean(mu | LABEL) - mean(mu)) over --latents to the latent (--row's mu, "
        "else the prompt's prior mean); LABEL is value or factor=value; repeatable",
    )
    latent_file.add_argument(
        "--code-examples",
        type=int,
        default=0,
        metavar="N",
        help="discrete: show each generated code's N most typical responses of --latents (highest posterior)",
    )
    discrete = parser.add_argument_group("discrete latents")
    discrete.add_argument("--slot", type=int, help="sweep every code of this slot (default 0 unless --codes is given)")
    discrete.add_argument("--codes", help="force codes per slot, comma-separated, '-' = prior mode (e.g. 0,2 or -,3)")
    discrete.add_argument("--all-combinations", action="store_true", help="every combination of the unforced slots")
    discrete.add_argument("--max-combinations", type=int, default=64, help="limit of --all-combinations")
    continuous = parser.add_argument_group("continuous latents")
    continuous.add_argument("--reference-response", help="response whose posterior is used (posterior, interpolate)")
    continuous.add_argument("--reference-response-b", help="second reference response (interpolate)")
    continuous.add_argument("--steps", type=int, default=5, help="interpolation or traversal points, ends included")
    continuous.add_argument(
        "--traverse", type=int, metavar="DIM", help="traverse dimension DIM around the prior mean (or --row's mu)"
    )
    continuous.add_argument(
        "--range", dest="traverse_range", default="-3:3", metavar="LOW:HIGH", help="offsets of --traverse"
    )
    parser.add_argument(
        "--num-samples", type=int, default=1, help="responses per latent (prior mode: latents drawn, one response each)"
    )
    sampling = parser.add_argument_group("sampling (as transformers' generate)")
    sampling.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    sampling.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    sampling.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass")
    sampling.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per response at most")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per generate call (left-padded)")
    parser.add_argument("--output", help="write the generations and diversity as JSON here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the text table")
    parser.set_defaults(func=_generate_main)


def _generate_main(args: argparse.Namespace) -> int:
    from .generation import SamplingOptions, format_generations

    sampling = SamplingOptions(
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    result = run_generate(
        args.checkpoint,
        args.prompt,
        output=args.output,
        device=args.device,
        batch_size=args.batch_size,
        mode=args.mode,
        slot=args.slot,
        codes=args.codes,
        all_combinations=args.all_combinations,
        max_combinations=args.max_combinations,
        num_samples=args.num_samples,
        reference_response=args.reference_response,
        reference_response_b=args.reference_response_b,
        steps=args.steps,
        latents=args.latents,
        row=args.row,
        attributes=args.attributes,
        traverse=args.traverse,
        traverse_range=args.traverse_range,
        code_examples=args.code_examples,
        sampling=sampling,
    )
    print(json.dumps(result, indent=1) if args.json else format_generations(result))
    if args.output:
        print(f"written: {args.output}")
    return 0


# --------------------------------------------------------------------------- inspect


def run_inspect(
    checkpoint: str | Path,
    *,
    data: str | None = None,
    index: int = 0,
    output_dir: str | Path | None = None,
    alpha: float | None = None,
    prior_samples: int = 16,
    exact_limit: int = 64,
    max_examples: int | None = None,
    plots: bool = True,
    seed: int = 0,
    batch_size: int = 16,
    device: str = "auto",
    progress: bool = True,
    model_and_tokenizer=None,
) -> dict[str, Any]:
    """Write the token report of example ``index`` of ``data`` and the run's plots.

    ``output_dir`` defaults to ``RUN/inspect``. Files: ``inspect_<index>.html`` and ``.json`` (the
    sidecar), ``training_curves.png``, ``kl.png``, ``schedules.png`` (from ``RUN/metrics.jsonl``),
    ``code_usage.png`` (discrete) and ``code_label_heatmap.png`` (labelled data), the last two over
    the whole ``data`` set. Returns ``{"html", "json", "plots"}`` (paths).
    """
    from .features import build_feature_cache
    from .inspection import write_example_report, write_run_plots

    # options first, before the model loads (the upper bound of --index needs the examples)
    _check_at_least("--index", index, 0)
    _check_at_least("--prior-samples", prior_samples, 1)
    _check_at_least("--batch-size", batch_size, 1)
    _check_at_least("--exact-limit", exact_limit, 0)
    _check_at_least("--max-examples", max_examples, 1, optional=True)
    if alpha is not None and not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"--alpha must be a finite number >= 0, got {alpha!r}")
    if max_examples is not None and index >= max_examples:
        raise ValueError(f"--index {index} is outside [0, {max_examples}) for --max-examples {max_examples}")
    if output_dir is not None and Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ValueError(f"--output-dir {output_dir} exists and is not a directory")
    check_data_option(checkpoint, data)
    check_writable_target(output_dir or resolve_run(checkpoint)[1] / "inspect", "--output-dir", directory=True)
    model, tokenizer, config, state, checkpoint_dir, run_dir = load_checkpoint(checkpoint, model_and_tokenizer, device)
    examples, description = load_examples(data, config, tokenizer, max_examples, seed)
    if not 0 <= index < len(examples):
        raise ValueError(f"--index {index} is outside [0, {len(examples)}) for {description}")
    out_dir = Path(output_dir) if output_dir is not None else run_dir / "inspect"
    extra = {"checkpoint": str(checkpoint_dir), "step": state.get("step"), "data": description}
    html_path, json_path = write_example_report(
        out_dir,
        index,
        model,
        tokenizer,
        examples[index],
        extra_meta=extra,
        alpha=alpha,
        prior_samples=prior_samples,
        exact_limit=exact_limit,
        seed=seed,
    )
    written: list[Path] = []
    if plots:
        model_device = next(model.parameters()).device
        cache = build_feature_cache(
            model, examples, tokenizer.pad_token_id, batch_size, model_device, progress, description="frozen pass"
        )
        written = write_run_plots(
            out_dir, model, examples, cache, tokenizer.pad_token_id, run_dir / "metrics.jsonl", seed=seed
        )
    return {"html": html_path, "json": json_path, "plots": written}


def _add_inspect(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="token heat map of one example (HTML + JSON) and the run's plots (PNG)",
        description="Write a self-contained HTML page colouring one example's response tokens by z-free "
        "surprisal, token weight, inverse weight, conditioned NLL and gain (with a JSON sidecar), and PNG "
        "plots of the run: training curves, KL and schedules, code usage, code x label heat map.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_common(parser)
    parser.add_argument("--data", default="validation", help="validation, train, chatterbot or a .jsonl file")
    parser.add_argument("--index", type=int, default=0, help="index of the example in --data")
    parser.add_argument("--output-dir", help="where to write (default RUN/inspect)")
    parser.add_argument("--alpha", type=float, help="token-weight alpha (default: the run's configured alpha)")
    parser.add_argument("--prior-samples", type=int, default=16, help="prior samples for the prior-mixture NLL")
    parser.add_argument("--exact-limit", type=int, default=64, help="exact discrete prior up to this many combinations")
    parser.add_argument("--max-examples", type=int, help="use at most this many examples of --data (seeded subset)")
    parser.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="write the PNG plots")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per forward pass")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    explore = parser.add_argument_group(
        "corpus explorer (--explore)",
        "one self-contained HTML page: per code (per slot) or per k-means cluster of posterior means, its share, "
        "label distribution, most confident examples with token heat maps, and greedy generations under it",
    )
    explore.add_argument(
        "--explore", action="store_true", help="write the corpus explorer page instead of one example's report"
    )
    explore.add_argument(
        "--output", help="the explorer page (default: OUTPUT_DIR/explorer.html, else RUN/inspect/explorer.html)"
    )
    explore.add_argument("--explore-examples", type=int, default=3, help="most confident examples shown per group")
    explore.add_argument(
        "--explore-prompts", type=int, default=3, help="generate for the first N distinct prompts of --data"
    )
    explore.add_argument(
        "--explore-prompt",
        action="append",
        dest="explore_prompt_texts",
        metavar="TEXT",
        help="generate for this prompt instead (repeatable)",
    )
    explore.add_argument("--explore-tokens", type=int, default=16, help="new tokens per generation (greedy)")
    explore.add_argument(
        "--clusters", type=int, help="continuous: k-means clusters (default: the first factor's values, else 8)"
    )
    parser.set_defaults(func=_inspect_main)


def _explore_main(args: argparse.Namespace) -> int:
    from .explorer import run_explore

    output = args.output
    if output is None and args.output_dir is not None:
        output = Path(args.output_dir) / "explorer.html"
    path = run_explore(
        args.checkpoint,
        data=args.data,
        output=output,
        examples_per_group=args.explore_examples,
        prompts=args.explore_prompt_texts,
        num_prompts=args.explore_prompts,
        max_new_tokens=args.explore_tokens,
        clusters=args.clusters,
        max_examples=args.max_examples,
        prior_samples=args.prior_samples,
        exact_limit=args.exact_limit,
        seed=args.seed,
        batch_size=args.batch_size,
        device=args.device,
        progress=args.progress,
    )
    print(f"explorer: {path}")
    return 0


def _inspect_main(args: argparse.Namespace) -> int:
    if args.explore:
        return _explore_main(args)
    if args.output is not None:
        raise ValueError("--output is the explorer page's path; use it with --explore (or --output-dir)")
    paths = run_inspect(
        args.checkpoint,
        data=args.data,
        index=args.index,
        output_dir=args.output_dir,
        alpha=args.alpha,
        prior_samples=args.prior_samples,
        exact_limit=args.exact_limit,
        max_examples=args.max_examples,
        plots=args.plots,
        seed=args.seed,
        batch_size=args.batch_size,
        device=args.device,
        progress=args.progress,
    )
    print(f"token report: {paths['html']}")
    print(f"sidecar:      {paths['json']}")
    for path in paths["plots"]:
        print(f"plot:         {path}")
    return 0


def add_subcommands(subparsers) -> None:
    """Register ``eval``, ``generate`` and ``inspect`` on the ``disentangle`` parser."""
    _add_eval(subparsers)
    _add_generate(subparsers)
    _add_inspect(subparsers)
