"""Training loop on accelerate's ``Accelerator``: AdamW, warm-up + cosine, accumulation, clipping,
per-step JSONL metrics, periodic validation, divergence detection and durable, resumable checkpoints.

Run directory layout::

    OUTPUT_DIR/
      config.yaml              resolved config of the run
      metrics.jsonl            one JSON object per optimizer step (+ validation records)
      data_stats.json          data counts, truncation counts and c_base
      feature_cache/           the frozen pass over the data (keyed by a fingerprint)
      checkpoints/step-000050/ a complete checkpoint (see ``checkpoints.py``)

A run directory belongs to one run: training into a directory that already holds a run is refused
unless ``--resume`` (continue it) or ``--overwrite`` (replace it) is given. A resumed run continues
bit for bit where an uninterrupted run would be; a config field that would change what is trained
cannot change on resume (it is refused, named), except the learning rates, weight decay and clipping
norm, which are applied from the resumed step on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from . import distributed
from .checkpoints import (
    CheckpointContents,
    CheckpointError,
    NonFiniteState,
    apply_trainable_weights,
    check_optimizer_state,
    check_scheduler_state,
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
    load_trainable_weights,
    load_trained,
    nonfinite_tensors,
    prune_checkpoints,
    read_checkpoint,
    read_resumable,
    replace_file_durably,
    save_checkpoint,
    set_rng_state,
)
from .config import ConfigError, RunConfig, TrainConfig
from .cvae_base import CVAEBase, FrozenFeatures, WeightingParams
from .data import Example, collate, limit_examples, load_pairs, split_train_validation, tokenize_pairs
from .features import FeatureCache, batch_features, feature_fingerprint, load_or_build_feature_cache
from .losses import estimate_zfree_reference_scale
from .models import build_cvae
from .reference import eval_mode

__all__ = [  # checkpoint I/O lives in checkpoints.py; these names stay importable from here
    "DataOrder",
    "TrainingDiverged",
    "latest_checkpoint",
    "load_trainable_weights",
    "load_trained",
    "prepare_data",
    "train",
]

logger = logging.getLogger(__name__)

#: Config fields that may differ on resume without changing what is trained.
RESUME_FREE_FIELDS = frozenset(
    {
        "resume",
        "overwrite",
        "output_dir",
        "progress",
        "tensorboard",
        "eval_every",
        "eval_batches",
        "save_every",
        "keep_checkpoints",
        "max_nonfinite_steps",
        "max_loss_ratio",
        "feature_cache",
        "feature_cache_dir",
        "device",
        "model_cache_dir",
        # The frozen pass's fingerprint includes the weights' dtype, so a resume whose dtype resolves to
        # another one than the run's is refused there, naming the frozen pass.
        "dtype",
        # Activation checkpointing recomputes the same layers on the same inputs: the same loss and gradients.
        "gradient_checkpointing",
        # Paths whose content the frozen pass's fingerprint checks on resume (token ids and frozen weights),
        # so that a moved data file or model does not block resuming.
        "data",
        "model",
    }
)
#: Free fields that change the order of the arithmetic: a resumed run is then equal to rounding, not bit for bit.
RESUME_INEXACT_FIELDS = frozenset({"feature_cache", "device"})
#: Config fields that may differ on resume and are applied from the resumed step on.
RESUME_APPLIED_FIELDS = frozenset({"encoder_lr", "latent_lr", "decoder_lr", "weight_decay", "max_grad_norm"})
#: What a run directory may hold besides ``feature_cache/`` (what ``--overwrite`` removes).
RUN_ARTEFACTS = frozenset(
    {"config.yaml", "metrics.jsonl", "data_stats.json", "checkpoints", "tensorboard", "eval", "inspect"}
)
#: The per-step log of a run directory.
METRICS_FILE = "metrics.jsonl"
#: The advisory lock a training process holds in its run directory.
LOCK_FILE = ".lock"
#: The divergence check's window of recent losses, and the suspect steps in a row that stop training.
LOSS_WINDOW, LOSS_PATIENCE = 50, 3


class TrainingDiverged(RuntimeError):
    """Training stopped: non-finite losses, gradients or weights, or a loss that exploded.

    The message says what happened, at which step, and which checkpoint is the last good one."""


@dataclass
class DataOrder:
    """Deterministic epoch-wise shuffling whose position is saved with each checkpoint."""

    size: int
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), self.size - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}


@dataclass
class PreparedData:
    train: list[Example]
    validation: list[Example]
    stats: dict[str, Any]


def prepare_data(config: RunConfig, tokenizer, pairs=None) -> PreparedData:
    """Load (or take) pairs, cap by ``max_examples``, tokenize and split, all deterministic by seed."""
    pairs = load_pairs(config.data) if pairs is None else pairs
    pairs = limit_examples(pairs, config.data.max_examples, config.train.seed)
    examples, stats = tokenize_pairs(pairs, tokenizer, config.data)
    train, validation = split_train_validation(examples, config.data.validation_fraction, config.train.seed)
    stats = dict(stats, train_examples=len(train), validation_examples=len(validation))
    return PreparedData(train, validation, stats)


def make_optimizer(model: CVAEBase, config: RunConfig) -> torch.optim.Optimizer:
    lrs = {"encoder": config.train.encoder_lr, "latent": config.train.latent_lr, "decoder": config.train.decoder_lr}
    groups = [
        {"params": params, "lr": lrs[name], "name": name} for name, params in model.parameter_groups().items() if params
    ]
    # The fused kernel is one call per step instead of one per tensor (measurably cheaper for small heads).
    return torch.optim.AdamW(groups, weight_decay=config.train.weight_decay, fused=True)


def choose_device(preference: str) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


@dataclass
class TrainResult:
    output_dir: Path
    final_step: int
    checkpoint: Path | None
    zfree_reference_scale: float
    last_metrics: dict[str, float]
    model: CVAEBase
    data: PreparedData
    cache: FeatureCache | None  # the frozen pass over train + validation (None when neither needed it)


def _mean_records(records: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in records for k in r}
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in sorted(keys)}


@torch.no_grad()
def validate(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache | None,
    pad_id: int,
    config: RunConfig,
    step: int,
    device: torch.device,
    processes: int = 1,
) -> dict[str, float]:
    """Mean of every logged scalar over the first ``eval_batches`` validation batches (posterior mean/argmax).

    A batch is the global batch, ``batch_size x processes`` examples. With several processes each of
    them validates the same batches (few: ``eval_batches``), so that all log the same and draw the same
    random numbers, as one process with the global batch does."""
    if not examples:
        return {}
    records = []
    size = config.train.batch_size * processes
    with eval_mode(model):
        for start in range(0, min(len(examples), size * config.train.eval_batches), size):
            indices = list(range(start, min(start + size, len(examples))))
            batch = collate([examples[i] for i in indices], pad_id, indices=indices).to(device)
            records.append(model(batch, features=batch_features(model, batch, cache), step=step).scalars())
    return {f"val_{k}": v for k, v in _mean_records(records).items()}


def _run_entries(output_dir: Path) -> list[str]:
    """What a run directory holds besides its keyed feature cache and lock (an empty folder holds no run)."""
    return sorted(
        p.name
        for p in output_dir.iterdir()
        if p.name not in ("feature_cache", LOCK_FILE) and not (p.is_dir() and not any(p.iterdir()))
    )


def _is_run_artefact(name: str) -> bool:
    return name in RUN_ARTEFACTS or (name.startswith(".") and name.endswith(".tmp"))  # .tmp: an interrupted write


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


def _remove(paths: Sequence[Path], output_dir: Path) -> None:
    if paths:
        logger.warning("--overwrite: removing %s from %s", ", ".join(p.name for p in paths), output_dir)
    for path in paths:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _flat_fields(config: RunConfig) -> dict[str, Any]:
    return {name: value for section in config.to_dict().values() for name, value in section.items()}


def check_resume_config(stored: RunConfig, given: RunConfig, checkpoint: Path) -> dict[str, tuple[Any, Any]]:
    """Fields that differ between a checkpoint's config and the resuming run's: refuses any that would
    change what is trained, and returns ``{field: (old, new)}`` of those applied from the resumed step."""
    old, new = _flat_fields(stored), _flat_fields(given)
    changed = {name: (old[name], new[name]) for name in old if old[name] != new[name]}
    refused = {k: v for k, v in changed.items() if k not in RESUME_FREE_FIELDS | RESUME_APPLIED_FIELDS}
    if refused:
        listed = "; ".join(f"{name}: {a!r} in the checkpoint, {b!r} now" for name, (a, b) in sorted(refused.items()))
        raise ConfigError(
            f"cannot resume {checkpoint} with a changed {', '.join(sorted(refused))} ({listed}): these change what "
            "is trained and cannot change mid-run; resume with the run's values or start a new run. Changeable on "
            f"resume: {', '.join(sorted(RESUME_APPLIED_FIELDS))} (applied from the resumed step), and "
            "bookkeeping such as save_every, eval_every and progress"
        )
    inexact = sorted(set(changed) & RESUME_INEXACT_FIELDS)
    if inexact:
        logger.warning(
            "resuming with a changed %s: the arithmetic runs in another order, so the run continues equal to "
            "float rounding, not bit for bit",
            ", ".join(inexact),
        )
    return {k: v for k, v in changed.items() if k in RESUME_APPLIED_FIELDS}


def _resume_source(config: RunConfig, output_dir: Path) -> CheckpointContents | None:
    resume = config.train.resume
    if resume is None:
        return None
    if resume == "auto":
        contents = read_resumable(output_dir)
        if contents is None:
            logger.info("--resume auto: %s has no checkpoint yet; starting from step 0", output_dir)
        return contents
    path = Path(resume)
    if (path / "checkpoints").is_dir():  # a run directory: its newest checkpoint that reads back
        contents = read_resumable(path)
        if contents is None:
            raise CheckpointError(f"--resume {resume}: the run directory holds no checkpoint")
        return contents
    if not path.is_dir():
        raise CheckpointError(
            f"--resume {resume}: not a checkpoint directory (RUN/checkpoints/step-N), a run or 'auto'"
        )
    return read_checkpoint(path, for_resume=True)


def _apply_optimizer_settings(optimizer, scheduler, config: RunConfig, changes: dict[str, tuple[Any, Any]]) -> None:
    """Set changed learning rates, weight decay: the schedule continues from the resumed step with the new base."""
    if not changes:
        return
    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the LambdaLR
    lrs = {"encoder": config.train.encoder_lr, "latent": config.train.latent_lr, "decoder": config.train.decoder_lr}
    for i, group in enumerate(optimizer.param_groups):
        base = lrs[group["name"]]
        scheduler.base_lrs[i] = base
        group["initial_lr"] = base
        group["lr"] = base * scheduler.lr_lambdas[i](scheduler.last_epoch)
        group["weight_decay"] = config.train.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    logger.warning(
        "resuming with changed %s",
        ", ".join(f"{name} {a!r} -> {b!r}" for name, (a, b) in sorted(changes.items())),
    )


@dataclass
class LossMonitor:
    """Detects a loss that explodes while staying finite.

    A step is suspect when its token-mean reconstruction exceeds ``ratio x max(c_base, 1)`` (the decoder
    far worse than the z-free model it started from; per token, so response lengths do not matter), or
    its objective exceeds ``ratio x max(reference, c_base, 1)``, the reference being the lowest median
    of the last LOSS_WINDOW steps seen in the run (a slow blow-up cannot drag it along). Training stops
    after LOSS_PATIENCE suspect steps in a row (one long example in a sequence-summed term is not one).
    """

    ratio: float
    c_base: float
    history: deque = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    best_median: float | None = None
    strikes: int = 0

    def check(self, record: dict[str, float]) -> str | None:
        if not self.ratio:
            return None
        loss, reconstruction = record["loss"], record["reconstruction_loss"]
        floor = max(self.c_base, 1.0)
        problem = None
        if reconstruction > self.ratio * floor:
            problem = (
                f"the token-mean reconstruction loss {reconstruction:.4g} nats/token is more than {self.ratio:g} x "
                f"max(c_base, 1) = {floor:.4g} (c_base is the z-free reference scale)"
            )
        elif self.best_median is not None:
            scale = max(self.best_median, floor)
            if abs(loss) > self.ratio * scale:
                problem = (
                    f"the loss {loss:.4g} is more than {self.ratio:g} x max(the lowest running median |loss| "
                    f"{self.best_median:.4g}, c_base, 1) = {self.ratio * scale:.4g}"
                )
        self.history.append(loss)
        median = float(np.median(np.abs(self.history)))
        self.best_median = median if self.best_median is None else min(self.best_median, median)
        self.strikes = self.strikes + 1 if problem else 0
        if problem is None:
            return None
        largest = sorted(
            ((k, v) for k, v in record.items() if k.endswith("loss") and k != "loss" and not k.startswith("val_")),
            key=lambda kv: -abs(kv[1]),
        )
        return problem + " (largest terms: " + ", ".join(f"{k} {v:.4g}" for k, v in largest[:3]) + ")"

    def state(self) -> dict[str, Any]:
        return {"history": list(self.history), "best_median": self.best_median, "strikes": self.strikes}

    def load(self, state: dict[str, Any]) -> None:
        self.history.extend(float(v) for v in state.get("history", []))
        self.best_median = state.get("best_median")
        self.strikes = int(state.get("strikes", 0))


def _diverged(step: int, what: str, checkpoint: Path | None) -> TrainingDiverged:
    last = f"the last good checkpoint is {checkpoint}" if checkpoint is not None else "no checkpoint was written"
    return TrainingDiverged(
        f"training diverged at step {step}: {what}; {last}. Lower the learning rates (they may change on "
        "resume: --resume auto --latent-lr ...) or check the data."
    )


@contextmanager
def run_lock(output_dir: Path):
    """Hold ``OUTPUT_DIR/.lock`` (an advisory ``flock``) while training: a second process training the
    same directory is refused instead of interleaving its metrics and checkpoints with the first's."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"TrainConfig.output_dir {output_dir} is a file, not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        handle = open(output_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held for the whole run
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


