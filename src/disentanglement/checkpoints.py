"""Checkpoint I/O: durable atomic saves, verified pickle-free loads, and a run directory's checkpoints.

A checkpoint is a directory ``RUN/checkpoints/step-NNNNNN/``::

    model.safetensors    trainable weights and latent-model buffers
    optimizer.pt         AdamW state (tensors, numbers, strings): read with torch.load(weights_only=True)
    scheduler.json       the learning-rate scheduler's state (numbers only)
    rng.safetensors      the torch, CUDA, numpy and Python generator states as tensors and metadata
    config.yaml          the resolved config of the run
    trainer_state.json   step, data position, c_base, counters, and the SHA-256 of every file above

Nothing in a checkpoint is unpickled: a file a user is handed cannot run code (``optimizer.pt`` is
read with ``weights_only=True``, which only rebuilds tensors and plain containers).

Saving writes every file into ``checkpoints/.tmp-step-NNNNNN``, fsyncs each file and the directory,
renames it to ``step-NNNNNN`` and fsyncs ``checkpoints/``; ``trainer_state.json`` is written last. So
after a crash (process killed, power lost) a ``step-*`` directory with a ``trainer_state.json`` is a
complete checkpoint whose files match their recorded checksums, and ``.tmp-*`` directories are
leftovers of an interrupted save (removed by the next save). A checkpoint whose weights or optimizer
state hold a non-finite value is never written (:class:`NonFiniteState`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from .config import ConfigError, RunConfig, load_run_config
from .safe_io import atomic_write, ensure_dir, fsync_dir, remove_path

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 2  # 2: pickle-free RNG and scheduler files, checksums in trainer_state.json
TRAINER_STATE = "trainer_state.json"
REQUIRED_STATE_KEYS = ("step", "data_order", "zfree_reference_scale")
RNG_METADATA_KEY = "scalars"  # rng.safetensors: the Python and numpy generators' scalars, one JSON object


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or used: the message names the file and the cause."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (disk full, read-only, ...); nothing partial is left."""


class NonFiniteState(RuntimeError):
    """Weights or optimizer state with NaN or infinity: such a state is never saved."""


# ------------------------------------------------------------------------------------------------
# the run directory's checkpoints


def checkpoint_step(path: Path) -> int | None:
    """``step-000050`` -> 50; None for any other name."""
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX) or not name[len(CHECKPOINT_PREFIX) :].isdigit():
        return None
    return int(name[len(CHECKPOINT_PREFIX) :])


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run directory (a ``trainer_state.json`` is present), oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (temporary directories of interrupted saves are ignored)."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_run(checkpoint: str | Path) -> tuple[Path, Path]:
    """``(checkpoint_dir, run_dir)`` of a checkpoint directory or a run directory (its latest checkpoint), or
    ``(path, path)`` of an export directory (``export.py``; an incomplete one is an ``ExportError``)."""
    path = Path(checkpoint)
    from .export import check_export, has_export_marker

    if has_export_marker(path):  # an export directory (export.py) is its own run directory
        check_export(path)
        return path, path
    if (path / "checkpoints").is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"{path} holds no complete checkpoint")
        return found, path
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint or run directory (no trainer_state.json, no checkpoints/)")
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return path, run_dir


def prune_checkpoints(output_dir: Path, keep: int, protect: Path | Iterable[Path | None] | None = None) -> None:
    """Keep the ``keep`` newest complete checkpoints (and ``protect``, one path or several); remove older
    ones and leftovers. A checkpoint that is a symbolic link is removed as a link (its target is kept)."""
    root = output_dir / "checkpoints"
    complete = complete_checkpoints(output_dir)
    protected = {p.resolve() for p in ([protect] if isinstance(protect, Path) else protect or ()) if p is not None}
    doomed = [old for old in complete[:-keep] if old.is_symlink() or old.resolve() not in protected]
    for old in doomed:  # a link goes as a link; a directory is first renamed away, so no half-removed step-*
        if old.is_symlink():
            old.unlink()
        else:
            away = root / f".old-{old.name}"
            remove_path(away)
            os.replace(old, away)
    for leftover in root.iterdir():
        if leftover.name.startswith(TMP_PREFIX) or leftover.name.startswith(".old-"):
            try:
                remove_path(leftover)
            except OSError as exc:
                logger.warning("could not remove %s (%s)", leftover, exc.strerror or exc)


