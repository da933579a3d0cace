"""Subcommands that work on a trained checkpoint: eval, generate, inspect."""

from __future__ import annotations


def add_subcommands(subparsers) -> None:
    """Register ``eval``, ``generate`` and ``inspect`` on the ``disentangle`` parser."""