def train(
    config: RunConfig,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    pairs: Sequence | None = None,
    callbacks: Sequence[Callable[[int, dict], None]] = (),
) -> TrainResult:
    """Train a CVAE as configured. ``model_and_tokenizer`` and ``pairs`` replace loading (tests).

    One process at a time trains a run directory (:func:`run_lock`). Under ``accelerate launch
    --num_processes N`` the N processes train one run: the main process holds the lock and alone
    writes the run directory (see :func:`_set_up` for what is shared and how)."""
    state = distributed.process_state(cpu=choose_device(config.train.device).type == "cpu")
    lock = run_lock(Path(config.train.output_dir)) if distributed.is_main(state) else nullcontext()
    with lock:
        return _train(config, model_and_tokenizer, pairs, callbacks, state)


def _train(
    config: RunConfig,
    model_and_tokenizer: tuple[Any, Any] | None,
    pairs: Sequence | None,
    callbacks: Sequence[Callable[[int, dict], None]],
    state=None,
) -> TrainResult:
    """Checks, set-up, restore, then per step: optimizer step, validation, log, loss check, checkpoint."""
    tcfg = config.train
    output_dir = Path(tcfg.output_dir)
    main = distributed.is_main(state)
    # Everything that can be wrong with the run directory, the checkpoint or the data fails before the model loads.
    resumed = _resume_source(config, output_dir)
    # The main process checks (and later clears) the directory; the others would see its files appear.
    to_remove = check_run_directory(output_dir, resumed, tcfg.resume, tcfg.overwrite) if main else []
    applied = check_resume_config(resumed.config, config, resumed.path) if resumed is not None else {}
    pairs = load_pairs(config.data) if pairs is None else pairs

    run = _set_up(config, output_dir, resumed, to_remove, model_and_tokenizer, pairs)
    progress = _start_or_restore(run, resumed, applied)
    if main:
        truncate_metrics(output_dir / METRICS_FILE, progress.step)
    run.prepared.train()
    with _metrics_log(output_dir, tcfg, progress.step, main) as log:
        while progress.step < tcfg.max_steps:
            record = _optimizer_step(run, progress)
            if record is None:  # a non-finite step, skipped
                continue
            if _due(tcfg.eval_every, progress.step, tcfg.max_steps):
                record.update(_validate(run, progress.step))
            log.write(record)
            progress.last = record
            _check_loss(progress, record)
            if _due(tcfg.save_every, progress.step, tcfg.max_steps):
                _save(run, progress, log)
            for callback in callbacks:
                callback(progress.step, record)
    return TrainResult(
        output_dir, progress.step, progress.checkpoint, run.c_base, progress.last, run.model, run.data, run.frozen.full
    )