# ------------------------------------------------------------------------------------------------
# durable writes


def write_durably(path: Path, data: bytes) -> str:
    """Write ``data`` to the new file ``path`` (one that exists, or a link, is an error: ``O_EXCL``) and fsync
    it; returns its SHA-256 (hex)."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return hashlib.sha256(data).hexdigest()


def replace_file_durably(path: Path, data: bytes, root: Path | None = None) -> None:
    """Replace ``path`` atomically with ``data`` (a temporary file, fsync, rename, fsync of the directory),
    never writing through a symbolic link (:func:`safe_io.atomic_write`)."""
    atomic_write(path, data, root)


# ------------------------------------------------------------------------------------------------
# states as files, without pickle


def rng_state() -> dict[str, Any]:
    """The global generators (what the model's sampling and k-means seeds use)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}  # noqa: NPY002
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state_to_safetensors(state: Mapping[str, Any]) -> bytes:
    """The generator states as safetensors bytes: tensors, plus the scalars in the metadata."""
    version, mt, gauss_next = state["python"]
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    tensors = {
        "torch": state["torch"],
        "python_mt": torch.tensor(mt, dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
    }
    for i, cuda in enumerate(state.get("cuda", [])):
        tensors[f"cuda_{i}"] = cuda
    scalars = {
        "python": {"version": version, "gauss_next": gauss_next},
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached": cached_gaussian},
    }
    # One metadata key: safetensors keeps the metadata in a hash map whose order changes from one call to
    # the next, so several keys would make two identical states differ byte for byte.
    metadata = {RNG_METADATA_KEY: json.dumps(scalars, sort_keys=True)}
    return save_safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def rng_state_from_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    if RNG_METADATA_KEY in metadata:
        scalars = json.loads(metadata[RNG_METADATA_KEY])
        python, numpy_meta = scalars["python"], scalars["numpy"]
    else:  # written before the scalars shared one key
        python, numpy_meta = json.loads(metadata["python"]), json.loads(metadata["numpy"])
    state: dict[str, Any] = {
        "python": (python["version"], tuple(int(v) for v in tensors["python_mt"].tolist()), python["gauss_next"]),
        "numpy": (
            numpy_meta["kind"],
            tensors["numpy_keys"].numpy().astype(np.uint32),
            numpy_meta["pos"],
            numpy_meta["has_gauss"],
            numpy_meta["cached"],
        ),
        "torch": tensors["torch"],
    }
    cuda = [tensors[f"cuda_{i}"] for i in range(sum(k.startswith("cuda_") for k in tensors))]
    if cuda:
        state["cuda"] = cuda
    return state


def _tensor_leaves(obj: Any, prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensor_leaves(value, f"{prefix}[{i}]")


def nonfinite_tensors(obj: Any, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors in ``obj`` (nested dicts and lists) holding NaN or infinity."""
    return [
        name
        for name, tensor in _tensor_leaves(obj, prefix)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]


# ------------------------------------------------------------------------------------------------
# save


def save_checkpoint(
    output_dir: Path,
    step: int,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    scheduler_state: Mapping[str, Any],
    trainer_state: dict[str, Any],
    config: RunConfig,
) -> Path:
    """Write a checkpoint durably and atomically (see the module docstring); returns its directory.

    Raises :class:`NonFiniteState` (nothing written) when a weight or optimizer tensor is not finite,
    and :class:`CheckpointWriteError` (nothing partial left) when a file cannot be written.
    """
    bad = nonfinite_tensors(dict(model_state), "model") + nonfinite_tensors(optimizer_state["state"], "optimizer")
    if bad:
        raise NonFiniteState(f"non-finite values in {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
    root = output_dir / "checkpoints"
    final = root / f"{CHECKPOINT_PREFIX}{step:06d}"
    tmp = root / f"{TMP_PREFIX}{final.name}"
    try:
        ensure_dir(root, output_dir)  # a real directory of the run, not a link to elsewhere
        remove_path(tmp)  # a leftover (a link is removed as a link)
        tmp.mkdir()
        optimizer_bytes = io.BytesIO()
        torch.save(dict(optimizer_state), optimizer_bytes)
        contents = {
            "model.safetensors": save_safetensors_bytes(
                {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
            ),
            "optimizer.pt": optimizer_bytes.getvalue(),
            "scheduler.json": json.dumps(dict(scheduler_state), allow_nan=False).encode(),
            "rng.safetensors": rng_state_to_safetensors(rng_state()),
            "config.yaml": yaml.safe_dump(config.to_dict(), sort_keys=False).encode(),
        }
        files = {name: write_durably(tmp / name, data) for name, data in contents.items()}
        state = dict(trainer_state, format=FORMAT_VERSION, files=files)
        write_durably(tmp / TRAINER_STATE, json.dumps(state, indent=2, allow_nan=False).encode())  # written last
        fsync_dir(tmp)
        old = root / f".old-{final.name}"
        remove_path(old)  # a leftover of a crash between the two renames below
        if os.path.lexists(final):  # a re-run of the same step (resumed from an earlier checkpoint)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(root)
        try:
            remove_path(old)
        except OSError as exc:
            logger.warning("could not remove %s (%s); the next save removes it", old, exc.strerror or exc)
    except ValueError:  # a state that cannot be written as it must be read back (e.g. NaN in the JSON)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(output_dir)
        raise CheckpointWriteError(
            exc.errno,
            f"could not write checkpoint {final} ({exc.strerror or exc}); nothing partial was kept; the last "
            f"complete checkpoint is {previous if previous is not None else 'none'}",
        ) from exc
    return final


# ------------------------------------------------------------------------------------------------
# load


@dataclass
class CheckpointContents:
    """Everything a checkpoint holds, read and verified (tensors on the CPU)."""

    path: Path
    trainer_state: dict[str, Any]
    config: RunConfig
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None = None
    scheduler_state: dict[str, Any] | None = None
    rng_state: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        return int(self.trainer_state["step"])


def _strict_json(data: str | bytes, path: Path) -> Any:
    """JSON without duplicate keys, NaN or infinities (what this code writes never has them)."""

    def pairs(items):
        keys = [k for k, _ in items]
        duplicated = sorted({k for k in keys if keys.count(k) > 1})
        if duplicated:
            raise CheckpointError(f"{path}: corrupt (duplicate key {duplicated[0]!r})")
        return dict(items)

    def constant(name):
        raise CheckpointError(f"{path}: corrupt (non-finite number {name})")

    return json.loads(data, object_pairs_hook=pairs, parse_constant=constant)


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_trainer_state(state: Any, path: Path, checkpoint: Path) -> None:
    """Every field of a trainer state has the type and range this code writes; else a CheckpointError."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: corrupt ({what})")

    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_STATE_KEYS):
        raise bad(f"expected an object with keys {list(REQUIRED_STATE_KEYS)}")
    if not _is_int(state["step"]):
        raise bad(f"'step' must be a non-negative integer, got {state['step']!r}")
    named = checkpoint_step(checkpoint)
    if named is not None and named != state["step"]:
        raise bad(f"'step' is {state['step']} but the directory is {checkpoint.name}")
    order = state["data_order"]
    if not (
        isinstance(order, dict)
        and {"epoch", "position"} <= set(order) <= {"epoch", "position", "batch"}
        and all(map(_is_int, order.values()))
    ):
        raise bad(
            f"'data_order' must be {{'epoch': int >= 0, 'position': int >= 0, 'batch': int >= 0 (optional)}}, "
            f"got {order!r}"
        )
    if not _is_number(state["zfree_reference_scale"]) or state["zfree_reference_scale"] <= 0:
        raise bad(f"'zfree_reference_scale' must be a finite number > 0, got {state['zfree_reference_scale']!r}")
    if "nonfinite_steps" in state and not _is_int(state["nonfinite_steps"]):
        raise bad(f"'nonfinite_steps' must be a non-negative integer, got {state['nonfinite_steps']!r}")
    monitor = state.get("loss_monitor", {})
    if not isinstance(monitor, dict) or not all(
        isinstance(v, list) and all(map(_is_number, v)) if k == "history" else _is_number(v) or v is None
        for k, v in monitor.items()
    ):
        raise bad(f"'loss_monitor' must hold finite numbers, got {monitor!r}")
    for key in ("param_norms", "param_norm_reference"):
        norms = state.get(key, {})
        if not isinstance(norms, dict) or not all(
            isinstance(k, str) and _is_number(v) and v >= 0 for k, v in norms.items()
        ):
            raise bad(f"{key!r} must map group names to finite numbers >= 0, got {norms!r}")
    if "suspect" in state and not isinstance(state["suspect"], str):
        raise bad(f"'suspect' must be a string, got {state['suspect']!r}")
    files = state.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for k, v in files.items()
    ):
        raise bad("'files' must map file names to SHA-256 hex digests")
    if "format" in state and state["format"] != FORMAT_VERSION:
        raise bad(f"'format' {state['format']!r} is not this version's {FORMAT_VERSION}")


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / TRAINER_STATE
    try:
        state = _strict_json(path.read_text(encoding="utf-8"), path)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing; {checkpoint} is not a complete checkpoint") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable or corrupt ({exc})") from exc
    _check_trainer_state(state, path, checkpoint)
    return state


