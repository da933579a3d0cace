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
import json
import logging
import math
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

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
from .config import ConfigError, RunConfig
from .cvae_base import CVAEBase
from .data import Example, collate, limit_examples, load_pairs, split_train_validation, tokenize_pairs
from .features import FeatureCache, batch_features, feature_fingerprint, load_or_build_feature_cache
from .losses import estimate_zfree_reference_scale
from .models import build_cvae

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
) -> dict[str, float]:
    """Mean of every logged scalar over the first ``eval_batches`` validation batches (posterior mean/argmax)."""
    if not examples:
        return {}
    was_training = model.training
    model.eval()
    records = []
    size = config.train.batch_size
    try:
        for start in range(0, min(len(examples), size * config.train.eval_batches), size):
            indices = list(range(start, min(start + size, len(examples))))
            batch = collate([examples[i] for i in indices], pad_id, indices=indices).to(device)
            records.append(model(batch, features=batch_features(model, batch, cache), step=step).scalars())
    finally:
        model.train(was_training)
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

    One process at a time trains a run directory (:func:`run_lock`)."""
    with run_lock(Path(config.train.output_dir)):
        return _train(config, model_and_tokenizer, pairs, callbacks)


def _train(
    config: RunConfig,
    model_and_tokenizer: tuple[Any, Any] | None,
    pairs: Sequence | None,
    callbacks: Sequence[Callable[[int, dict], None]],
) -> TrainResult:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    tcfg = config.train
    output_dir = Path(tcfg.output_dir)
    # Everything that can be wrong with the run directory, the checkpoint or the data fails before the model loads.
    resumed = _resume_source(config, output_dir)
    to_remove = check_run_directory(output_dir, resumed, tcfg.resume, tcfg.overwrite)
    applied = check_resume_config(resumed.config, config, resumed.path) if resumed is not None else {}
    pairs = load_pairs(config.data) if pairs is None else pairs

    device = choose_device(tcfg.device)
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision="bf16" if device.type == "cuda" else "no")
    device = accelerator.device
    set_seed(tcfg.seed)
    if model_and_tokenizer is None:
        from .lm import load_model_and_tokenizer

        decoder, tokenizer = load_model_and_tokenizer(config.model, device="cpu")
    else:
        decoder, tokenizer = model_and_tokenizer
    pad_id = tokenizer.pad_token_id
    data = prepare_data(config, tokenizer, pairs)
    if not data.train:
        raise ValueError("no training examples after loading and splitting the data")
    logger.info("data: %s", data.stats)

    model = build_cvae(config, decoder).to(device)
    fingerprint = feature_fingerprint(model, data.train + data.validation)  # the data, tokenizer and frozen model
    if resumed is not None and resumed.trainer_state.get("frozen_pass_fingerprint", fingerprint) != fingerprint:
        raise ConfigError(
            f"cannot resume {resumed.path}: the data, the tokenizer or the frozen model differ from the run's "
            f"(fingerprint {fingerprint}, the run's {resumed.trainer_state['frozen_pass_fingerprint']}); "
            "resuming would continue on other data: start a new run"
        )
    start_step = resumed.step if resumed is not None else 0
    all_examples = data.train + data.validation
    n_train = len(data.train)
    refresh_every = config.latent.codebook_refresh_every if config.latent.codebook_init == "kmeans" else 0
    kmeans = config.latent.latent == "discrete" and config.latent.codebook_init == "kmeans"
    # The k-means start (fresh runs) and refreshes (first half of training) need the frozen features,
    # with or without the cache option, so that a resumed run refreshes exactly as an uninterrupted one.
    needs_kmeans_features = kmeans and (resumed is None or (refresh_every and start_step < tcfg.max_steps // 2))
    needs_c_base = resumed is None and config.reconstruction.zfree_reference_scale is None
    cache: FeatureCache | None = None
    if tcfg.feature_cache or needs_c_base or needs_kmeans_features:
        cache_dir = (tcfg.feature_cache_dir or output_dir / "feature_cache") if tcfg.feature_cache else None
        cache = load_or_build_feature_cache(
            model,
            all_examples,
            pad_id,
            cache_dir,
            batch_size=max(tcfg.batch_size, 16),
            device=device,
            progress=tcfg.progress,
        )
    train_cache = cache.subset(0, n_train) if cache is not None else None
    # Without the cache option, steps and validation run the frozen pass themselves (cache is then
    # only the one-off pass for c_base and k-means).
    step_cache = train_cache if tcfg.feature_cache else None
    val_cache = cache.subset(n_train, len(all_examples)) if cache is not None and tcfg.feature_cache else None

    if resumed is not None:
        c_base = float(resumed.trainer_state["zfree_reference_scale"])
    elif config.reconstruction.zfree_reference_scale is not None:
        c_base = config.reconstruction.zfree_reference_scale
    else:
        c_base = estimate_zfree_reference_scale(train_cache.example_base_losses())
        logger.info(
            "estimated zfree_reference_scale c_base = %.4f nats/token over %d examples", c_base, len(data.train)
        )
    model.zfree_reference_scale = c_base
    _remove(to_remove, output_dir)  # --overwrite: only now that everything before the first write has worked
    replace_file_durably(output_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False).encode())
    stats = json.dumps(dict(data.stats, zfree_reference_scale=c_base), indent=2)
    replace_file_durably(output_dir / "data_stats.json", stats.encode())

    init_sample = list(range(min(n_train, 4096)))
    init_features = (
        train_cache.features(collate([data.train[i] for i in init_sample], pad_id, indices=init_sample).to(device))
        if train_cache is not None and kmeans
        else None
    )
    if resumed is None and init_features is not None:
        model.initialize_from_data(init_features, tcfg.seed)
    optimizer = make_optimizer(model, config)
    scheduler = get_cosine_schedule_with_warmup(optimizer, tcfg.warmup_steps, tcfg.max_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    core: CVAEBase = accelerator.unwrap_model(model)
    order = DataOrder(len(data.train), tcfg.seed)
    step = 0
    nonfinite = 0
    monitor = LossMonitor(tcfg.max_loss_ratio, c_base)
    if resumed is not None:
        step, nonfinite, order = _restore(resumed, core, optimizer, scheduler, monitor, applied, config, n_train)

    metrics_path = output_dir / "metrics.jsonl"
    truncate_metrics(metrics_path, step)
    writer = _tensorboard_writer(output_dir) if tcfg.tensorboard else None
    checkpoint = resumed.path if resumed is not None else None
    last: dict[str, float] = {}
    model.train()
    bar = tqdm(total=tcfg.max_steps, initial=step, desc="train", disable=not tcfg.progress, unit="step")
    with metrics_path.open("a") as metrics_file:
        while step < tcfg.max_steps:
            optimizer.zero_grad(set_to_none=True)
            records = []
            finite = True
            for _ in range(tcfg.gradient_accumulation_steps):
                indices = order.next_indices(tcfg.batch_size)
                batch = collate([data.train[i] for i in indices], pad_id, indices=indices).to(device)
                features = batch_features(core, batch, step_cache)  # float32 frozen pass, as in the cache
                with accelerator.autocast():
                    out = model(batch, features=features, step=step)
                if not torch.isfinite(out.loss):
                    finite = False
                    bad = {k: v for k, v in out.scalars().items() if not math.isfinite(v)}
                    logger.warning(
                        "step %d: non-finite loss; non-finite terms %s; examples %s",
                        step + 1,
                        bad,
                        [data.train[i].source for i in indices],
                    )
                    break
                accelerator.backward(out.loss / tcfg.gradient_accumulation_steps)
                records.append(out.scalars())
            grad_norm = float("nan")
            if finite:
                grad_norm = float(accelerator.clip_grad_norm_(core.parameters(), tcfg.max_grad_norm))
                finite = math.isfinite(grad_norm)
            if not finite:
                nonfinite += 1
                optimizer.zero_grad(set_to_none=True)
                broken = nonfinite_tensors(core.trainable_state_dict())
                if broken:  # skipping steps cannot repair weights that are already NaN or infinite
                    raise _diverged(step + 1, f"non-finite weights {broken[:8]}", checkpoint)
                if nonfinite >= tcfg.max_nonfinite_steps:
                    raise _diverged(
                        step + 1,
                        f"{nonfinite} consecutive non-finite losses or gradients (last record: "
                        f"{records[-1] if records else 'loss itself non-finite'})",
                        checkpoint,
                    )
                continue
            nonfinite = 0
            optimizer.step()
            scheduler.step()
            core.post_step(step)  # with the index of the step just taken, as its forward saw it
            step += 1
            if (
                refresh_every
                and init_features is not None
                and step % refresh_every == 0
                and step <= tcfg.max_steps // 2
            ):
                core.initialize_from_data(init_features, tcfg.seed + step, refresh=True)
            record = _mean_records(records)
            record.update(step=step, grad_norm=grad_norm)
            for group in optimizer.param_groups:
                record[f"lr_{group['name']}"] = group["lr"]
            if tcfg.eval_every and step % tcfg.eval_every == 0 or step == tcfg.max_steps:
                record.update(validate(core, data.validation, val_cache, pad_id, config, step, device))
            try:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            except OSError as exc:
                raise OSError(exc.errno, f"could not write {metrics_path} ({exc.strerror or exc})") from exc
            if writer is not None:
                for key, value in record.items():
                    if key != "step":
                        writer.add_scalar(key, value, step)
            last = record
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", rec=f"{record['reconstruction_loss']:.3f}")
            problem = monitor.check(record)
            if problem is not None:
                if monitor.strikes >= LOSS_PATIENCE:
                    raise _diverged(step, problem, checkpoint)
                logger.warning(
                    "step %d: %s (%d of %d such steps in a row stop training)",
                    step,
                    problem,
                    monitor.strikes,
                    LOSS_PATIENCE,
                )
            if (step % tcfg.save_every == 0 or step == tcfg.max_steps) and monitor.strikes:
                logger.warning("step %d: not checkpointed while the loss is far above its scale", step)
            elif step % tcfg.save_every == 0 or step == tcfg.max_steps:
                trainer_state = {
                    "step": step,
                    "data_order": order.state(),
                    "zfree_reference_scale": c_base,
                    "nonfinite_steps": nonfinite,
                    "latent": config.latent.latent,
                    "loss_monitor": monitor.state(),
                    "frozen_pass_fingerprint": fingerprint,
                }
                os.fsync(metrics_file.fileno())  # the metrics up to a checkpoint are as durable as it is
                try:
                    checkpoint = save_checkpoint(
                        output_dir,
                        step,
                        core.trainable_state_dict(),
                        optimizer.state_dict(),
                        scheduler.state_dict(),
                        trainer_state,
                        config,
                    )
                except NonFiniteState as exc:
                    raise _diverged(step, f"{exc}; not saved", checkpoint) from exc
                prune_checkpoints(output_dir, tcfg.keep_checkpoints, protect=checkpoint)
            for callback in callbacks:
                callback(step, record)
    bar.close()
    if writer is not None:
        writer.close()
    return TrainResult(output_dir, step, checkpoint, c_base, last, core, data, cache)


def _restore(
    resumed: CheckpointContents,
    core: CVAEBase,
    optimizer,
    scheduler,
    monitor: LossMonitor,
    applied: dict[str, tuple[Any, Any]],
    config: RunConfig,
    len_train: int,
) -> tuple[int, int, DataOrder]:
    """Put a checkpoint's weights, optimizer, scheduler, RNG and loss history in place; returns
    ``(step, consecutive non-finite steps, data order at the step)``."""
    apply_trainable_weights(core, resumed.model_state, resumed.path)
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