# --------------------------------------------------------------------------- set-up


@dataclass
class _FrozenPass:
    """The frozen pass over the data, computed up front when something needs it."""

    full: FeatureCache | None  # train + validation, in that order (None when nothing needed it)
    train: FeatureCache | None  # its training part (c_base, the k-means start and refreshes)
    steps: FeatureCache | None  # what the steps read: the training part with the cache option, else None
    validation: FeatureCache | None  # likewise for validation


@dataclass
class _Training:
    """What the loop works with, built once by :func:`_set_up`."""

    config: RunConfig
    output_dir: Path
    accelerator: Any
    model: CVAEBase  # the CVAE itself
    prepared: Any  # the same model as accelerate prepared it: the training forward runs through it
    optimizer: Any
    scheduler: Any
    data: PreparedData
    pad_id: int
    frozen: _FrozenPass
    c_base: float
    fingerprint: str
    init_features: FrozenFeatures | None  # the k-means sample (discrete k-means codebook only)
    state: Any = None  # accelerate's state with several processes, else None (:mod:`distributed`)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def main(self) -> bool:
        return distributed.is_main(self.state)


@dataclass
class _Progress:
    """Where the loop is: what a checkpoint saves of the loop, and the last record and checkpoint."""

    step: int
    nonfinite: int  # consecutive non-finite steps
    order: DataOrder
    monitor: LossMonitor
    checkpoint: Path | None
    last: dict[str, float] = field(default_factory=dict)


