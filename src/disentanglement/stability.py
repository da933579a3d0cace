"""Divergence detection of training: non-finite steps, a loss that explodes while finite, parameter
norms that jump, and which checkpoint is the last good one when training stops."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoints import CheckpointError, checkpoint_step, complete_checkpoints, read_trainer_state
from .cvae_base import CVAEBase

#: The divergence check's window of recent losses, and the suspect steps in a row that stop training.
LOSS_WINDOW, LOSS_PATIENCE = 50, 3


class TrainingDiverged(RuntimeError):
    """Training stopped: non-finite losses, gradients or weights, or a loss that exploded.

    The message says what happened, at which step, and which checkpoint is the last good one."""


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


#: A checkpoint is suspect when a group's parameter norm exceeds this many times max(1, its largest norm at
#: the run's start and at its earlier good checkpoints): finite, saved, but from after a blow-up.
NORM_JUMP = 100.0


def parameter_norms(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The L2 norm of a trainable state's floating-point tensors per learning-rate group (as
    :meth:`CVAEBase.parameter_groups`: ``decoder.*``; ``latent_projection.*``/``codebook*``/``code_table``; the
    rest; a separate ``codebook`` group's norm counts in ``latent``)."""
    sums = {"encoder": 0.0, "latent": 0.0, "decoder": 0.0}
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            continue
        group = (
            "decoder"
            if name.startswith("decoder.")
            else "latent"
            if name.startswith(CVAEBase.LATENT_GROUP_PREFIXES)
            else "encoder"
        )
        sums[group] += float(tensor.detach().double().pow(2).sum())
    return {group: math.sqrt(total) for group, total in sums.items() if total or group != "decoder"}


def norm_jump(norms: dict[str, float], reference: dict[str, float]) -> str | None:
    """Why ``norms`` are suspect against ``reference`` (see :data:`NORM_JUMP`), or None."""
    jumped = [
        f"{group} {value:.4g} against {reference.get(group, 0.0):.4g} before"
        for group, value in norms.items()
        if not math.isfinite(value) or value > NORM_JUMP * max(1.0, reference.get(group, 0.0))
    ]
    if not jumped:
        return None
    return f"parameter norms jumped more than {NORM_JUMP:g}x ({'; '.join(jumped)})"


def last_good_checkpoint(output_dir: Path, before: int | None = None) -> Path | None:
    """The newest complete checkpoint (of step <= ``before``) not marked suspect in its trainer state."""
    for checkpoint in reversed(complete_checkpoints(output_dir)):
        if before is not None and checkpoint_step(checkpoint) > before:
            continue
        try:
            if not read_trainer_state(checkpoint).get("suspect"):
                return checkpoint
        except CheckpointError:
            continue
    return None


def _checkpoint_note(checkpoint: Path | None) -> str:
    """``the last good checkpoint is X``, saying when the newest one is suspect and which is good instead."""
    if checkpoint is None:
        return "no checkpoint was written"
    try:
        suspect = read_trainer_state(checkpoint).get("suspect")
    except CheckpointError:
        suspect = None
    if not suspect:
        return f"the last good checkpoint is {checkpoint}"
    good = last_good_checkpoint(checkpoint.parent.parent, checkpoint_step(checkpoint))
    return (
        f"the last checkpoint {checkpoint} is suspect ({suspect}); the last good checkpoint is "
        f"{good if good is not None else 'none (every checkpoint is suspect: start a new run)'}"
    )


def diverged(step: int, what: str, checkpoint: Path | None) -> TrainingDiverged:
    """The error that stops training at ``step`` for ``what``, naming the last good checkpoint and what to do."""
    last = _checkpoint_note(checkpoint)
    return TrainingDiverged(
        f"training diverged at step {step}: {what}; {last}. Lower the learning rates (they may change on "
        "resume: --resume auto --latent-lr ...) or check the data."
    )
