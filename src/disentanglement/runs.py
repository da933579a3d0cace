"""Opening a trained run: the library behind ``eval``, ``generate``, ``inspect``, ``encode`` and the explorer.

``CHECKPOINT`` is a checkpoint directory (``RUN/checkpoints/step-NNNNNN``) or a run directory (its latest
complete checkpoint is used): :func:`resolve_run`. :func:`load_checkpoint` loads its model (the decoder and
tokenizer can be injected, as the tests do), :func:`load_examples` the examples that ``--data`` names,
:func:`stored_features` their frozen-pass features through the shared feature cache.

Data (``--data``): ``validation`` (default) and ``train`` rebuild the run's own split
deterministically from its stored config (``splits.prepare_data``); ``chatterbot`` or a ``.jsonl``
path is loaded with the run's keys, chat template and truncation. ``--max-examples`` keeps a
seeded subset.

The checks that run before a model loads live here too: :func:`check_data_option` (reads only the
checkpoint's ``config.yaml``) and :func:`check_writable_target`, so that a malformed data file or an output
path that cannot be written fails in a second, not after the checkpoint has loaded.
Importing this module loads nothing heavy (torch and transformers load when a model does).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .splits import SPLITS, PreparedData

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .config import RunConfig
    from .data import Example

__all__ = [
    "SPLITS",
    "check_data_option",
    "check_writable_target",
    "load_checkpoint",
    "load_examples",
    "resolve_run",
    "stored_features",
]


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


def load_checkpoint(
    checkpoint: str | Path, model_and_tokenizer=None, device: str = "auto", state=None, latent_overrides=None
):
    """``(model, tokenizer, config, trainer_state, checkpoint_dir, run_dir)``, the model in eval mode on ``device``
    (several processes, ``state``: on this process's device); ``latent_overrides``: ``load_trained``'s.

    Loads through ``trainer.load_trained`` (looked up at call time, so tests can replace it).
    """
    from . import trainer

    checkpoint_dir, run_dir = resolve_run(checkpoint)
    target = trainer.choose_device(device) if state is None else state.device
    model, tokenizer, config, state = trainer.load_trained(
        checkpoint_dir, model_and_tokenizer, device=target, latent_overrides=latent_overrides
    )
    model = model.to(target).eval()
    return model, tokenizer, config, state, checkpoint_dir, run_dir


def load_examples(
    data: str | None,
    config: RunConfig,
    tokenizer: Any,
    max_examples: int | None = None,
    seed: int = 0,
    prepared: PreparedData | None = None,
) -> tuple[list[Example], str]:
    """The examples named by ``--data`` (see the module docstring) and a description of them; ``prepared``: the
    run's data already prepared (:func:`prepare_run_data`), so that a split is not prepared a second time."""
    from .data import limit_examples, load_pairs, tokenize_pairs
    from .splits import prepare_data

    data = data or "validation"
    if data in SPLITS:
        prepared = prepared or prepare_data(config, tokenizer)
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


def prepare_run_data(data: str | None, config: RunConfig, tokenizer: Any) -> PreparedData | None:
    """The run's own data prepared again, for ``eval``'s ``--data`` (``validation`` or ``train``; None for a file):
    once, for both :func:`load_examples` and :func:`seen_in_training`."""
    from .splits import prepare_data

    return prepare_data(config, tokenizer) if (data or "validation") in SPLITS else None


def seen_in_training(
    data: str | None,
    config: RunConfig,
    tokenizer: Any,
    examples: list[Example],
    prepared: PreparedData | None = None,
) -> dict | None:
    """How many of ``examples`` (``eval``'s ``--data``) the run trained on: ``{"pairs": k, "prompts": m}``, the
    examples whose prompt and response ids, and whose prompt ids alone, occur in the run's training split
    (``prepared``'s, where given). None for ``--data train``, and where the run's data cannot be read again (a
    warning says why)."""
    from .data import DataError
    from .splits import prepare_data

    if (data or "validation") == "train":
        return None
    try:
        train = (prepared or prepare_data(config, tokenizer)).train
    except (OSError, ValueError, DataError) as exc:
        logger.warning("cannot say which examples the run trained on: its data %s: %s", config.data.data, exc)
        return None
    return training_overlap(train, examples)


def training_overlap(train: list[Example], examples: list[Example]) -> dict[str, int]:
    """``{"pairs": k, "prompts": m}``: the ``examples`` whose prompt and response ids, and whose prompt ids alone,
    occur in ``train``."""
    from .data import pair_ids

    pairs, prompts = {pair_ids(e) for e in train}, {tuple(e.prompt_ids) for e in train}
    return {
        "pairs": sum(pair_ids(e) in pairs for e in examples),
        "prompts": sum(tuple(e.prompt_ids) in prompts for e in examples),
    }


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