def _set_up(
    config: RunConfig,
    output_dir: Path,
    resumed: CheckpointContents | None,
    to_remove: Sequence[Path],
    model_and_tokenizer: tuple[Any, Any] | None,
    pairs: Sequence,
) -> _Training:
    """Seed, model, data, frozen pass, c_base, the run's files, the codebook's start and the optimizer.

    In this order: everything that can fail does so before ``--overwrite`` removes the old run."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    tcfg = config.train
    device = choose_device(tcfg.device)
    # Several processes: the trainable parameters' gradients are averaged by DDP (a frozen decoder has
    # requires_grad off already, so it is in no gradient bucket). find_unused_parameters, so that an option
    # that leaves a head out of some forward cannot stop DDP (in the configurations tested none is; it
    # costs one graph traversal per backward). Buffers are not broadcast at each forward: the codebook's
    # usage steps are merged across processes after each step (merge_step_statistics).
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
    # The schedule counts optimizer steps: accelerate would otherwise step it once per process per step
    # (it assumes each process's data loader got N times shorter; here the data order is global).
    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision="bf16" if device.type == "cuda" else "no",
        kwargs_handlers=[ddp],
        step_scheduler_with_optimizer=False,
    )
    state = accelerator.state if accelerator.num_processes > 1 else None
    main = accelerator.is_main_process
    _check_processes(resumed, accelerator.num_processes)
    set_seed(tcfg.seed)
    decoder, tokenizer = _decoder_and_tokenizer(config, model_and_tokenizer, device)
    data = prepare_data(config, tokenizer, pairs)
    if not data.train:
        raise ValueError("no training examples after loading and splitting the data")
    logger.info("data: %s", data.stats)

    model = build_cvae(config, decoder).to(accelerator.device)
    fingerprint = feature_fingerprint(model, data.train + data.validation)  # the data, tokenizer and frozen model
    _check_fingerprint(resumed, fingerprint)
    frozen = _frozen_pass(config, model, data, resumed, tokenizer.pad_token_id, accelerator.device, output_dir, state)
    c_base = _zfree_reference_scale(config, resumed, frozen.train, len(data.train))
    model.zfree_reference_scale = c_base
    if main and resumed is None:
        _warn_term5_amplification(config, frozen.train, c_base)
    distributed.barrier(state)  # every process has checked the run directory before the main one writes to it
    if main:
        _remove(to_remove, output_dir)  # --overwrite: only now that everything before the first write has worked
        _write_run_files(output_dir, config, data, c_base)

    init_features = _kmeans_sample(config, data, frozen.train, tokenizer.pad_token_id, accelerator.device)
    if resumed is None and init_features is not None:
        if main:  # k-means of the whole (gathered) frozen pass, on the main process, then broadcast
            model.initialize_from_data(init_features, tcfg.seed)
        distributed.broadcast_(state, model.data_dependent_state())
    optimizer = make_optimizer(model, config)
    scheduler = get_cosine_schedule_with_warmup(optimizer, tcfg.warmup_steps, tcfg.max_steps)
    with warnings.catch_warnings():  # torch's FutureWarning for broadcast_buffers, whose meaning is the one wanted
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        prepared, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return _Training(
        config=config,
        output_dir=output_dir,
        accelerator=accelerator,
        model=accelerator.unwrap_model(prepared),
        prepared=prepared,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        pad_id=tokenizer.pad_token_id,
        frozen=frozen,
        c_base=c_base,
        fingerprint=fingerprint,
        init_features=init_features,
        state=state,
    )


def _decoder_and_tokenizer(
    config: RunConfig, model_and_tokenizer: tuple[Any, Any] | None, device: torch.device
) -> tuple[Any, Any]:
    """The given decoder, or the configured one loaded on the CPU in the dtype chosen for ``device``
    (``dtype: auto`` is bf16 on CUDA even when the CPU has no fast bf16)."""
    if model_and_tokenizer is not None:
        return model_and_tokenizer
    from .lm import load_model_and_tokenizer, resolve_dtype

    return load_model_and_tokenizer(config.model, device="cpu", dtype=resolve_dtype(config.model, device))


def _check_fingerprint(resumed: CheckpointContents | None, fingerprint: str) -> None:
    """A resumed run continues on the data, tokenizer and frozen model it was trained on."""
    if resumed is not None and resumed.trainer_state.get("frozen_pass_fingerprint", fingerprint) != fingerprint:
        raise ConfigError(
            f"cannot resume {resumed.path}: the data, the tokenizer or the frozen model differ from the run's "
            f"(fingerprint {fingerprint}, the run's {resumed.trainer_state['frozen_pass_fingerprint']}); "
            "the fingerprint includes the decoder weights' dtype, so a run started in float32 resumes only "
            "with --dtype float32 (dtype: auto now chooses bf16 on CUDA and on CPUs with fast bf16); "
            "otherwise resuming would continue on other data: start a new run"
        )


def _check_processes(resumed: CheckpointContents | None, processes: int) -> None:
    """A resumed run continues with its number of processes: the global batch is ``batch_size x processes``."""
    if resumed is None:
        return
    before = int(resumed.trainer_state.get("processes", 1))
    if before != processes:
        raise ConfigError(
            f"cannot resume {resumed.path} with {processes} process(es): the run was trained with {before}, and "
            f"a step's global batch is batch_size x processes; launch it with --num_processes {before}"
        )


def _uses_kmeans(config: RunConfig) -> bool:
    return config.latent.latent == "discrete" and config.latent.codebook_init in ("kmeans", "prior_kmeans")


def _refresh_every(config: RunConfig) -> int:
    """Steps between k-means refreshes of the codebook (0: none)."""
    return config.latent.codebook_refresh_every if config.latent.codebook_init == "kmeans" else 0


def _frozen_pass(
    config: RunConfig,
    model: CVAEBase,
    data: PreparedData,
    resumed: CheckpointContents | None,
    pad_id: int,
    device: torch.device,
    output_dir: Path,
    state=None,
) -> _FrozenPass:
    """The frozen pass over train + validation, when the cache option, c_base or k-means need it.

    With several processes (``state``) it is sharded across them and gathered: each holds all of it.

    The k-means start (fresh runs) and refreshes (first half of training) need the frozen features,
    with or without the cache option, so that a resumed run refreshes exactly as an uninterrupted one.
    Without the cache option, steps and validation run the frozen pass themselves (the pass here is
    then only the one-off pass for c_base and k-means).
    """
    tcfg = config.train
    start_step = resumed.step if resumed is not None else 0
    refreshes_left = _refresh_every(config) and start_step < tcfg.max_steps // 2
    needs_kmeans_features = _uses_kmeans(config) and (resumed is None or refreshes_left)
    needs_c_base = resumed is None and config.reconstruction.zfree_reference_scale is None
    if not (tcfg.feature_cache or needs_c_base or needs_kmeans_features):
        return _FrozenPass(None, None, None, None)
    examples = data.train + data.validation
    cache_dir = (tcfg.feature_cache_dir or output_dir / "feature_cache") if tcfg.feature_cache else None
    cache = load_or_build_feature_cache(
        model,
        examples,
        pad_id,
        cache_dir,
        batch_size=max(tcfg.batch_size, 16),
        device=device,
        progress=tcfg.progress and distributed.is_main(state),
        state=state,
    )
    n_train = len(data.train)
    train_cache = cache.subset(0, n_train)
    if not tcfg.feature_cache:
        return _FrozenPass(cache, train_cache, None, None)
    return _FrozenPass(cache, train_cache, train_cache, cache.subset(n_train, len(examples)))


def _zfree_reference_scale(
    config: RunConfig, resumed: CheckpointContents | None, train_cache: FeatureCache | None, n_train: int
) -> float:
    """c_base: the run's (resumed), the configured one, or the mean z-free NLL of the training data."""
    if resumed is not None:
        return float(resumed.trainer_state["zfree_reference_scale"])
    if config.reconstruction.zfree_reference_scale is not None:
        return config.reconstruction.zfree_reference_scale
    c_base = estimate_zfree_reference_scale(train_cache.example_base_losses())
    logger.info("estimated zfree_reference_scale c_base = %.4f nats/token over %d examples", c_base, n_train)
    return c_base


