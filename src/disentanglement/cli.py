"""``disentangle``: train, evaluate, generate from and inspect surprisal-weighted CVAEs.

    disentangle train --config run.yaml [--any-config-flag VALUE ...]
    disentangle eval CHECKPOINT [--data ...] [--output report.json]
    disentangle generate CHECKPOINT --prompt "..." [...]
    disentangle inspect CHECKPOINT --data ... --index I

Training flags are generated from the config dataclasses (``config.py``): every field has one.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from .config import ConfigError, add_config_arguments, config_from_namespace


def _add_train(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a CVAE",
        description="Train a CVAE. Flags override the --config file; the resolved config is written "
        "to OUTPUT_DIR/config.yaml.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", help="YAML or JSON config file (flat field names or nested by section)")
    add_config_arguments(parser)
    parser.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    config = config_from_namespace(args)
    from .trainer import train

    result = train(config)
    print(f"metrics:    {result.output_dir / 'metrics.jsonl'}")
    print(f"checkpoint: {result.checkpoint}")
    print(f"c_base:     {result.zfree_reference_scale:.4f} nats/token (z-free reference scale)")
    summary = {k: round(v, 4) for k, v in result.last_metrics.items() if k.startswith("val_") and "loss" in k}
    if summary:
        print("validation: " + json.dumps(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disentangle", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_train(subparsers)
    from . import commands

    commands.add_subcommands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"disentangle {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
