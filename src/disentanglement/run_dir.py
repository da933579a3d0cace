"""The run directory: what it holds, who may train into it, and what ``--overwrite`` removes.

Layout::

    OUTPUT_DIR/
      config.yaml              resolved config of the run
      metrics.jsonl            one JSON object per optimizer step (+ validation records)
      data_stats.json          data counts, truncation counts and c_base
      verdict.json             the verdict train ends with: eval's report on the validation split
      feature_cache/           (older versions only) the frozen pass; now in the shared store, feature_store.py
      checkpoints/step-000050/ a complete checkpoint (see ``checkpoints.py``)

A run directory belongs to one run: training into a directory that already holds a run is refused
unless ``--resume`` (continue it) or ``--overwrite`` (replace it) is given; one process at a time
trains it (:func:`run_lock`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import yaml

from .checkpoints import CheckpointContents, checkpoint_step, complete_checkpoints, replace_file_durably
from .config import ConfigError, RunConfig
from .safe_io import REMOVING_PREFIX, UnsafePathError, json_text, open_append, remove_all

logger = logging.getLogger(__name__)

#: What a run directory may hold besides ``feature_cache/`` (what ``--overwrite`` removes).
RUN_ARTEFACTS = frozenset(
    {
        "config.yaml",
        "metrics.jsonl",
        "data_stats.json",
        "command.txt",  # the train command lines (export.COMMAND_FILE)
        "checkpoints",
        "tensorboard",
        "eval",
        "inspect",
        "verdict.json",  # the verdict train ends with (cli.py)
        "encoder_refit.json",  # a refit-encoder run's (encoder_refit.py)
        "decoder_posterior.safetensors",
    }
)
#: The advisory lock a training process holds in its run directory.
LOCK_FILE = ".lock"


def _run_entries(output_dir: Path) -> list[str]:
    """What a run directory holds besides its keyed feature cache and lock (an empty folder holds no run)."""
    return sorted(
        p.name
        for p in output_dir.iterdir()
        if p.name not in ("feature_cache", LOCK_FILE) and not (p.is_dir() and not any(p.iterdir()))
    )


def _is_run_artefact(name: str) -> bool:
    return (
        name in RUN_ARTEFACTS
        or (name.startswith(".") and name.endswith(".tmp"))  # .tmp: an interrupted write
        or name.startswith(REMOVING_PREFIX)  # an interrupted --overwrite
    )


def check_run_directory(
    output_dir: Path, resumed: CheckpointContents | None, resume: str | None, overwrite: bool
) -> list[Path]:
    """Check that ``output_dir`` can take this run, before any model loads; returns what to remove first.

    A directory holding a run is refused unless resuming that run or overwriting it (``overwrite``
    removes the run's artefacts, never a file it did not write, and keeps the keyed feature cache).
    ``--resume PATH`` continues PATH's run in its own directory, discarding the checkpoints after PATH
    only with ``overwrite``, or branches into an ``output_dir`` that holds no run.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"TrainConfig.output_dir {output_dir} is a file, not a directory")
    if resume == "auto" and overwrite:
        raise ConfigError("--resume auto continues the run in output_dir and --overwrite replaces it: give one of them")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"TrainConfig.output_dir {output_dir}: cannot be created ({exc.strerror or exc})") from exc
    for folder in (output_dir, output_dir / "checkpoints"):
        if not folder.is_dir():
            continue
        try:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
                pass
        except OSError as exc:
            raise ConfigError(
                f"TrainConfig.output_dir: {folder} is not writable ({exc.strerror or exc}); checkpoints could not be saved"
            ) from exc
    present = _run_entries(output_dir)
    _check_run_folders(output_dir, present if overwrite and resume is None else [])
    if resume == "auto":
        return []
    if resume is not None and resumed is not None:
        source_run = resumed.path.parent.parent
        if source_run.resolve() != output_dir.resolve():
            if present:
                raise ConfigError(
                    f"--resume {resume}: a checkpoint of the run in {source_run}, but TrainConfig.output_dir "
                    f"{output_dir} already holds another run ({', '.join(present)}): continue a run in its own "
                    "directory, or branch into an empty --output-dir"
                )
            return []
        newer = [c for c in complete_checkpoints(output_dir) if checkpoint_step(c) > resumed.step]
        if newer and not overwrite:
            raise ConfigError(
                f"--resume {resume}: the run has later checkpoints ({', '.join(c.name for c in newer)}); pass "
                f"--overwrite to discard them and branch from step {resumed.step}, or --resume auto to continue the newest"
            )
        return newer
    if present and not overwrite:
        raise ConfigError(
            f"TrainConfig.output_dir {output_dir} already holds {', '.join(present)}: pass --resume auto to "
            "continue that run, --overwrite to replace it, or choose another --output-dir"
        )
    foreign = [name for name in present if not _is_run_artefact(name)]
    if foreign:
        raise ConfigError(
            f"TrainConfig.output_dir {output_dir} holds files that are not a run's ({', '.join(foreign)}); "
            "--overwrite only replaces a run directory: choose another --output-dir"
        )
    return [output_dir / name for name in present]


def _check_run_folders(output_dir: Path, removed: Sequence[str]) -> None:
    """The folders training writes into (``checkpoints/``, ``tensorboard/``) are real folders of the run, not
    links to elsewhere (one that ``--overwrite`` removes is removed as a link): checked before anything runs."""
    for name in ("checkpoints", "tensorboard"):
        path = output_dir / name
        if path.is_symlink() and name not in removed:
            raise ConfigError(
                f"TrainConfig.output_dir: {path} is a symbolic link; a run writes only into real folders of its "
                "own: remove the link (or choose another --output-dir)"
            )


def remove_run_artefacts(paths: Sequence[Path], output_dir: Path) -> None:
    """Remove ``paths`` all or nothing (:func:`safe_io.remove_all`: links as links, never their targets);
    later checkpoints of a branch (``checkpoints/step-*``) are entries of ``checkpoints/``."""
    if paths:
        logger.warning("--overwrite: removing %s from %s", ", ".join(p.name for p in paths), output_dir)
    for parent in sorted({p.parent for p in paths}):
        remove_all([p for p in paths if p.parent == parent])


@contextmanager
def run_lock(output_dir: Path):
    """Hold ``OUTPUT_DIR/.lock`` (an advisory ``flock``) while training: a second process training the
    same directory is refused instead of interleaving its metrics and checkpoints with the first's."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"TrainConfig.output_dir {output_dir} is a file, not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        handle = open_append(output_dir / LOCK_FILE, mode="a+")  # held for the whole run; never through a link
    except UnsafePathError as exc:
        raise ConfigError(f"TrainConfig.output_dir: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"TrainConfig.output_dir {output_dir}: cannot be used ({exc.strerror or exc})") from exc
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"TrainConfig.output_dir {output_dir} is being trained by {holder}: wait for it to end, or choose "
            "another --output-dir"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def write_run_files(output_dir: Path, config: RunConfig, stats: dict, c_base: float) -> None:
    """Write the run's ``config.yaml`` and ``data_stats.json`` (the data's ``stats`` with c_base), durably."""
    replace_file_durably(output_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False).encode())
    stats = json_text(dict(stats, zfree_reference_scale=c_base), output_dir / "data_stats.json", indent=2)
    replace_file_durably(output_dir / "data_stats.json", stats.encode())