def _warn_term5_amplification(config: RunConfig, train_cache: FeatureCache | None, c_base: float) -> None:
    """Warn when term 5 (the inverse-surprisal ablation) weighs single tokens' NLL by 100 or more (median over
    the training examples): it is then ill-conditioned, and a small change at a token the reference is sure
    of can make the loss jump (on ``two-factor`` at alpha 2, median 2,400: one seed of three diverged).
    Measured on the z-free surprisal only: with another ``token_weight_source`` it says nothing."""
    rcfg = config.reconstruction
    if rcfg.normalized_inverse_surprisal_token_weighted_weight <= 0 or train_cache is None:
        return
    if rcfg.token_weight_source != "surprisal" or rcfg.token_weight_alpha == 0:
        return
    params = WeightingParams(
        "surprisal", rcfg.token_weight_alpha, rcfg.token_weight_eps, rcfg.token_weight_interpolation
    )
    amplification = train_cache.inverse_term_amplification(params)
    median = float(amplification.median())
    if median >= 100:
        logger.warning(
            "term 5 (normalized_inverse_surprisal_token_weighted_weight) at token_weight_alpha %g weighs one "
            "token's NLL by a median of %.0f times its plain share over the training examples (max %.0f): a "
            "rise of 0.01 nats there adds %.2g nats to that example's loss (c_base %.2f), so training may "
            "diverge. It is an ablation; a smaller alpha or a larger token_weight_eps tames it.",
            rcfg.token_weight_alpha,
            median,
            float(amplification.max()),
            0.01 * median / c_base,
            c_base,
        )