def _read_verified(checkpoint: Path, name: str, state: Mapping[str, Any]) -> bytes:
    path = checkpoint / name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    expected = state.get("files", {}).get(name)
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"{path}: corrupt (its SHA-256 does not match the one recorded in {TRAINER_STATE})")
    return data


def read_model_state(checkpoint: Path, state: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    state = read_trainer_state(checkpoint) if state is None else state
    data = _read_verified(checkpoint, "model.safetensors", state)
    try:
        tensors = load_safetensors_bytes(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{checkpoint / 'model.safetensors'}: not a valid safetensors file ({exc})") from exc
    bad = nonfinite_tensors(tensors)
    if bad:  # a run never saves one (NonFiniteState): the file was forged or damaged
        raise CheckpointError(
            f"{checkpoint / 'model.safetensors'}: refused: tensor {bad[0]} holds NaN or infinity"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + "; a run never saves a non-finite state"
        )
    return tensors


def read_checkpoint(checkpoint: str | Path, for_resume: bool = False) -> CheckpointContents:
    """Read and verify a checkpoint; with ``for_resume`` also its optimizer, scheduler and RNG states.

    Every problem is a :class:`CheckpointError` naming the file and the cause.
    """
    checkpoint = Path(checkpoint)
    state = read_trainer_state(checkpoint)
    config_path = checkpoint / "config.yaml"
    _read_verified(checkpoint, "config.yaml", state)
    try:
        config = load_run_config(config_path)
    except ConfigError as exc:
        raise CheckpointError(f"{config_path}: not a valid config of this version ({exc})") from exc
    contents = CheckpointContents(checkpoint, state, config, read_model_state(checkpoint, state))
    if not for_resume:
        return contents
    if "format" not in state:
        raise CheckpointError(
            f"{checkpoint}: written by an older version whose optimizer, scheduler and RNG files are pickles, "
            "which are never loaded; the checkpoint can be evaluated but not resumed: start a new run"
        )
    optimizer_data = _read_verified(checkpoint, "optimizer.pt", state)
    try:
        contents.optimizer_state = torch.load(io.BytesIO(optimizer_data), weights_only=True, map_location="cpu")
    except Exception as exc:  # weights_only refuses any pickle that is not plain data; corrupt bytes fail too
        raise CheckpointError(
            f"{checkpoint / 'optimizer.pt'}: not a plain optimizer state, refused ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc
    if not (
        isinstance(contents.optimizer_state, dict)
        and isinstance(contents.optimizer_state.get("state"), dict)
        and isinstance(contents.optimizer_state.get("param_groups"), list)
    ):
        raise CheckpointError(f"{checkpoint / 'optimizer.pt'}: corrupt (not an optimizer state dict)")
    bad = nonfinite_tensors(contents.optimizer_state["state"], "state")
    if bad:
        raise CheckpointError(
            f"{checkpoint / 'optimizer.pt'}: refused: tensor {bad[0]} holds NaN or infinity; a run never saves a "
            "non-finite state"
        )
    scheduler_path = checkpoint / "scheduler.json"
    try:
        contents.scheduler_state = _strict_json(_read_verified(checkpoint, "scheduler.json", state), scheduler_path)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{scheduler_path}: corrupt ({exc})") from exc
    if not isinstance(contents.scheduler_state, dict):
        raise CheckpointError(f"{scheduler_path}: corrupt (not a scheduler state)")
    _read_verified(checkpoint, "rng.safetensors", state)
    try:
        contents.rng_state = rng_state_from_safetensors(checkpoint / "rng.safetensors")
        _check_rng_state(contents.rng_state)
    except (SafetensorError, KeyError, ValueError, TypeError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"{checkpoint / 'rng.safetensors'}: corrupt ({exc})") from exc
    return contents


def _check_rng_state(state: Mapping[str, Any]) -> None:
    """Apply the states to scratch generators: what they refuse, the global ones would refuse mid-restore."""
    random.Random().setstate(state["python"])
    np.random.RandomState().set_state(state["numpy"])
    torch.Generator().set_state(state["torch"])


def check_optimizer_state(saved: Mapping[str, Any], optimizer, path: Path) -> None:
    """Refuse an optimizer state whose groups, keys, shapes or dtypes do not fit ``optimizer``'s parameters.

    ``load_state_dict`` does not check shapes, and the fused AdamW kernel reads and writes a state of
    the wrong shape out of bounds: a crafted ``optimizer.pt`` must not get that far."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: does not fit this model's trainable parameters ({what})")

    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise bad(f"{len(groups)} parameter groups, the model has {len(optimizer.param_groups)}")
    params: dict[int, torch.Tensor] = {}
    for i, (group, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or len(ids) != len(live["params"]) or not all(map(_is_int, ids)):
            raise bad(f"group {i} lists other parameters")
        if group.get("name") != live.get("name"):
            raise bad(f"group {i} is {group.get('name')!r}, the model's is {live.get('name')!r}")
        params.update(zip(ids, live["params"], strict=True))
    for key, entry in saved["state"].items():
        if key not in params or not isinstance(entry, dict):
            raise bad(f"state for unknown parameter {key!r}")
        param = params[key]
        if set(entry) - {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}:
            raise bad(f"parameter {key}: unexpected state {sorted(set(entry))}")
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                raise bad(f"parameter {key}: {name} is not a tensor")
            if name == "step":
                if value.dim() != 0 or not value.is_floating_point():
                    raise bad(f"parameter {key}: step must be a 0-d float tensor")
            elif value.shape != param.shape or value.dtype != param.dtype:
                raise bad(
                    f"parameter {key}: {name} is {value.dtype} {tuple(value.shape)}, "
                    f"the parameter {param.dtype} {tuple(param.shape)}"
                )
            if not bool(torch.isfinite(value).all()):
                raise bad(f"parameter {key}: {name} is not finite")


def check_scheduler_state(saved: Mapping[str, Any], scheduler, path: Path) -> None:
    """A scheduler state has exactly the keys and value types of this scheduler's own state."""
    expected = scheduler.state_dict()
    if set(saved) != set(expected):
        raise CheckpointError(f"{path}: corrupt (keys {sorted(saved)}, expected {sorted(expected)})")
    for key, value in expected.items():
        got = saved[key]
        same_kind = isinstance(got, bool) == isinstance(value, bool) and (
            isinstance(got, type(value)) or (_is_number(got) and _is_number(value))
        )
        if not same_kind or (isinstance(value, list) and len(got) != len(value)):
            raise CheckpointError(f"{path}: corrupt ({key!r} is {got!r})")
        if isinstance(value, list) and not all(
            isinstance(v, type(e)) or _is_number(v) for v, e in zip(got, value, strict=True)
        ):
            raise CheckpointError(f"{path}: corrupt ({key!r} is {got!r})")


def read_resumable(output_dir: str | Path) -> CheckpointContents | None:
    """The newest checkpoint of a run that reads back completely (``--resume auto``).

    An unreadable newest checkpoint is skipped with a warning naming the file and the cause, and the
    previous complete one is used; None when the run has no checkpoint at all; a
    :class:`CheckpointError` when it has some but none is readable.
    """
    problems = []
    for checkpoint in reversed(complete_checkpoints(output_dir)):
        try:
            contents = read_checkpoint(checkpoint, for_resume=True)
        except CheckpointError as exc:
            problems.append(str(exc))
            logger.warning("cannot resume from %s: %s; trying the previous complete checkpoint", checkpoint, exc)
            continue
        if problems:
            logger.warning("resuming from %s, the newest checkpoint that reads back completely", checkpoint)
        return contents
    if problems:
        raise CheckpointError(f"no checkpoint of {output_dir} can be resumed: " + "; ".join(problems))
    return None


# ------------------------------------------------------------------------------------------------
# weights onto a model


def apply_trainable_weights(
    model, state: dict[str, torch.Tensor], checkpoint: Path, fresh: tuple[str, ...] = ()
) -> None:
    """Put a checkpoint's trainable weights and buffers on ``model``; every tensor must match by name and shape,
    but those of the modules named in ``fresh`` (name prefixes), which keep their start where the checkpoint has
    none (an encoder widened by ``refit-encoder``)."""
    expected = model.trainable_state_dict()
    missing = sorted(k for k in set(expected) - set(state) if not k.startswith(fresh))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{checkpoint / 'model.safetensors'}: does not fit this model: missing tensors {missing}, "
            f"unexpected tensors {unexpected}"
        )
    wrong = [
        f"{k} {tuple(state[k].shape)} (model {tuple(v.shape)})"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if wrong:
        raise CheckpointError(f"{checkpoint / 'model.safetensors'}: tensors of the wrong shape: {wrong}")
    model.load_state_dict(state, strict=False)


def load_trainable_weights(model, checkpoint: Path) -> None:
    """Load a checkpoint's trainable weights and buffers (verified against the recorded checksum if any)."""
    checkpoint = Path(checkpoint)
    state = read_trainer_state(checkpoint) if (checkpoint / TRAINER_STATE).is_file() else {}
    apply_trainable_weights(model, read_model_state(checkpoint, state), checkpoint)


#: The modules a latent override adds to a trained model (``refit-encoder``'s widened encoder), by the field that
#: adds them: their weights are not in the checkpoint, and they keep their start (the trained encoder's view).
WIDENED_MODULES = {"encoder_view": "encoder_pool.", "encoder_block": "encoder_block."}


def load_trained(
    checkpoint: str | Path,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    device: Any = "cpu",
    latent_overrides: dict[str, Any] | None = None,
):
    """Rebuild a trained CVAE from a checkpoint, run or export directory: ``(model, tokenizer, config,
    trainer_state)``. An export refuses a base decoder whose weights do not hash to its record
    (``export.verify_base_model``).

    ``latent_overrides`` (``refit-encoder --encoder-view/--encoder-block``): fields of the latent config replaced
    before the model is built; the modules they add (the encoder's attention pool, its block) keep their start,
    the identity of the view the run was trained with, and the returned config is the one with the overrides.

    The decoder is loaded (on the CPU) in the dtype its config resolves to for ``device``, where the caller
    will run it: ``dtype: auto`` is bf16 on CUDA whatever the CPU supports, as in training.

    The decoder is loaded with the user's model cache (``ModelConfig.model_cache_dir`` of the stored
    config is ignored): a command that reads a checkpoint writes nothing outside the run directory and
    the user's own cache directory, whatever the checkpoint's config says.
    """
    import dataclasses

    from .models import build_cvae

    checkpoint_dir, _ = resolve_run(checkpoint)
    contents = read_checkpoint(checkpoint_dir)
    config = contents.config
    if config.model.model_cache_dir is not None:
        logger.info(
            "ignoring the checkpoint's model_cache_dir %r: using the user's cache", config.model.model_cache_dir
        )
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, model_cache_dir=None),
        train=dataclasses.replace(config.train, feature_cache_dir=None),
        latent=dataclasses.replace(config.latent, **(latent_overrides or {})),
    )
    if model_and_tokenizer is None:
        from .lm import load_model_and_tokenizer, resolve_dtype

        decoder, tokenizer = load_model_and_tokenizer(
            config.model, device="cpu", dtype=resolve_dtype(config.model, device)
        )
    else:
        decoder, tokenizer = model_and_tokenizer
    from .export import has_export_marker, verify_base_model

    if has_export_marker(checkpoint_dir):  # the base model's weights must be the ones the export was trained on
        verify_base_model(checkpoint_dir, decoder)
    model = build_cvae(config, decoder)
    fresh = tuple(prefix for field, prefix in WIDENED_MODULES.items() if field in (latent_overrides or {}))
    apply_trainable_weights(model, contents.model_state, checkpoint_dir, fresh)
    model.zfree_reference_scale = float(contents.trainer_state["zfree_reference_scale"])
    model.eval()
    return model, tokenizer, config, contents.trainer_state
