"""Several processes (``accelerate launch --num_processes N``): which process this is, and the few
collectives that the trainer, the frozen pass and evaluation use.

A single process (no launcher, or ``--num_processes 1``) has no state here (``None``): every helper
then does what one process does, without touching ``torch.distributed``, so single-process runs are
exactly what they were before multi-process support existed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when a collective runs: the command line asks is_main_process before dispatch
    import torch


def launched_processes() -> int:
    """How many processes the launcher started (``WORLD_SIZE``; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Whether this is the main process (``RANK`` 0, or no launcher), before any state exists."""
    return int(os.environ.get("RANK", "0")) == 0


def process_state(cpu: bool):
    """accelerate's ``PartialState`` (which starts the process group: gloo with ``cpu``, else NCCL on
    CUDA) when several processes were launched; None for one process."""
    if launched_processes() <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=cpu)


def rank_and_size(state) -> tuple[int, int]:
    """``(process index, number of processes)``; ``(0, 1)`` for one process."""
    return (0, 1) if state is None else (state.process_index, state.num_processes)


def is_main(state) -> bool:
    return state is None or state.is_main_process


def gather_objects(state, obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in process order, on every process; ``[obj]`` for one."""
    if state is None or state.num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])


def barrier(state) -> None:
    if state is not None and state.num_processes > 1:
        state.wait_for_everyone()


def broadcast_(state, tensors: list[torch.Tensor]) -> None:
    """Overwrite ``tensors`` in place, on every process, with the main process's values."""
    if state is None or state.num_processes == 1:
        return
    import torch

    for tensor in tensors:
        tensor.data.copy_(_on_backend(state, torch.distributed.broadcast, tensor.data.clone(), src=0))


def all_reduce_max_(state, tensor: torch.Tensor) -> None:
    """The element-wise maximum over the processes, in place."""
    if state is None or state.num_processes == 1:
        return
    import torch

    tensor.copy_(_on_backend(state, torch.distributed.all_reduce, tensor.clone(), op=torch.distributed.ReduceOp.MAX))


def _on_backend(state, collective, tensor: torch.Tensor, **kwargs) -> torch.Tensor:
    """Run ``collective`` on ``tensor`` where the backend can (NCCL: the process's GPU); returns the result."""
    work = tensor.to(state.device) if state.device.type == "cuda" else tensor
    collective(work, **kwargs)
    return work.to(tensor.device)
