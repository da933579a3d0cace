"""A run's examples: its data loaded, capped, tokenized and split into train and validation, deterministically
from its config (:func:`prepare_data`), so that ``eval`` and the other subcommands rebuild the same split.

Importing this module loads nothing heavy (``data.py``, with torch, loads when :func:`prepare_data` runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import RunConfig
    from .data import Example

logger = logging.getLogger(__name__)

#: The splits of a run that ``--data`` names (``validation``, the default, and ``train``).
SPLITS = ("validation", "train")


@dataclass
class PreparedData:
    train: list[Example]
    validation: list[Example]
    stats: dict[str, Any]


def prepare_data(config: RunConfig, tokenizer, pairs=None) -> PreparedData:
    """Load (or take) pairs, cap by ``max_examples``, tokenize and split, all deterministic by seed. Copies of a
    pair (the same prompt and response ids) go to the same side: a validation example that training has seen
    would judge memory, not the latent (the chatterbot corpus's 2,306 pairs are 1,175 distinct)."""
    from .data import limit_examples, load_pairs, pair_ids, split_train_validation, tokenize_pairs

    pairs = load_pairs(config.data) if pairs is None else pairs
    pairs = limit_examples(pairs, config.data.max_examples, config.train.seed)
    examples, stats = tokenize_pairs(pairs, tokenizer, config.data)
    train, validation = split_train_validation(
        examples, config.data.validation_fraction, config.train.seed, key=pair_ids
    )
    copies = len(examples) - len({pair_ids(e) for e in examples})
    if copies:
        logger.info(
            "%d of %d examples are copies of another pair; each pair's copies are on one side of the split",
            copies,
            len(examples),
        )
    stats = dict(stats, train_examples=len(train), validation_examples=len(validation), copied_examples=copies)
    return PreparedData(train, validation, stats)
