"""The feature store's files on disk, without torch: where the store is (:func:`store_dir`), its size limit
(:func:`store_limit_bytes`), least-recently-used eviction (:func:`evict`), listing and clearing
(``disentangle cache list|clear``). Building and reading entries is :mod:`feature_store`'s."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_DIR = "DISENTANGLEMENT_FEATURE_CACHE"
ENV_MAX_GB = "DISENTANGLEMENT_FEATURE_CACHE_MAX_GB"
DEFAULT_DIR = "~/.cache/disentanglement/features"
DEFAULT_MAX_GB = 20.0
SUFFIX = ".safetensors"


def store_dir(configured: str | Path | None = None) -> Path:
    """The store's root: ``configured``, else ``$DISENTANGLEMENT_FEATURE_CACHE``, else the user's cache."""
    return Path(configured or os.environ.get(ENV_DIR) or DEFAULT_DIR).expanduser()


def store_limit_bytes(configured_gb: float | None = None) -> int:
    """The size limit in bytes: ``configured_gb``, else ``$DISENTANGLEMENT_FEATURE_CACHE_MAX_GB``, else 20 GB."""
    if configured_gb is None:
        text = os.environ.get(ENV_MAX_GB)
        try:
            configured_gb = float(text) if text else DEFAULT_MAX_GB
        except ValueError:
            raise ValueError(f"${ENV_MAX_GB} must be a number of gigabytes, got {text!r}") from None
    if not configured_gb > 0:
        raise ValueError(f"the feature cache's size limit must be > 0 GB, got {configured_gb}")
    return int(configured_gb * 1e9)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if needed) inside the block; waits for other holders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------- size, eviction, listing


def entries(root: Path) -> list[tuple[float, int, Path]]:
    """Every entry under ``root``: (last use, bytes, path)."""
    out = []
    if not root.is_dir():
        return out
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        for sub in folder.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    with contextlib.suppress(OSError):
                        info = entry.stat()
                        out.append((info.st_mtime, info.st_size, Path(entry.path)))
    return out


def evict(root: str | Path, max_bytes: int) -> int:
    """Delete the least recently used entries until the store holds at most ``max_bytes``; how many went."""
    root = Path(root)
    with locked(root / ".lock"):
        found = entries(root)
        total = sum(size for _, size, _ in found)
        removed = 0
        for _, size, path in sorted(found, key=lambda e: (e[0], str(e[2]))):
            if total <= max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            total -= size
            removed += 1
    if removed:
        logger.info("feature cache: evicted %d least recently used entries (limit %.3g GB)", removed, max_bytes / 1e9)
    return removed


@dataclass
class StoreSummary:
    key: str
    about: dict
    entries: int
    bytes: int
    last_used: float


def summarize(root: str | Path) -> list[StoreSummary]:
    """One summary per reference under ``root``, most recently used first."""
    root = Path(root)
    per: dict[str, StoreSummary] = {}
    for mtime, size, path in entries(root):
        key = path.parent.parent.name
        if key not in per:
            about_path = root / key / "about.json"
            try:
                about = json.loads(about_path.read_text())
            except (OSError, ValueError):
                about = {}
            per[key] = StoreSummary(key, about, 0, 0, 0.0)
        summary = per[key]
        summary.entries += 1
        summary.bytes += size
        summary.last_used = max(summary.last_used, mtime)
    return sorted(per.values(), key=lambda s: -s.last_used)


def clear(root: str | Path) -> tuple[int, int]:
    """Delete every entry (and reference folder) under ``root``: (entries, bytes) removed."""
    root = Path(root)
    found = entries(root)
    with locked(root / ".lock"):
        for folder in root.iterdir():
            if folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
    return len(found), sum(size for _, size, _ in found)


def human_size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def add_cache_arguments(parser) -> None:
    """The arguments of ``disentangle cache list|clear [--dir DIR]`` (``cli.SUBCOMMANDS``)."""
    parser.add_argument("action", choices=("list", "clear"), help="list: one line per model; clear: delete all")
    parser.add_argument("--dir", default=None, help="the cache folder (default: see above)")
    parser.set_defaults(func=run_cache)


def run_cache(args) -> int:
    root = store_dir(args.dir)
    if args.action == "clear":
        if not root.exists():
            print(f"feature cache {root}: empty (no such folder)")
            return 0
        count, size = clear(root)
        print(f"feature cache {root}: removed {count} entries ({human_size(size)})")
        return 0
    summaries = summarize(root)
    total = sum(s.bytes for s in summaries)
    print(f"feature cache {root}: {sum(s.entries for s in summaries)} entries, {human_size(total)}")
    for s in summaries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.last_used))
        model = s.about.get("model", "?")
        dtype = s.about.get("dtype", "?")
        print(f"  {s.key[:16]}  {s.entries:>7} entries  {human_size(s.bytes):>9}  last used {used}  {model} ({dtype})")
    return 0