def _write_run_files(output_dir: Path, config: RunConfig, data: PreparedData, c_base: float) -> None:
    replace_file_durably(output_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False).encode())
    stats = json.dumps(dict(data.stats, zfree_reference_scale=c_base), indent=2)
    replace_file_durably(output_dir / "data_stats.json", stats.encode())


def _kmeans_sample(
    config: RunConfig, data: PreparedData, train_cache: FeatureCache | None, pad_id: int, device: torch.device
) -> FrozenFeatures | None:
    """The frozen features of the first 4096 training examples, which k-means starts and refreshes
    the codebook from (None unless the codebook starts from k-means and the pass was run)."""
    if train_cache is None or not _uses_kmeans(config):
        return None
    sample = list(range(min(len(data.train), 4096)))
    return train_cache.features(collate([data.train[i] for i in sample], pad_id, indices=sample).to(device))


def _start_or_restore(
    run: _Training, resumed: CheckpointContents | None, applied: dict[str, tuple[Any, Any]]
) -> _Progress:
    """Step 0 of a fresh run, or the checkpoint's step with everything it saved put back in place."""
    tcfg = run.config.train
    monitor = LossMonitor(tcfg.max_loss_ratio, run.c_base)
    n_train = len(run.data.train)
    if resumed is None:
        return _Progress(0, 0, DataOrder(n_train, tcfg.seed), monitor, checkpoint=None)
    step, nonfinite, order = _restore(
        resumed, run.model, run.optimizer, run.scheduler, monitor, applied, run.config, n_train
    )
    return _Progress(step, nonfinite, order, monitor, checkpoint=resumed.path)


# --------------------------------------------------------------------------- one step


def _optimizer_step(run: _Training, progress: _Progress) -> dict[str, float] | None:
    """One optimizer step over ``gradient_accumulation_steps`` batches; returns its record, or None
    when the loss or gradient was non-finite and the step was skipped (:func:`_skip_nonfinite_step`)."""
    tcfg = run.config.train
    run.optimizer.zero_grad(set_to_none=True)
    records, finite = _accumulate_gradients(run, progress)
    grad_norm = float("nan")
    if finite:
        grad_norm = float(run.accelerator.clip_grad_norm_(run.model.parameters(), tcfg.max_grad_norm))
        finite = math.isfinite(grad_norm)
    if not finite:
        _skip_nonfinite_step(run, progress, records)
        return None
    progress.nonfinite = 0
    run.optimizer.step()
    run.scheduler.step()
    run.model.merge_step_statistics(run.state)  # several processes: what the step saw on all of them
    run.model.post_step(progress.step)  # with the index of the step just taken, as its forward saw it
    progress.step += 1
    _refresh_codebook(run, progress.step)
    distributed.broadcast_(run.state, run.model.data_dependent_state())  # one codebook on every process
    record = _mean_records(distributed.gather_objects(run.state, _mean_records(records)))  # averaged over processes
    record.update(step=progress.step, grad_norm=grad_norm)
    for group in run.optimizer.param_groups:
        record[f"lr_{group['name']}"] = group["lr"]
    return record


def _accumulate_gradients(run: _Training, progress: _Progress) -> tuple[list[dict[str, float]], bool]:
    """Forward and backward of each accumulated batch: ``(their scalars, whether every loss was finite)``;
    stops at the first non-finite loss, logging its terms and examples.

    With ``N`` processes each accumulated batch is a global batch of ``N x batch_size`` examples taken
    from the one data order, of which process ``r`` trains the ``r``-th slice; DDP averages the
    gradients (each process's loss is the mean over its slice), so a step is the step of one process
    with ``N x batch_size`` examples per batch."""
    tcfg = run.config.train
    rank, size = distributed.rank_and_size(run.state)
    records = []
    for micro in range(tcfg.gradient_accumulation_steps):
        indices = progress.order.next_indices(tcfg.batch_size * size)[
            rank * tcfg.batch_size : (rank + 1) * tcfg.batch_size
        ]
        batch = collate([run.data.train[i] for i in indices], run.pad_id, indices=indices).to(run.device)
        features = batch_features(run.model, batch, run.frozen.steps)  # float32 frozen pass, as in the cache
        last = micro == tcfg.gradient_accumulation_steps - 1
        # Several processes: gradients are averaged once, at the last accumulated batch.
        with run.accelerator.no_sync(run.prepared) if not last else nullcontext():
            with run.accelerator.autocast(), _process_noise(run, progress.step, micro):
                out = run.prepared(batch, features=features, step=progress.step)
            if not _finite_everywhere(run, out.loss):
                bad = {k: v for k, v in out.scalars().items() if not math.isfinite(v)}
                logger.warning(
                    "step %d: non-finite loss; non-finite terms %s; examples %s",
                    progress.step + 1,
                    bad,
                    [run.data.train[i].source for i in indices],
                )
                return records, False
            run.accelerator.backward(out.loss / tcfg.gradient_accumulation_steps)
        records.append(out.scalars())
    return records, True


