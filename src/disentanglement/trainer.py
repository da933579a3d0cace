"""Training loop on accelerate's ``Accelerator``: AdamW, warm-up + cosine, accumulation, clipping,
per-step JSONL metrics, periodic validation, divergence detection and durable, resumable checkpoints.

The recipe reads top to bottom: :func:`train` (the lock) and :func:`_train` (the checks, then the loop),
set-up (:func:`_set_up`, :func:`_start_or_restore`), one optimizer step (:func:`_optimizer_step`),
validation (:func:`_validate`) and checkpointing (:func:`_save`). What it calls lives beside it: the run
directory's policy and lock in :mod:`.run_dir`, resuming in :mod:`.resume`, the logs in
:mod:`.metrics_log`, divergence detection in :mod:`.stability`, the frozen pass in :mod:`.frozen_pass`
and the validation means in :mod:`.validation`.

A run directory belongs to one run (:mod:`.run_dir`); a resumed run continues bit for bit where an
uninterrupted run would be (:mod:`.resume`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from . import distributed
from .checkpoints import (
    CheckpointContents,
    NonFiniteState,
    latest_checkpoint,
    load_trainable_weights,
    load_trained,
    nonfinite_tensors,
    prune_checkpoints,
    save_checkpoint,
)
from .config import ConfigError, ModelConfig, RunConfig
from .cvae_base import CVAEBase, FrozenFeatures
from .data import DataOrder, collate, load_pairs
from .features import FeatureCache, batch_features, feature_fingerprint
from .frozen_pass import FrozenPass, kmeans_sample, refresh_every, run_c_base, run_frozen_pass, warn_term5_amplification
from .metrics_log import METRICS_FILE, MetricsLog, open_metrics_log, truncate_metrics
from .models import build_cvae
from .resume import (
    check_fingerprint,
    check_processes,
    check_resume_config,
    restore,
    resume_source,
    resumed_norm_reference,
)
from .run_dir import check_run_directory, remove_run_artefacts, run_lock, write_run_files
from .splits import PreparedData, prepare_data
from .stability import (
    LOSS_PATIENCE,
    LossMonitor,
    TrainingDiverged,
    diverged,
    last_good_checkpoint,
    norm_jump,
    parameter_norms,
)
from .validation import mean_records, validate

__all__ = [  # checkpoint I/O lives in checkpoints.py; these names stay importable from here
    "TrainResult",
    "TrainingDiverged",
    "latest_checkpoint",
    "load_trainable_weights",
    "load_trained",
    "prepare_data",
    "train",
]

logger = logging.getLogger(__name__)


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
    pad_token_id: int | None = None  # the tokenizer's, for scoring ``data`` afterwards (the verdict)


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
    state = distributed.process_state(cpu=choose_device(config.train.device, "TrainConfig.device").type == "cpu")
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
    resumed = resume_source(config, output_dir)
    # The main process checks (and later clears) the directory; the others would see its files appear.
    to_remove = check_run_directory(output_dir, resumed, tcfg.resume, tcfg.overwrite) if main else []
    applied = check_resume_config(resumed.config, config, resumed.path) if resumed is not None else {}
    pairs = load_pairs(config.data) if pairs is None else pairs

    run = _set_up(config, output_dir, resumed, to_remove, model_and_tokenizer, pairs)
    progress = _start_or_restore(run, resumed, applied)
    if main:
        truncate_metrics(output_dir / METRICS_FILE, progress.step)
    run.prepared.train()
    with open_metrics_log(output_dir, tcfg, progress.step, main) as log:
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
        output_dir,
        progress.step,
        progress.checkpoint,
        run.c_base,
        progress.last,
        run.model,
        run.data,
        run.frozen.full,
        run.pad_id,
    )


# --------------------------------------------------------------------------- set-up


def group_learning_rates(config: RunConfig) -> dict[str, float]:
    """Each optimizer group's base learning rate, by the group's name (:meth:`CVAEBase.parameter_groups`)."""
    train = config.train
    codebook = train.latent_lr if train.codebook_lr is None else train.codebook_lr
    return {"encoder": train.encoder_lr, "latent": train.latent_lr, "decoder": train.decoder_lr, "codebook": codebook}


#: The optimizer groups that ``train.encoder_hold_steps`` holds at their start.
HELD_GROUPS = frozenset({"encoder", "codebook"})


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, start: int = 0) -> float:
    """The learning-rate factor at ``step``: 0 before ``start``; from there a linear warm-up over ``warmup_steps``
    and a cosine decay to 0 at ``total_steps`` (transformers' ``get_cosine_schedule_with_warmup`` shifted to
    ``start``: equal to it for ``start = 0``)."""
    if step < start:
        return 0.0
    step, total_steps = step - start, total_steps - start
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_scheduler(optimizer: torch.optim.Optimizer, config: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up and cosine decay per group (:func:`warmup_cosine`); the groups in :data:`HELD_GROUPS` start
    only after ``train.encoder_hold_steps``."""
    tcfg = config.train
    lambdas = [
        partial(
            warmup_cosine,
            warmup_steps=tcfg.warmup_steps,
            total_steps=tcfg.max_steps,
            start=tcfg.encoder_hold_steps if group["name"] in HELD_GROUPS else 0,
        )
        for group in optimizer.param_groups
    ]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def optimizer_groups(model: CVAEBase, config: RunConfig) -> dict[str, list[torch.nn.Parameter]]:
    """The optimizer's parameter groups, by name, in its order (the empty ones left out)."""
    separate = config.train.codebook_lr is not None or config.train.encoder_hold_steps > 0
    return {name: params for name, params in model.parameter_groups(separate_codebook=separate).items() if params}


