"""``disentangle``: train, evaluate, generate from and inspect surprisal-weighted CVAEs.

    disentangle train [--preset NAME] [--config run.yaml] [--any-config-flag VALUE ...]
    disentangle eval CHECKPOINT [--data ...] [--output report.json]
    disentangle generate CHECKPOINT --prompt "..." [...]
    disentangle inspect CHECKPOINT --data ... --index I
    disentangle inspect CHECKPOINT --explore [--output PAGE.html]
    disentangle encode CHECKPOINT --data ... --output latents.jsonl
    disentangle data synth NAME --output FILE.jsonl [--rows N] [--seed S]
    disentangle export RUN --output DIR [--push-to-hub REPO]
    disentangle sweep --config base.yaml --output-dir OUT --set FIELD=V1,V2 --seeds 0,1,2 [...]
    disentangle cache list|clear [--dir DIR]

Every subcommand is registered in one table, :data:`SUBCOMMANDS`: its help, its description and the
function that adds its arguments. Training flags are generated from the config dataclasses (``config.py``),
those of eval, generate, inspect and encode from their options dataclasses (``options.py``): every field has one.

Exit codes: 0 done; 2 bad input (config, data, checkpoint; the message names the file, line or
field); 3 training diverged (the message names the last good checkpoint); 4 an OS error such as a
full or read-only disk (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import commands, export, feature_store_files, sweep, synthetic
from .config import (
    DEFAULT_PRESET,
    FIELDS,
    OBJECTIVE_FIELDS,
    PRESET_KEY,
    PRESETS,
    ConfigError,
    HelpFormatter,
    TrainConfig,
    add_config_arguments,
    build_config,
    config_from_namespace,
    load_run_config,
    preset_values,
    presets_help,
    read_config_file,
)
from .options import (
    EncodeOptions,
    EvalOptions,
    GenerateOptions,
    InspectOptions,
    RefitOptions,
    add_option_arguments,
)


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON config file (flat field names or nested by section)")
    parser.add_argument(
        "--preset",
        default=argparse.SUPPRESS,
        metavar="PRESET",
        help=f"a named recipe under the config file and flags: one of {', '.join(PRESETS)} (the defaults are "
        f"preset {DEFAULT_PRESET}'s); a config file may also say 'preset: NAME'",
    )
    parser.add_argument(
        "--no-verdict",
        dest="verdict",
        action="store_false",
        help="end without the verdict on the validation split: it scores every validation example under every "
        "code, which with a decoder trained whole takes as long as 'disentangle eval RUN' on that split (which "
        "prints the same numbers whenever wanted); a flag only, not a config field",
    )
    add_config_arguments(parser)
    parser.set_defaults(func=_run_train)


def _checkpoint_arguments(options: type, run: Callable[[argparse.Namespace], int]):
    """The arguments of a subcommand that works on a checkpoint: the checkpoint, then one flag per field of its
    ``options`` dataclass (:func:`options.add_option_arguments`); ``run`` runs it."""

    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "checkpoint", help="checkpoint directory (RUN/checkpoints/step-NNNNNN) or run directory (latest checkpoint)"
        )
        add_option_arguments(parser, options)
        parser.set_defaults(func=run)

    return add


#: Where a run writes: never taken from a stored config (a checkpoint handed to a user must not choose).
_NOT_FROM_CHECKPOINT = ("output_dir", "feature_cache_dir", "model_cache_dir", "resume", "overwrite")


def _stored_config_path(resume: str, output_dir: Path) -> Path | None:
    """The config a resumed run continues: the run's own, else its newest checkpoint's."""
    from .checkpoints import latest_checkpoint

    path = output_dir if resume == "auto" else Path(resume)
    for candidate in (path / "config.yaml", (latest_checkpoint(path) or path) / "config.yaml"):
        if candidate.is_file():
            return candidate
    return None


def _train_config(args: argparse.Namespace):
    """The config of ``train``. Resuming starts from the run's stored config, so that
    ``--resume auto --output-dir RUN`` continues RUN as it was configured; a preset, ``--config`` and flags go on
    top (in that order).
    Where the run writes (``output_dir``, the cache directories) never comes from a stored config:
    ``--resume RUN/checkpoints/step-N`` without ``--output-dir`` continues in RUN."""
    given = {k: v for k, v in vars(args).items() if k in FIELDS or k == PRESET_KEY}
    file_values = read_config_file(args.config) if getattr(args, "config", None) else {}
    resume = given.get("resume", file_values.get("resume"))
    if resume is None:
        return config_from_namespace(args)
    # Not validated before the stored config is under it: a preset's fields that the run set otherwise (steer's
    # decoder_posterior_start 180 in a run of 120 steps that started its term at 90) are not the run's.
    output_dir = given.get("output_dir", file_values.get("output_dir", TrainConfig.output_dir))
    values: dict = {}
    stored = _stored_config_path(resume, Path(output_dir))
    if stored is not None:
        values = {k: v for section in load_run_config(stored).to_dict().values() for k, v in section.items()}
        values = {k: v for k, v in values.items() if k not in _NOT_FROM_CHECKPOINT}
    if resume != "auto" and "output_dir" not in given and "output_dir" not in file_values:
        path = Path(resume)
        values["output_dir"] = str(path if (path / "checkpoints").is_dir() else path.parent.parent)
    preset = given.get(PRESET_KEY, file_values.get(PRESET_KEY))
    if preset is not None and stored is not None:  # a preset given now goes over the stored objective, not under it
        # (resume's own checks then accept or refuse the change); the decoder's training, the code's placement,
        # the codebook's start, the decoder-posterior term and the steps stay the run's
        values.update({k: v for k, v in preset_values(preset).items() if k in OBJECTIVE_FIELDS})
    values.update(file_values)
    values.update(given)
    return build_config(values)


def _run_train(args: argparse.Namespace) -> int:
    config = _train_config(args)
    from .trainer import train

    result = train(config)
    from .distributed import is_main_process

    if not is_main_process():
        return 0
    _record_command(result.output_dir, getattr(args, "argv", None))
    print(f"metrics:    {result.output_dir / 'metrics.jsonl'}")
    print(f"checkpoint: {result.checkpoint}")
    print(f"c_base:     {result.zfree_reference_scale:.4f} nats/token (z-free reference scale)")
    summary = {k: round(v, 4) for k, v in result.last_metrics.items() if k.startswith("val_") and "loss" in k}
    if summary:
        print("validation: " + json.dumps(summary))
    if not getattr(args, "verdict", True):
        print(f"verdict: not judged (--no-verdict; 'disentangle eval {result.output_dir}' judges the run)")
        return 0
    from .verdict import train_verdict, verdict_lines

    judged = train_verdict(result, config)
    if judged is None:
        print("verdict: none (the run has no validation split to judge the latent on)")
    else:
        report, verdict = judged
        print(f"on the validation split ({len(result.data.validation)} examples):")
        print("\n".join(verdict_lines(report, verdict)))
        saved = _write_verdict(result, report, verdict)
        print(f"verdict report: {saved} (the numbers 'disentangle eval {result.output_dir}' gives)")
    return 0


def _write_verdict(result, report: dict, verdict: dict) -> Path:
    """The verdict's report in the run folder, ``RUN/verdict.json``: what ``eval``'s report on the validation split
    holds, with the verdict, so that it outlives the terminal."""
    from .commands import _write_json
    from .runs import training_overlap

    report = {
        "title": f"The verdict of {result.checkpoint} on its validation split",
        "checkpoint": str(result.checkpoint),
        "step": result.final_step,
        "data": f"the run's validation split ({len(result.data.validation)} examples)",
        "seen_in_training": training_overlap(result.data.train, result.data.validation),
        **report,
        "verdict": {"verdict": verdict["verdict"], "reason": verdict["reason"]},
    }
    return _write_json(Path(result.output_dir) / "verdict.json", report, root=result.output_dir)


def _record_command(run_dir: Path, argv: Sequence[str] | None) -> None:
    """Append the command line of this ``train`` to RUN/command.txt (``export`` puts it in the model card)."""
    if argv is None:
        return
    import shlex

    from .export import COMMAND_FILE
    from .safe_io import open_append

    try:
        with open_append(Path(run_dir) / COMMAND_FILE, run_dir) as handle:  # never through a link
            handle.write("disentangle " + shlex.join(argv) + "\n")
    except OSError as exc:  # the run itself is complete; the record is a convenience
        logging.getLogger(__name__).warning("could not record the command in %s: %s", run_dir, exc)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that an argument error prints a short usage (the positionals, the required
    options and ``[options]``), the error and where the full list is, not the whole usage (74 lines for
    ``train``). Subcommands' parsers are of this class too (``add_subparsers`` takes the parent's class)."""

    def short_usage(self) -> str:
        parts: list[str] = []
        optional = False
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                parts.append("{" + ",".join(action.choices) + "} ...")
            elif not action.option_strings:
                parts.append(action.metavar or action.dest.upper())
            elif action.required:
                parts.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
            elif action.help is not argparse.SUPPRESS:
                optional = True
        return "usage: " + " ".join([self.prog, *(["[options]"] if optional else []), *parts])

    def parse_known_args(self, args=None, namespace=None):
        """Other spellings of a flag (``flag_aliases``, see ``config.register_flag_aliases``) become the flag."""
        aliases = self.__dict__.get("flag_aliases")
        if aliases and args is not None:
            args = list(args)
            for i, arg in enumerate(args):
                if arg == "--":
                    break
                name, eq, value = arg.partition("=")
                if name in aliases:
                    args[i] = aliases[name] + eq + value
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(
            2, f"{self.short_usage()}\n{self.prog}: error: {message}\n(`{self.prog} --help` lists every option)\n"
        )