@contextmanager
def _process_noise(run: _Training, step: int, micro: int):
    """Several processes: the forward draws its random numbers (the continuous latent's sample, Gumbel
    noise, dropout, the divergence term's other codes) from a generator seeded by the run's seed, the
    step, the accumulated batch and the process, so that the processes' slices get independent noise
    that a resumed run draws again; the global random state, which stays the same on every process
    (dead-code restarts draw from it), is put back afterwards. One process: its random state, as before."""
    if run.state is None:
        yield
        return
    rank = run.state.process_index
    digest = hashlib.blake2b(f"{run.config.train.seed}:{step}:{micro}:{rank}".encode(), digest_size=8).digest()
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        torch.manual_seed(int.from_bytes(digest, "little") >> 1)
        yield


def _finite_everywhere(run: _Training, loss: torch.Tensor) -> bool:
    """Whether the loss is finite in every process (so that all of them skip the same steps)."""
    finite = bool(torch.isfinite(loss))
    if run.state is None:
        return finite
    flags = torch.tensor([0.0 if finite else 1.0], device=run.device)
    return float(run.accelerator.reduce(flags, "sum")) == 0.0


def _skip_nonfinite_step(run: _Training, progress: _Progress, records: Sequence[dict[str, float]]) -> None:
    """Drop the step's gradients; stop when the weights are broken or too many steps in a row were skipped."""
    progress.nonfinite += 1
    run.optimizer.zero_grad(set_to_none=True)
    step = progress.step + 1
    broken = nonfinite_tensors(run.model.trainable_state_dict())
    if broken:  # skipping steps cannot repair weights that are already NaN or infinite
        raise _diverged(step, f"non-finite weights {broken[:8]}", progress.checkpoint)
    if progress.nonfinite >= run.config.train.max_nonfinite_steps:
        raise _diverged(
            step,
            f"{progress.nonfinite} consecutive non-finite losses or gradients (last record: "
            f"{records[-1] if records else 'loss itself non-finite'})",
            progress.checkpoint,
        )


def _refresh_codebook(run: _Training, step: int) -> None:
    """k-means refresh of the codebook every ``codebook_refresh_every`` steps of the first half of training."""
    every = _refresh_every(run.config)
    due = every and run.init_features is not None and step % every == 0 and step <= run.config.train.max_steps // 2
    if due and run.main:  # on the whole (gathered) frozen pass; the caller broadcasts the codebook
        run.model.refresh_from_data(run.init_features, run.config.train.seed + step)


def _due(every: int, step: int, max_steps: int) -> bool:
    """Every ``every`` steps (0: never) and at the last step."""
    return bool(every) and step % every == 0 or step == max_steps


def _validate(run: _Training, step: int) -> dict[str, float]:
    processes = distributed.rank_and_size(run.state)[1]
    return validate(
        run.model, run.data.validation, run.frozen.validation, run.pad_id, run.config, step, run.device, processes
    )


def _check_loss(progress: _Progress, record: dict[str, float]) -> None:
    """Warn of a loss far above its scale; stop after LOSS_PATIENCE such steps in a row."""
    problem = progress.monitor.check(record)
    if problem is None:
        return
    if progress.monitor.strikes >= LOSS_PATIENCE:
        raise _diverged(progress.step, problem, progress.checkpoint)
    logger.warning(
        "step %d: %s (%d of %d such steps in a row stop training)",
        progress.step,
        problem,
        progress.monitor.strikes,
        LOSS_PATIENCE,
    )


# --------------------------------------------------------------------------- logging and checkpointing


