"""The subcommands that work on a trained checkpoint: ``eval``, ``generate``, ``inspect`` and ``encode``.

    disentangle eval CHECKPOINT [--data validation|train|chatterbot|FILE.jsonl] [--output report.json]
    disentangle generate CHECKPOINT --prompt "..." [--slot S | --codes 0,2 | --all-combinations] [...]
    disentangle inspect CHECKPOINT [--data ...] --index I [--output-dir DIR]
    disentangle inspect CHECKPOINT --explore [--data ...] [--output PAGE.html]   # explorer.py
    disentangle encode CHECKPOINT [--data ...] --output latents.jsonl             # encode.py

Each subcommand has a ``run_*`` function that tests call with an injected ``model_and_tokenizer`` (the decoder
and tokenizer the checkpoint's trainable weights are loaded onto), and a ``*_main`` function that ``cli.py``'s
table of subcommands calls with the parsed command line. Opening the run (the checkpoint, ``--data``, the checks
before the model loads) is ``runs.py``; the options and their ranges are ``options.py``: an options instance
checks its numeric fields when it is made, so a flag out of range fails before the model loads, as a malformed
``--data`` file does (:func:`runs.check_data_option` reads only the checkpoint's ``config.yaml``).

The ``run_*`` functions take an options instance (:class:`options.EvalOptions`, ...), with keyword overrides on
top.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from typing import Any

from .options import (
    EncodeOptions,
    EvalOptions,
    GenerateOptions,
    InspectOptions,
    RefitOptions,
    check_at_least,
    options_from,
    with_overrides,
)
from .runs import (
    SPLITS,
    check_data_option,
    check_writable_target,
    load_checkpoint,
    load_examples,
    prepare_run_data,
    resolve_run,
    seen_in_training,
    stored_features,
)

logger = logging.getLogger(__name__)


def _slug(data: str | None) -> str:
    data = data or "validation"
    name = data if data in (*SPLITS, "chatterbot") else Path(data).stem
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _write_json(path: str | Path, obj: Any, root: str | Path | None = None) -> Path:
    """``obj`` as JSON at ``path``, never through a symbolic link (:func:`safe_io.write_json`; ``root``: the
    run directory when the path is the command's default inside it, whose folders must be real)."""
    from .safe_io import write_json

    return write_json(path, obj, root, indent=1, default=str)


# --------------------------------------------------------------------------- eval


def run_eval(
    checkpoint: str | Path, options: EvalOptions | None = None, *, model_and_tokenizer=None, **overrides: Any
) -> tuple[dict, Path, Path]:
    """Evaluate a checkpoint (:func:`evaluation.evaluate_records`); write the JSON report and a Markdown summary.

    ``options`` (default :class:`EvalOptions`) with the keyword ``overrides`` on top (``run_eval(ckpt,
    data="train", iw_samples=4)``). ``output`` defaults to ``RUN/eval/eval_<data>.json``; the summary is the
    same path with ``.md``. With ``generation`` the report gets ``controllability``
    (:func:`controllability.controllability` on ``generation_prompts`` prompts of ``data``,
    ``generation_max_new_tokens`` tokens at most (default the run's ``data.max_response_tokens``), greedy or
    sampled at ``generation_temperature``, and ``generation_latents`` prior draws per prompt for a continuous
    model; with the decoder's likeliest codes of
    the report's ``decoder_posterior``, its read-back by them too). Returns
    ``(report, json_path, markdown_path)``.
    """
    from .report import write_markdown_summary

    options = with_overrides(EvalOptions, options, overrides)  # its numbers are checked as it is made
    # the rest of the options, the data and the output before the model loads
    scoring = options.scoring()
    json_path = _eval_report_path(checkpoint, options)
    # Under ``accelerate launch --num_processes N`` the frozen pass and the scoring are shared out among
    # the processes and gathered; the main process alone writes the report.
    from . import distributed, trainer

    processes = distributed.process_state(cpu=trainer.choose_device(options.device).type == "cpu")
    main = distributed.is_main(processes)
    model, tokenizer, config, state, checkpoint_dir, run_dir = load_checkpoint(
        checkpoint, model_and_tokenizer, options.device, processes
    )
    prepared = prepare_run_data(options.data, config, tokenizer)
    examples, description = load_examples(options.data, config, tokenizer, options.max_examples, options.seed, prepared)
    seen = seen_in_training(options.data, config, tokenizer, examples, prepared)
    cache = stored_features(
        model, examples, tokenizer.pad_token_id, options.batch_size, progress=options.progress and main, state=processes
    )
    body, records = _evaluate_and_judge(model, tokenizer, examples, cache, scoring, options, processes, main)
    report = {
        "title": f"Evaluation of {checkpoint_dir}",
        "checkpoint": str(checkpoint_dir),
        "step": state.get("step"),
        "data": description,
        **({} if seen is None else {"seen_in_training": seen}),
        **body,
    }
    if not main:
        return report, json_path, json_path.with_suffix(".md")
    if options.generation:
        report["controllability"] = _eval_controllability(
            model, tokenizer, config, examples, cache, options, records.get("decoder_codes")
        )
    _write_json(json_path, report, root=run_dir if options.output is None else None)
    md_path = write_markdown_summary(report, json_path.with_suffix(".md"))
    return report, json_path, md_path


def _eval_report_path(checkpoint: str | Path, options: EvalOptions) -> Path:
    """Where ``eval`` writes its JSON report (``--output``, else ``RUN/eval/eval_<data>.json``), after checking,
    before any model loads, that ``--data`` can be read and that the report can be written there."""
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
    return json_path


def _evaluate_and_judge(model, tokenizer, examples, cache, scoring, options: EvalOptions, processes, main: bool):
    """The body of the evaluation report with its ``verdict`` (:func:`verdict.judge`), and its per-example
    records (:func:`evaluation.evaluate_records`): on every process, the main one's ``progress`` alone shown."""
    from .evaluation import evaluate_records
    from .verdict import judge

    body, records = evaluate_records(
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
    result = judge(body)
    body["verdict"] = {"verdict": result["verdict"], "reason": result["reason"]}
    return body, records


def _eval_controllability(model, tokenizer, config, examples, cache, options: EvalOptions, decoder_codes) -> dict:
    """``eval --generation``'s ``controllability`` section (:func:`controllability.controllability`);
    ``decoder_codes`` (the real examples' decoder's likeliest codes, or None) for the read-back by them."""
    from .controllability import controllability
    from .encode import raw_pairs
    from .guidance import Guidance

    return controllability(
        model,
        tokenizer,
        config,
        examples,
        cache,
        raw_pairs(options.data, config, examples),
        num_prompts=options.generation_prompts,
        samples=options.generation_samples,
        max_new_tokens=options.generation_max_new_tokens,
        no_repeat_ngram=options.generation_no_repeat_ngram,
        temperature=options.generation_temperature,
        top_p=options.generation_top_p,
        prior_latents=options.generation_latents,
        guidance=Guidance(options.generation_guidance, options.generation_guidance_plausibility),
        seed=options.seed,
        batch_size=options.batch_size,
        progress=options.progress,
        decoder_codes=decoder_codes,
    )


#: The NMI by which the decoder's likeliest codes must beat the encoder's on a factor for eval to point at them.
DECODER_HINT_MARGIN = 0.05


def eval_summary_lines(report: dict) -> list[str]:
    """The headline numbers of an evaluation report, one per line, and the verdict (:func:`verdict.judge`):
    code usage or active units, each factor's NMI beside its baselines, then ``verdict: ...``."""
    lines = [f"examples: {report['examples']} ({report['response_tokens']} response tokens) from {report['data']}"]
    seen = report.get("seen_in_training")
    if seen and seen["pairs"]:
        lines.append(
            f"warning: {seen['pairs']} of the {report['examples']} examples are pairs the run trained on (prompt and "
            "response): on them the numbers measure what training saw, not held-out data ('data synth --heldout' "
            "writes held-out rows of a built-in set)"
        )
    lines += [
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
    decoder = report.get("decoder_posterior")
    for name, entry in (report.get("factors") or {}).items():
        own = f", the decoder's posterior {decoder['factors'][name]['decoder']:.2f}" if decoder else ""
        lines.append(
            f"factor {name}: NMI {entry['latent']['nmi']:.2f} (encoder k-means {entry['encoder_kmeans']['nmi']:.2f}, "
            f"prior k-means {entry['prior_kmeans']['nmi']:.2f}, random {entry['random']['nmi']:.2f}{own})"
        )
    if decoder:
        lines.append(
            f"the encoder's code is the decoder's likeliest (argmax p(k | x) p(y | x, k), per slot) on "
            f"{decoder['agreement']:.0%} of the examples"
        )
        if "best_latent_gain_nats_per_token" in decoder:  # not in reports written before it was measured
            likeliest, best = decoder["latent_gain_nats_per_token"], decoder["best_latent_gain_nats_per_token"]
            lines.append(
                f"latent gain under the decoder's likeliest code combination {likeliest:+.4f} nats/token, under the "
                f"best one {best:+.4f} (the most any encoder's codes can gain with this decoder; the encoder's "
                f"{report['latent_gain_nats_per_token']:+.4f})"
            )
        better = {
            name: entry
            for name, entry in (decoder.get("factors") or {}).items()
            if entry["decoder"] >= entry["encoder"] + DECODER_HINT_MARGIN
        }
        for name, entry in better.items():
            lines.append(
                f"hint: the decoder's likeliest codes hold factor {name} better than the encoder's "
                f"({entry['decoder']:.2f} against {entry['encoder']:.2f}): encode writes them as decoder_codes"
            )
    lines.append(f"verdict: {result['verdict']} ({result['reason']})")
    if "controllability" in report:
        from .controllability import summary_lines

        lines += summary_lines(report["controllability"])
    return lines


def eval_main(args: argparse.Namespace) -> int:
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

    check_at_least("--batch-size", batch_size, 1)
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


def generate_main(args: argparse.Namespace) -> int:
    from .generation import format_generations

    options = options_from(GenerateOptions, args)  # its numbers are checked as it is made
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

    options = with_overrides(InspectOptions, options, overrides)  # its numbers are checked as it is made
    # the rest before the model loads (the upper bound of --index needs the examples)
    scoring = options.scoring()
    alpha = options.alpha
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


def explore_main(checkpoint: str, options: InspectOptions) -> int:
    from .explorer import run_explore

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


def inspect_main(args: argparse.Namespace) -> int:
    options = options_from(InspectOptions, args)
    if options.explore:
        return explore_main(args.checkpoint, options)
    if options.output is not None:
        raise ValueError("--output is the explorer page's path; use it with --explore (or --output-dir)")
    paths = run_inspect(args.checkpoint, options)
    print(f"token report: {paths['html']}")
    print(f"sidecar:      {paths['json']}")
    for path in paths["plots"]:
        print(f"plot:         {path}")
    return 0


# --------------------------------------------------------------------------- encode


def encode_main(args: argparse.Namespace) -> int:
    from .encode import encode_to_file

    options = options_from(EncodeOptions, args)
    path, count = encode_to_file(args.checkpoint, options)
    print(f"wrote {count} rows to {path}")
    return 0


# --------------------------------------------------------------------------- refit-encoder


def refit_main(args: argparse.Namespace) -> int:
    from .encoder_refit import REPORT_FILE, refit_encoder

    report = refit_encoder(args.checkpoint, options_from(RefitOptions, args))
    before, after = report["before"], report["after"]
    share = lambda value: "-" if value is None else f"{value:.3f}"  # noqa: E731
    print(
        f"the encoder's code is the decoder's likeliest on {share(before['fit_agreement'])} -> "
        f"{share(after['fit_agreement'])} of the {report['fit_examples']} pairs fit, {share(before['holdout_agreement'])}"
        f" -> {share(after['holdout_agreement'])} of the {report['holdout_examples']} held out; the NLL under its codes "
        f"above the best codes' {share(before['holdout_regret'])} -> {share(after['holdout_regret'])} nats per response "
        f"token held out (epoch {report['kept_epoch']} of {report['epochs']} kept)"
    )
    if report.get("chosen"):
        regrets = ", ".join(f"{name} {fit['after']['holdout_regret']:.3g}" for name, fit in report["fits"].items())
        print(f"kept the {report['chosen']} fit (held-out NLL above the best codes': {regrets})")
    if report["widened"]:
        print(f"the encoder widened: encoder_view {report['encoder_view']}, encoder_block {report['encoder_block']}")
    if report["stopped"]:
        print(f"stopped early: {report['stopped']}")
    print(f"checkpoint: {report['checkpoint']}")
    print(f"report:     {Path(args.output_dir) / REPORT_FILE}")
    return 0
