"""Writes that never follow a symbolic link, and removals that never leave a run half removed.

Every file the tool writes goes through :func:`atomic_write` (or :func:`write_json`, :func:`open_append`
for logs held open): the bytes go to a new temporary file in the target's directory, created with
``O_EXCL`` (which never follows a link), are fsynced, and the temporary file is renamed over the
path. A rename replaces a symbolic link planted at the path with the new file; the link's target
is never opened. A directory written into under a root (the run directory) must be a real directory
below it: :func:`ensure_dir` refuses a symbolic link on the way with an :class:`UnsafePathError`
(a ``ValueError``: exit 2 on the command line). The root itself is the path the user gave and is
used as it is.

:func:`remove_all` removes a list of paths all or nothing as far as the run is concerned: each is
first renamed into one hidden folder of its parent (a rename cannot half succeed, and one that fails
puts the earlier ones back), then that folder is removed. A symbolic link is removed as a link,
never its target.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

#: The prefix of the folder :func:`remove_all` moves paths into before deleting them.
REMOVING_PREFIX = ".removing-"


class UnsafePathError(ValueError):
    """A directory to write into is a symbolic link (or not a directory): the message names it."""


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _components(directory: Path, root: Path | None) -> list[Path]:
    """``directory`` and its ancestors below ``root`` (``root`` excluded), outermost first."""
    if root is None:
        return [directory]
    try:
        relative = directory.relative_to(root)
    except ValueError:
        return [directory]
    out, current = [], root
    for part in relative.parts:
        current = current / part
        out.append(current)
    return out


def ensure_dir(directory: str | Path, root: str | Path | None = None) -> Path:
    """Create ``directory`` (and its parents) and check that every folder of it below ``root`` is a real
    directory, not a symbolic link; ``root`` itself (the run directory, or a path the user gave) is
    taken as it is. Without ``root`` (or outside it) the user named ``directory``, and it is used as it is."""
    directory = Path(directory)
    root_path = Path(root) if root is not None else None
    if root_path is not None:
        root_path.mkdir(parents=True, exist_ok=True)
        for component in _components(directory, root_path):
            _check_not_link(component, root_path)
            if not component.exists():
                component.mkdir(exist_ok=True)
                _check_not_link(component, root_path)
    else:
        if directory.exists() and not directory.is_dir():
            raise UnsafePathError(f"{directory} is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
    return directory


def _check_not_link(path: Path, root: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise UnsafePathError(
            f"{path} is a symbolic link; nothing is written through a link in {root}: remove the link "
            "(or write elsewhere with the command's output option)"
        )
    if not stat.S_ISDIR(mode):
        raise UnsafePathError(f"{path} is not a directory, so nothing can be written under it")


def _new_temporary(path: Path) -> tuple[int, Path]:
    """A new file ``.NAME.RANDOM.tmp`` beside ``path``, opened for writing: ``O_EXCL`` never follows a link
    (nor opens a file that exists), and the mode follows the umask as ``open()``'s would."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: could not create a temporary file for {path.name}")


def atomic_write(path: str | Path, data: bytes | str, root: str | Path | None = None, durable: bool = True) -> Path:
    """Write ``data`` (str: UTF-8) to ``path`` atomically, never through a symbolic link (see the module
    docstring); ``root``: the directory under which every folder must be real (:func:`ensure_dir`).
    With ``durable`` the file and its directory are fsynced. Returns ``path``."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    ensure_dir(path.parent, root)
    if path.is_dir() and not path.is_symlink():
        raise UnsafePathError(f"{path} is a directory; expected a file path")
    fd, tmp = _new_temporary(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)  # replaces a link at ``path`` itself, never its target
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def first_nonfinite(obj: Any, where: str = "") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return f"{where or 'the value'} is {obj}"
    if isinstance(obj, dict):
        for key, value in obj.items():
            found = first_nonfinite(value, f"{where}.{key}" if where else str(key))
            if found:
                return found
    if isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            found = first_nonfinite(value, f"{where}[{i}]")
            if found:
                return found
    return None


def json_text(obj: Any, path: str | Path, **dump_kwargs: Any) -> str:
    """``json.dumps(obj, allow_nan=False, **dump_kwargs)``; a non-finite number is a ``ValueError`` naming
    ``path`` and the key that holds it (never Python's bare "Out of range float values")."""
    try:
        return json.dumps(obj, allow_nan=False, **dump_kwargs)
    except ValueError as exc:
        found = first_nonfinite(obj)
        raise ValueError(
            f"{path}: not written: {found or exc}, which JSON cannot hold (a non-finite result: the model or "
            "the data produced NaN or infinity)"
        ) from exc


def write_json(path: str | Path, obj: Any, root: str | Path | None = None, **dump_kwargs: Any) -> Path:
    """:func:`atomic_write` of ``obj`` as JSON (a trailing newline); non-finite numbers refused (:func:`json_text`)."""
    return atomic_write(path, json_text(obj, path, **dump_kwargs) + "\n", root)


def open_append(path: str | Path, root: str | Path | None = None, mode: str = "a") -> IO[str]:
    """Open ``path`` for appending (``mode`` "a" or "a+"), creating it, never through a symbolic link: a
    link at ``path`` is an :class:`UnsafePathError` naming it."""
    path = Path(path)
    ensure_dir(path.parent, root)
    flags = os.O_CREAT | os.O_APPEND | (os.O_RDWR if "+" in mode else os.O_WRONLY) | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if path.is_symlink():
            raise UnsafePathError(f"{path} is a symbolic link; nothing is written through a link: remove it") from exc
        raise
    return os.fdopen(fd, mode)


def remove_path(path: Path) -> None:
    """Remove a file, a directory tree or a symbolic link (as a link: its target is untouched)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def remove_all(paths: Sequence[Path] | Iterable[Path]) -> None:
    """Remove ``paths`` (entries of one directory) all or nothing: each is renamed into one hidden
    ``.removing-*`` folder there first; a failed rename puts back those already moved and raises. Only
    then is the folder deleted (a deletion that fails leaves that folder alone, the run's names gone)."""
    paths = list(paths)
    if not paths:
        return
    parents = {p.parent for p in paths}
    if len(parents) != 1:
        raise ValueError(f"remove_all takes entries of one directory, got {sorted(map(str, parents))}")
    (parent,) = parents
    trash = Path(tempfile.mkdtemp(prefix=REMOVING_PREFIX, dir=parent))
    moved: list[tuple[Path, Path]] = []
    try:
        for path in paths:
            if not os.path.lexists(path):
                continue
            target = trash / path.name
            os.rename(path, target)  # a link is renamed as a link
            moved.append((path, target))
    except BaseException:  # a failed rename, or an interrupt midway: put back what was moved
        for original, target in reversed(moved):
            with contextlib.suppress(OSError):  # keep the first error; a name not put back stays in the trash
                os.rename(target, original)
        with contextlib.suppress(OSError):
            trash.rmdir()  # only when everything went back
        raise
    fsync_dir(parent)
    shutil.rmtree(trash)  # never follows the links inside