def make_optimizer(model: CVAEBase, config: RunConfig) -> torch.optim.Optimizer:
    lrs = group_learning_rates(config)
    groups = [
        {"params": params, "lr": lrs[name], "name": name} for name, params in optimizer_groups(model, config).items()
    ]
    # The fused kernel is one call per step instead of one per tensor (measurably cheaper for small heads).
    return torch.optim.AdamW(groups, weight_decay=config.train.weight_decay, fused=True)


def choose_device(preference: str, flag: str = "--device") -> torch.device:
    """``cuda`` when asked for (or ``auto`` and present), else ``cpu``; ``cuda`` without a usable GPU is a
    :class:`ConfigError` naming ``flag`` and what was found (never a silent run on the CPU)."""
    if preference == "cuda" and not torch.cuda.is_available():
        found = (
            f"this torch {torch.__version__} is built without CUDA"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds {torch.cuda.device_count()} GPU(s)"
        )
        raise ConfigError(f"{flag} cuda: no usable CUDA device here ({found}); use --device cpu or auto")
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


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
    frozen: FrozenPass
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
    norm_reference: dict[str, float] = field(default_factory=dict)  # largest norms before (see NORM_JUMP)
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
    from accelerate.utils import set_seed

    tcfg = config.train
    device = choose_device(tcfg.device, "TrainConfig.device")
    accelerator = _accelerator(device, config.model)
    state = accelerator.state if accelerator.num_processes > 1 else None
    main = accelerator.is_main_process
    check_processes(resumed, accelerator.num_processes)
    # scikit-learn's first import (k-means starts the codebook) draws from Python's global generator (rich's
    # style ids): imported before seeding, so that the first run in a process saves the same rng.safetensors
    # as any later one.
    import sklearn.cluster  # noqa: F401

    set_seed(tcfg.seed)
    decoder, tokenizer = _decoder_and_tokenizer(config, model_and_tokenizer, device)
    data = prepare_data(config, tokenizer, pairs)
    if not data.train:
        raise ValueError("no training examples after loading and splitting the data")
    logger.info("data: %s", data.stats)

    model = build_cvae(config, decoder).to(accelerator.device)
    fingerprint = feature_fingerprint(model, data.train + data.validation)  # the data, tokenizer and frozen model
    check_fingerprint(resumed, fingerprint)
    frozen = run_frozen_pass(
        config, model, data, resumed, tokenizer.pad_token_id, accelerator.device, output_dir, state
    )
    c_base = run_c_base(config, resumed, frozen.train, len(data.train))
    model.zfree_reference_scale = c_base
    if main and resumed is None:
        warn_term5_amplification(config, frozen.train, c_base)
    distributed.barrier(state)  # every process has checked the run directory before the main one writes to it
    if main:
        # --overwrite: only now that everything before the first write has worked
        remove_run_artefacts(to_remove, output_dir)
        write_run_files(output_dir, config, data.stats, c_base)

    init_features = kmeans_sample(config, data, frozen.train, tokenizer.pad_token_id, accelerator.device)
    if resumed is None and init_features is not None:
        if main:  # k-means of the whole (gathered) frozen pass, on the main process, then broadcast
            model.initialize_from_data(init_features, tcfg.seed)
        distributed.broadcast_(state, model.data_dependent_state())
    optimizer = make_optimizer(model, config)
    scheduler = make_scheduler(optimizer, config)
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


