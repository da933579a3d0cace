"""Resuming a run: which checkpoint, which config changes are allowed, and putting its state back.

A resumed run continues bit for bit where an uninterrupted run would be; a config field that would
change what is trained cannot change on resume (it is refused, named), except the learning rates,
weight decay and clipping norm, which are applied from the resumed step on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .checkpoints import (
    CheckpointContents,
    CheckpointError,
    apply_trainable_weights,
    check_optimizer_state,
    check_scheduler_state,
    read_checkpoint,
    read_resumable,
    set_rng_state,
)
from .config import ConfigError, RunConfig
from .cvae_base import CVAEBase
from .data import DataOrder
from .stability import LossMonitor, last_good_checkpoint, parameter_norms

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
        "feature_cache_max_gb",
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
RESUME_APPLIED_FIELDS = frozenset(
    {"encoder_lr", "latent_lr", "decoder_lr", "codebook_lr", "weight_decay", "max_grad_norm"}
)


def _flat_fields(config: RunConfig) -> dict[str, Any]:
    return {name: value for section in config.to_dict().values() for name, value in section.items()}


def check_resume_config(stored: RunConfig, given: RunConfig, checkpoint: Path) -> dict[str, tuple[Any, Any]]:
    """Fields that differ between a checkpoint's config and the resuming run's: refuses any that would
    change what is trained, and returns ``{field: (old, new)}`` of those applied from the resumed step."""
    old, new = _flat_fields(stored), _flat_fields(given)
    changed = {name: (old[name], new[name]) for name in old if old[name] != new[name]}
    if "codebook_lr" in changed and None in changed["codebook_lr"]:
        a, b = changed["codebook_lr"]
        raise ConfigError(
            f"cannot resume {checkpoint} with codebook_lr {b!r} (the checkpoint's run had {a!r}): from or to None "
            "changes the optimizer's groups (the codebook in a group of its own or in the latent projection's); "
            "resume with the run's value, or change it between two values"
        )
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


def resume_source(config: RunConfig, output_dir: Path) -> CheckpointContents | None:
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


def check_fingerprint(resumed: CheckpointContents | None, fingerprint: str) -> None:
    """A resumed run continues on the data, tokenizer and frozen model it was trained on."""
    if resumed is not None and resumed.trainer_state.get("frozen_pass_fingerprint", fingerprint) != fingerprint:
        raise ConfigError(
            f"cannot resume {resumed.path}: the data, the tokenizer or the frozen model differ from the run's "
            f"(fingerprint {fingerprint}, the run's {resumed.trainer_state['frozen_pass_fingerprint']}); "
            "the fingerprint includes the decoder weights' dtype, so a run started in float32 resumes only "
            "with --dtype float32 (dtype: auto now chooses bf16 on CUDA and on CPUs with fast bf16); "
            "otherwise resuming would continue on other data: start a new run"
        )


def check_processes(resumed: CheckpointContents | None, processes: int) -> None:
    """A resumed run continues with its number of processes: the global batch is ``batch_size x processes``."""
    if resumed is None:
        return
    before = int(resumed.trainer_state.get("processes", 1))
    if before != processes:
        raise ConfigError(
            f"cannot resume {resumed.path} with {processes} process(es): the run was trained with {before}, and "
            f"a step's global batch is batch_size x processes; launch it with --num_processes {before}"
        )


def restore(
    resumed: CheckpointContents,
    model: CVAEBase,
    optimizer,
    scheduler,
    monitor: LossMonitor,
    applied: dict[str, tuple[Any, Any]],
    config: RunConfig,
    data_order: Callable[..., DataOrder],
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
    position = dict(state["data_order"])
    order = data_order(epoch=position["epoch"], position=0, batch=position.get("batch", 0))
    if position["position"] > order.size:
        raise CheckpointError(
            f"{resumed.path / 'trainer_state.json'}: data position {position['position']} is past the "
            f"{order.size} training examples"
        )
    monitor.load(state.get("loss_monitor", {}))
    logger.info("resumed from %s at step %d", resumed.path, resumed.step)
    order.position = position["position"]
    return resumed.step, int(state.get("nonfinite_steps", 0)), order


def _apply_optimizer_settings(optimizer, scheduler, config: RunConfig, changes: dict[str, tuple[Any, Any]]) -> None:
    """Set changed learning rates, weight decay: the schedule continues from the resumed step with the new base."""
    if not changes:
        return
    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the LambdaLR
    from .trainer import group_learning_rates

    lrs = group_learning_rates(config)
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


def resumed_norm_reference(resumed: CheckpointContents, model: CVAEBase) -> dict[str, float]:
    """The parameter norms a resumed run's later checkpoints are compared with (:data:`.stability.NORM_JUMP`):
    the checkpoint's reference, raised to its own norms unless it is suspect (then said, with the last good one)."""
    state = resumed.trainer_state
    reference = dict(state.get("param_norm_reference") or {})
    if state.get("suspect"):
        good = last_good_checkpoint(resumed.path.parent.parent, resumed.step)
        logger.warning(
            "resuming from %s, which is suspect (%s); the last good checkpoint is %s",
            resumed.path,
            state["suspect"],
            good if good is not None else "none",
        )
    else:
        norms = state.get("param_norms") or parameter_norms(model.trainable_state_dict())
        reference = {g: max(v, reference.get(g, 0.0)) for g, v in norms.items()}
    return reference