@dataclass
class _MetricsLog:
    """``metrics.jsonl`` (one line per step, flushed), TensorBoard (optional) and the progress bar."""

    path: Path
    file: IO[str]
    writer: Any  # a SummaryWriter, or None
    bar: Any

    def write(self, record: dict[str, float]) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as exc:
            raise OSError(exc.errno, f"could not write {self.path} ({exc.strerror or exc})") from exc
        if self.writer is not None:
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(key, value, record["step"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", rec=f"{record['reconstruction_loss']:.3f}")

    def sync(self) -> None:
        """Make the records written so far durable (before a checkpoint: the metrics up to it are as durable)."""
        os.fsync(self.file.fileno())


class _NoLog:
    """The logs of a process other than the main one: it writes nothing."""

    def write(self, record: dict[str, float]) -> None:
        pass

    def sync(self) -> None:
        pass


@contextmanager
def _metrics_log(output_dir: Path, tcfg: TrainConfig, step: int, main: bool = True):
    """Open the run's logs, appending after ``step``; closes them however training ends (none but the main process's)."""
    if not main:
        yield _NoLog()
        return
    path = output_dir / METRICS_FILE
    writer = _tensorboard_writer(output_dir) if tcfg.tensorboard else None
    bar = tqdm(total=tcfg.max_steps, initial=step, desc="train", disable=not tcfg.progress, unit="step")
    try:
        with path.open("a") as file:
            yield _MetricsLog(path, file, writer, bar)
    finally:
        bar.close()
        if writer is not None:
            writer.close()


def _save(run: _Training, progress: _Progress, log: _MetricsLog) -> None:
    """Checkpoint the step (not while the loss is far above its scale) and prune the old checkpoints."""
    if progress.monitor.strikes:
        logger.warning("step %d: not checkpointed while the loss is far above its scale", progress.step)
        return
    trainer_state = {
        "step": progress.step,
        "data_order": progress.order.state(),
        "zfree_reference_scale": run.c_base,
        "nonfinite_steps": progress.nonfinite,
        "latent": run.config.latent.latent,
        "loss_monitor": progress.monitor.state(),
        "frozen_pass_fingerprint": run.fingerprint,
    }
    if run.state is not None:  # several processes (a checkpoint without the key was trained by one)
        trainer_state["processes"] = run.state.num_processes
    if not run.main:  # the main process writes the checkpoint; the others learn its path when it is complete
        distributed.barrier(run.state)
        progress.checkpoint = latest_checkpoint(run.output_dir)
        return
    log.sync()
    try:
        checkpoint = save_checkpoint(
            run.output_dir,
            progress.step,
            run.model.trainable_state_dict(),
            run.optimizer.state_dict(),
            run.scheduler.state_dict(),
            trainer_state,
            run.config,
        )
    except NonFiniteState as exc:
        raise _diverged(progress.step, f"{exc}; not saved", progress.checkpoint) from exc
    progress.checkpoint = checkpoint
    prune_checkpoints(run.output_dir, run.config.train.keep_checkpoints, protect=checkpoint)
    distributed.barrier(run.state)


def _restore(
    resumed: CheckpointContents,
    model: CVAEBase,
    optimizer,
    scheduler,
    monitor: LossMonitor,
    applied: dict[str, tuple[Any, Any]],
    config: RunConfig,
    len_train: int,
) -> tuple[int, int, DataOrder]:
    """Put a checkpoint's weights, optimizer, scheduler, RNG and loss history in place; returns
    ``(step, consecutive non-finite steps, data order at the step)``."""
    apply_trainable_weights(model, resumed.model_state, resumed.path)
    check_optimizer_state(resumed.optimizer_state, optimizer, resumed.path / "optimizer.pt")
    check_scheduler_state(
        resumed.scheduler_state, getattr(scheduler, "scheduler", scheduler), resumed.path / "scheduler.json"
    )
    try:
        optimizer.load_state_dict(resumed.optimizer_state)
    except (ValueError, KeyError, TypeError) as error:  # other parameters: e.g. an older version of the heads
        raise CheckpointError(
            f"{resumed.path / 'optimizer.pt'}: the optimizer state does not fit this model's trainable "
            f"parameters ({error}). The checkpoint can be evaluated but not resumed; start a new run."
        ) from error
    try:
        scheduler.load_state_dict(resumed.scheduler_state)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{resumed.path / 'scheduler.json'}: not a scheduler state ({error})") from error
    _apply_optimizer_settings(optimizer, scheduler, config, applied)
    set_rng_state(resumed.rng_state)
    state = resumed.trainer_state
    position = state["data_order"]
    if position["position"] > len_train:
        raise CheckpointError(
            f"{resumed.path / 'trainer_state.json'}: data position {position['position']} is past the "
            f"{len_train} training examples"
        )
    monitor.load(state.get("loss_monitor", {}))
    logger.info("resumed from %s at step %d", resumed.path, resumed.step)
    order = DataOrder(len_train, config.train.seed, **position)
    return resumed.step, int(state.get("nonfinite_steps", 0)), order


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps <= ``step`` (a resumed run recomputes the rest; 0 keeps none).

    A partial last line (a crash while it was written) is dropped with a warning; an unreadable line
    elsewhere is an error naming the file and line; steps missing before ``step`` are warned about.
    """
    if not path.exists():
        return
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    kept, steps = [], []
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            record_step = record["step"]
            if not isinstance(record_step, int) or isinstance(record_step, bool):
                raise TypeError(f"'step' is {record_step!r}, not an integer")
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            if lineno == len(lines) and not data.endswith(b"\n"):
                logger.warning("%s:%d: dropped a partial last line (a crash while it was written)", path, lineno)
                continue
            raise ValueError(
                f"{path}:{lineno}: not a metrics record ({exc}); remove or repair that line to resume"
            ) from exc
        if record_step <= step:
            kept.append(raw.decode("utf-8"))
            steps.append(record_step)
    missing = sorted(set(range(1, step + 1)) - set(steps))
    if missing:
        logger.warning(
            "%s: no records of steps %s (lost before the checkpoint); the log has a gap there", path, missing
        )
    replace_file_durably(path, "".join(line + "\n" for line in kept).encode())


def _tensorboard_writer(output_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # pragma: no cover - depends on the optional package
        raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
    return SummaryWriter(str(output_dir / "tensorboard"))
