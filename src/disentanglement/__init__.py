"""Surprisal-weighted conditional VAEs on a frozen pretrained causal LM.

``disentanglement.load(DIR)`` loads an export directory (``disentangle export``), a checkpoint or a run
directory: ``(model, tokenizer, config)``. The command line is ``disentangle`` (``disentanglement.cli``).
Importing the package loads nothing heavy: torch and transformers load when something is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load"]


def load(path: str | Path, *, device: str = "cpu", model_and_tokenizer: tuple[Any, Any] | None = None):
    """``(model, tokenizer, config)`` of an export, checkpoint or run directory (:func:`export.load`)."""
    from .export import load as load_export

    return load_export(path, device=device, model_and_tokenizer=model_and_tokenizer)
