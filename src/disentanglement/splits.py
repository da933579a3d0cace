"""A run's examples: its data loaded, capped, tokenized and split into train and validation, deterministically
from its config (:func:`prepare_data`), so that ``eval`` and the other subcommands rebuild the same split.

Importing this module loads nothing heavy (``data.py``, with torch, loads when :func:`prepare_data` runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import RunConfig
    from .data import Example

#: The splits of a run that ``--data`` names (``validation``, the default, and ``train``).
SPLITS = ("validation", "train")


@dataclass
class PreparedData:
    train: list[Example]
    validation: list[Example]
    stats: dict[str, Any]


def prepare_data(config: RunConfig, tokenizer, pairs=None) -> PreparedData:
    """Load (or take) pairs, cap by ``max_examples``, tokenize and split, all deterministic by seed."""
    from .data import limit_examples, load_pairs, split_train_validation, tokenize_pairs

    pairs = load_pairs(config.data) if pairs is None else pairs
    pairs = limit_examples(pairs, config.data.max_examples, config.train.seed)
    examples, stats = tokenize_pairs(pairs, tokenizer, config.data)
    train, validation = split_train_validation(examples, config.data.validation_fraction, config.train.seed)
    stats = dict(stats, train_examples=len(train), validation_examples=len(validation))
    return PreparedData(train, validation, stats)