@dataclass(frozen=True)
class Subcommand:
    """One subcommand of ``disentangle``: what ``--help`` says of it, and ``arguments``, the function that adds
    its arguments to its parser and sets ``func`` (what runs it: ``func(args)`` returns the exit code)."""

    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]
    formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter
    epilog: str | None = None


#: Every subcommand of ``disentangle``, in the order ``disentangle --help`` lists them.
SUBCOMMANDS: dict[str, Subcommand] = {
    "train": Subcommand(
        "train a CVAE",
        "Train a CVAE. Precedence: the defaults (those of --preset default) < --preset < the --config file < flags; "
        "the resolved config is written to OUTPUT_DIR/config.yaml. Presets: " + presets_help() + ".",
        _add_train_arguments,
        HelpFormatter,
    ),
    "eval": Subcommand(
        "evaluate a checkpoint: gains, ELBO, IW bound, KL, MI, code usage, label agreement",
        "Evaluate a checkpoint; write a JSON report and a Markdown summary next to it.",
        _checkpoint_arguments(EvalOptions, commands.eval_main),
        HelpFormatter,
    ),
    "generate": Subcommand(
        "generate responses under chosen latents (codes, prior samples, posteriors, interpolations)",
        "Generate responses to prompts under chosen latents; print a table (or JSON) and the diversity "
        "(distinct-1/2) across latents and samples.",
        _checkpoint_arguments(GenerateOptions, commands.generate_main),
        HelpFormatter,
    ),
    "inspect": Subcommand(
        "token heat map of one example (HTML + JSON) and the run's plots (PNG)",
        "Write a self-contained HTML page colouring one example's response tokens by z-free surprisal, token "
        "weight, inverse weight, conditioned NLL and gain (with a JSON sidecar), and PNG plots of the run: "
        "training curves, KL and schedules, code usage, code x label heat map.",
        _checkpoint_arguments(InspectOptions, commands.inspect_main),
        HelpFormatter,
    ),
    "encode": Subcommand(
        "read z off data: one row per example (codes or mu, posterior, prior, KL, latent gain)",
        "Encode every example of --data with a checkpoint and write one row per example, in data order, to a "
        ".jsonl (or .parquet, with pyarrow) file: source, prompt, response, label, the posterior and prior "
        "latents, the per-example KL and latent gain (the numbers eval aggregates, for the same options).",
        _checkpoint_arguments(EncodeOptions, commands.encode_main),
        HelpFormatter,
    ),
    "refit-encoder": Subcommand(
        "fit a trained discrete run's encoder alone to its decoder's own likeliest codes (a new run)",
        "Compute the exact posterior r(k | x, y) of the codes under a trained discrete run's decoder and prior for "
        "every pair of --data, fit the encoder alone to it (the decoder, codebook and prior unchanged) and write "
        "the refit run to --output-dir: a checkpoint to pass to eval, encode, generate and inspect, and "
        "encoder_refit.json (the agreement with the decoder's codes before and after).",
        _checkpoint_arguments(RefitOptions, commands.refit_main),
        HelpFormatter,
    ),
    "export": Subcommand(
        "write a self-contained checkpoint to hand over (and upload it to the Hugging Face hub)",
        "Write a self-contained export directory of a run or checkpoint: model.safetensors, config.yaml, the "
        "base model's name and weight hash, and a model card README.md with the eval metrics and their "
        "baselines. Load it with disentanglement.load(DIR) or pass it to eval, encode, generate, inspect.",
        export.add_export_arguments,
    ),
    "sweep": Subcommand(
        "train and evaluate a grid of settings over seeds; report means with 95%% intervals",
        sweep.__doc__.split("\n\n")[0],
        sweep.add_sweep_arguments,
        argparse.RawDescriptionHelpFormatter,
        epilog=sweep.__doc__.split("\n\n", 1)[1],
    ),
    "data": Subcommand("built-in data sets", "Built-in data sets.", synthetic.add_data_arguments),
    "cache": Subcommand(
        "list or clear the shared frozen-pass feature cache",
        "The frozen-pass feature cache shared by every run (docs/feature-cache.md). Its folder: "
        f"--dir, else ${feature_store_files.ENV_DIR}, else {feature_store_files.DEFAULT_DIR}.",
        feature_store_files.add_cache_arguments,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="disentangle", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, subcommand in SUBCOMMANDS.items():
        kwargs: dict[str, Any] = {"epilog": subcommand.epilog} if subcommand.epilog is not None else {}
        sub = subparsers.add_parser(
            name,
            help=subcommand.help,
            description=subcommand.description,
            formatter_class=subcommand.formatter_class,
            **kwargs,
        )
        subcommand.arguments(sub)
    return parser


_RANGE_FLAGS = ("--range", "--traverse-range", "--traverse_range")


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """``--range -3:3`` -> ``--range=-3:3``: argparse takes a value that starts with '-' (and is not a plain
    negative number) for an option."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _RANGE_FLAGS and arg.startswith("-") and not arg.startswith("--"):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_attach_negative_values(argv))
    args.argv = argv
    from .distributed import is_main_process

    logging.basicConfig(  # under a launcher with several processes, the others say only what goes wrong
        level=logging.DEBUG if args.verbose else logging.INFO if is_main_process() else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        return _fail(args, exc, 2)
    except RuntimeError as exc:
        # trainer (torch, transformers: seconds to import) is looked up only if loaded: `data synth --list`
        # and the other light commands never import it, and then it raised nothing
        trainer = sys.modules.get(f"{__package__}.trainer")
        if trainer is not None and isinstance(exc, trainer.TrainingDiverged):
            return _fail(args, exc, 3)
        raise
    except OSError as exc:  # disk full, read-only or vanished files: the message names the file
        return _fail(args, exc, 4)


def _fail(args: argparse.Namespace, exc: Exception, code: int) -> int:
    """One line naming the cause (the traceback with --verbose)."""
    if args.verbose:
        logging.getLogger(__name__).exception("disentangle %s failed", args.command)
    message = " ".join(str(exc).split("\n")[:1]) if isinstance(exc, OSError) else str(exc)
    print(f"disentangle {args.command}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