def mixed_precision(device: torch.device, model: ModelConfig) -> str:
    """accelerate's ``mixed_precision`` for a training run: "bf16" (the step's forward under bf16 autocast) on
    CUDA, except for a whole decoder with float32 weights (``decoder_training: full``, ``dtype`` auto or float32),
    whose step stays float32 as the recipes were measured: on the CPU, bf16 autocast of the decoder's forward lost
    the steer preset's style on ``style-in-echo`` (read back from 0.75 and 0.81 of the generations on two seeds,
    against 1.000 in float32 on the same machine; docs/what-the-cvae-adds.md, section 22); CUDA's whole-forward
    autocast is untested and inferred to lose no less. "no" on the CPU."""
    from .lm import resolve_dtype

    if device.type != "cuda":
        return "no"
    whole_float32 = model.decoder_training == "full" and resolve_dtype(model, device) == torch.float32
    return "no" if whole_float32 else "bf16"


def _accelerator(device: torch.device, model: ModelConfig):
    """accelerate's ``Accelerator`` for ``device`` with :func:`mixed_precision`; DDP with several processes."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    # Several processes: the trainable parameters' gradients are averaged by DDP (a frozen decoder has
    # requires_grad off already, so it is in no gradient bucket). find_unused_parameters, so that an option
    # that leaves a head out of some forward cannot stop DDP (in the configurations tested none is; it
    # costs one graph traversal per backward). Buffers are not broadcast at each forward: the codebook's
    # usage steps are merged across processes after each step (merge_step_statistics).
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
    # The schedule counts optimizer steps: accelerate would otherwise step it once per process per step
    # (it assumes each process's data loader got N times shorter; here the data order is global).
    return Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=mixed_precision(device, model),
        kwargs_handlers=[ddp],
        step_scheduler_with_optimizer=False,
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


def _data_order(run: _Training, epoch: int = 0, position: int = 0, batch: int | None = None) -> DataOrder:
    """The training data's order: length-grouped in batches of what one step's accumulated batch takes from
    it (``batch_size`` x processes) when ``train.group_by_length``; ``batch`` (a checkpoint's) overrides that,
    0 = uniform shuffling (a checkpoint written without grouping continues without it)."""
    tcfg = run.config.train
    if batch is None:
        batch = tcfg.batch_size * distributed.rank_and_size(run.state)[1] if tcfg.group_by_length else 0
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in run.data.train]
    return DataOrder(len(lengths), tcfg.seed, epoch, position, lengths=lengths, batch=batch)


def _start_or_restore(
    run: _Training, resumed: CheckpointContents | None, applied: dict[str, tuple[Any, Any]]
) -> _Progress:
    """Step 0 of a fresh run, or the checkpoint's step with everything it saved put back in place."""
    tcfg = run.config.train
    monitor = LossMonitor(tcfg.max_loss_ratio, run.c_base)
    if resumed is None:
        norms = parameter_norms(run.model.trainable_state_dict())
        return _Progress(0, 0, _data_order(run), monitor, checkpoint=None, norm_reference=norms)
    step, nonfinite, order = restore(
        resumed, run.model, run.optimizer, run.scheduler, monitor, applied, run.config, partial(_data_order, run)
    )
    reference = resumed_norm_reference(resumed, run.model)
    return _Progress(step, nonfinite, order, monitor, checkpoint=resumed.path, norm_reference=reference)


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
    held = progress.step < tcfg.encoder_hold_steps  # the codebook stays at its start: no restart, no refresh
    if not held:
        run.model.post_step(progress.step)  # with the index of the step just taken, as its forward saw it
    progress.step += 1
    if not held:
        _refresh_codebook(run, progress.step)
    distributed.broadcast_(run.state, run.model.data_dependent_state())  # one codebook on every process
    record = mean_records(distributed.gather_objects(run.state, mean_records(records)))  # averaged over processes
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
    noise, dropout, word dropout, the divergence term's other codes) from a generator seeded by the run's seed, the
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
        raise diverged(step, f"non-finite weights {broken[:8]}", progress.checkpoint)
    if progress.nonfinite >= run.config.train.max_nonfinite_steps:
        raise diverged(
            step,
            f"{progress.nonfinite} consecutive non-finite losses or gradients (last record: "
            f"{records[-1] if records else 'loss itself non-finite'})",
            progress.checkpoint,
        )


def _refresh_codebook(run: _Training, step: int) -> None:
    """k-means refresh of the codebook every ``codebook_refresh_every`` steps of the first half of training."""
    every = refresh_every(run.config)
    due = every and run.init_features is not None and step % every == 0 and step <= run.config.train.max_steps // 2
    if due and run.main:  # on the whole (gathered) frozen pass; the caller broadcasts the codebook
        run.model.refresh_from_data(run.init_features, run.config.train.seed + step)


def _due(every: int, step: int, max_steps: int) -> bool:
    """Every ``every`` steps (0: never) and at the last step."""
    return bool(every) and step % every == 0 or step == max_steps


# --------------------------------------------------------------------------- validation


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
        raise diverged(progress.step, problem, progress.checkpoint)
    logger.warning(
        "step %d: %s (%d of %d such steps in a row stop training)",
        progress.step,
        problem,
        progress.monitor.strikes,
        LOSS_PATIENCE,
    )


# --------------------------------------------------------------------------- checkpointing


def _save(run: _Training, progress: _Progress, log: MetricsLog) -> None:
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
    norms = parameter_norms(run.model.trainable_state_dict())
    suspect = norm_jump(norms, progress.norm_reference)
    trainer_state.update(param_norms=norms, param_norm_reference=dict(progress.norm_reference))
    if suspect:
        trainer_state["suspect"] = suspect
    else:
        progress.norm_reference = {g: max(v, progress.norm_reference.get(g, 0.0)) for g, v in norms.items()}
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
        raise diverged(progress.step, f"{exc}; not saved", progress.checkpoint) from exc
    progress.checkpoint = checkpoint
    good = checkpoint
    if suspect:
        good = last_good_checkpoint(run.output_dir, progress.step)
        logger.warning(
            "step %d: checkpoint %s is suspect (%s); the last good checkpoint (kept) is %s",
            progress.step,
            checkpoint,
            suspect,
            good or "none",
        )
    protect = checkpoint if good == checkpoint else [checkpoint, good]
    prune_checkpoints(run.output_dir, run.config.train.keep_checkpoints, protect=protect)
    distributed.barrier(run.state)
