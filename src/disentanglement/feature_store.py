"""The shared frozen-pass store: one frozen pass per (reference weights, example), ever.

The frozen pass (:mod:`features`) depends on the z-free reference's weights and on each example's
token ids, not on the run: so its outputs are stored per example, keyed by a hash of both, in one folder
that every run, seed, sweep cell, ``eval``, ``encode`` and ``inspect`` shares. A second run on the same
data (another seed, split, subset or output directory) reads what is there and runs the pass only over
the examples it has not seen. See ``docs/feature-cache.md``.

Layout (``ROOT`` = ``TrainConfig.feature_cache_dir``, else ``$DISENTANGLEMENT_FEATURE_CACHE``, else
``~/.cache/disentanglement/features``)::

    ROOT/.lock                       eviction lock
    ROOT/<reference key>/about.json  which model the entries belong to (for ``disentangle cache list``)
    ROOT/<reference key>/.lock       writers' lock: one process runs the pass, the others wait, then read
    ROOT/<reference key>/<ab>/<example key>.safetensors   one example's outputs (float32, no pickle)

The reference key hashes the pass version, the encoder view and the weights (names, shapes, dtypes,
bytes: :func:`features.reference_hasher`); the example key hashes the reference key and the example's
prompt and response ids. An entry holds ``response_nll [r]``, ``prior [H]``, ``encoder [2H]`` and, when
the pass computed them, ``response_entropy [r]`` (entropy token weighting) and ``response_hidden [r, H]``
(attention encoder view). Every entry is checked when read (its key, dtypes, shapes, finite values): a
bad one is recomputed with a warning, never used. Entries are written to a temporary file and renamed.
The store is kept under a size limit (``TrainConfig.feature_cache_max_gb``, else
``$DISENTANGLEMENT_FEATURE_CACHE_MAX_GB``, else 20 GB) by deleting the least recently used entries
(an entry's modification time is its last use).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from .cvae_base import ATTENTION_VIEWS, CVAEBase
from .data import Example
from .distributed import gather_objects, is_main, rank_and_size
from .feature_store_files import SUFFIX, evict, locked, store_dir, store_limit_bytes
from .features import FEATURE_PASS_VERSION, FeatureCache, build_feature_cache, reference_hasher
from .safe_io import atomic_write

logger = logging.getLogger(__name__)


# One example's outputs: (response NLL [r], entropy [r] or None, hidden [r, H] or None, prior [H], encoder [2H]).
Row = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]


def reference_key(model: CVAEBase) -> str:
    """The hash of the pass version, the encoder view and the reference's weights (computed once per model)."""
    return reference_hasher(model).hexdigest()


def example_key(ref_key: str, example: Example) -> str:
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    digest.update(ref_key.encode())
    digest.update(json.dumps([example.prompt_ids, example.response_ids]).encode())
    return digest.hexdigest()


def _entry_path(folder: Path, key: str) -> Path:
    return folder / key[:2] / f"{key}{SUFFIX}"


class _BadEntry(ValueError):
    pass


def _check(tensor: torch.Tensor | None, name: str, shape: tuple[int, ...]) -> None:
    if tensor is None:
        raise _BadEntry(f"{name} is missing")
    if tensor.dtype != torch.float32:
        raise _BadEntry(f"{name} is {tensor.dtype}, expected torch.float32")
    if tuple(tensor.shape) != shape:
        raise _BadEntry(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    if not bool(torch.isfinite(tensor).all()):
        raise _BadEntry(f"{name} holds non-finite values")


def read_entry(path: Path, key: str, response_length: int) -> Row | None:
    """The entry at ``path`` (None if absent), checked: its key, float32 dtypes, shapes and finite values.
    A bad entry raises :class:`ValueError` naming what is wrong."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            if (handle.metadata() or {}).get("key") != key:
                raise _BadEntry("it was written for another key")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except FileNotFoundError:
        return None
    except _BadEntry:
        raise
    except Exception as exc:  # safetensors' own errors for a truncated or foreign file
        raise _BadEntry(f"{type(exc).__name__}: {exc}") from exc
    prior = tensors.get("prior")
    if prior is None or prior.dim() != 1:
        raise _BadEntry("prior is missing or not a vector")
    hidden_size = prior.shape[0]
    _check(prior, "prior", (hidden_size,))
    _check(tensors.get("encoder"), "encoder", (2 * hidden_size,))
    _check(tensors.get("response_nll"), "response_nll", (response_length,))
    entropy, hidden = tensors.get("response_entropy"), tensors.get("response_hidden")
    if entropy is not None:
        _check(entropy, "response_entropy", (response_length,))
    if hidden is not None:
        _check(hidden, "response_hidden", (response_length, hidden_size))
    return tensors["response_nll"], entropy, hidden, prior, tensors["encoder"]


def write_entry(path: Path, key: str, row: Row) -> None:
    """Write one entry atomically (:func:`safe_io.atomic_write`: a temporary file in the same folder, then a
    rename; not fsynced: an entry lost to a power cut is computed again)."""
    nll, entropy, hidden, prior, encoder = row
    tensors = {"response_nll": nll.contiguous(), "prior": prior.contiguous(), "encoder": encoder.contiguous()}
    if entropy is not None:
        tensors["response_entropy"] = entropy.contiguous()
    if hidden is not None:
        tensors["response_hidden"] = hidden.contiguous()
    atomic_write(path, save(tensors, metadata={"key": key, "version": FEATURE_PASS_VERSION}), durable=False)


def _rows_of(cache: FeatureCache) -> list[Row]:
    """The per-example rows of a built cache."""
    hidden = None
    if cache.response_hidden is not None:
        hidden = list(torch.split(cache.response_hidden, [len(n) for n in cache.response_nll]))
    return [
        (
            cache.response_nll[i],
            cache.response_entropy[i] if cache.response_entropy is not None else None,
            hidden[i] if hidden is not None else None,
            cache.prior_features[i],
            cache.encoder_features[i],
        )
        for i in range(len(cache))
    ]


def _assemble(rows: Sequence[Row], entropy: bool, hidden: bool) -> FeatureCache:
    return FeatureCache(
        [r[0] for r in rows],
        torch.stack([r[3] for r in rows]),
        torch.stack([r[4] for r in rows]),
        [r[1] for r in rows] if entropy else None,
        torch.cat([r[2] for r in rows]) if hidden else None,
    )


@dataclass
class StoreStats:
    """What the last :func:`load_or_build_features` did (for logs, tests and benchmarks)."""

    hits: int = 0
    computed: int = 0
    recomputed_bad: int = 0
    evicted: int = 0


last_stats = StoreStats()


@dataclass
class _Lookup:
    """One call's view of the store: the examples, their keys and the rows found or computed so far."""

    model: CVAEBase
    examples: Sequence[Example]
    pad_token_id: int
    folder: Path
    keys: list[str]
    needs_entropy: bool
    needs_hidden: bool
    stats: StoreStats
    rows: list[Row | None] = field(default_factory=list)
    bad: set[int] = field(default_factory=set)

    def read(self, indices: Sequence[int]) -> list[int]:
        """Fill ``rows`` from the store; the indices still missing."""
        missing = []
        for i in indices:
            path = _entry_path(self.folder, self.keys[i])
            try:
                row = read_entry(path, self.keys[i], len(self.examples[i].response_ids))
            except ValueError as exc:
                if i not in self.bad:  # said once, though it is read again under the lock
                    logger.warning("feature cache: entry %s is bad (%s); recomputing it", path, exc)
                    self.bad.add(i)
                row = None
            if row is None or (self.needs_entropy and row[1] is None) or (self.needs_hidden and row[2] is None):
                missing.append(i)
                continue
            entropy, hidden = row[1] if self.needs_entropy else None, row[2] if self.needs_hidden else None
            self.rows[i] = (row[0], entropy, hidden, row[3], row[4])
        return missing

    def compute(self, missing: list[int], batch_size: int, device, progress: bool, state) -> None:
        built = build_feature_cache(
            self.model,
            [self.examples[i] for i in missing],
            self.pad_token_id,
            batch_size,
            device,
            progress,
            description=f"frozen pass ({len(missing)} of {len(self.examples)} examples)",
            state=state,
        )
        for i, row in zip(missing, _rows_of(built), strict=True):
            self.rows[i] = row
        self.stats.computed += len(missing)

    def store(self, missing: list[int]) -> None:
        try:
            _write_about(self.folder, self.model)
            for i in {self.keys[i]: i for i in missing}.values():  # copies of an example share one entry
                write_entry(_entry_path(self.folder, self.keys[i]), self.keys[i], self.rows[i])
        except OSError as exc:  # the store only saves time: the run goes on without it
            logger.warning("feature cache: could not write to %s (%s); continuing without it", self.folder, exc)


def load_or_build_features(
    model: CVAEBase,
    examples: Sequence[Example],
    pad_token_id: int,
    root: str | Path | None = None,
    batch_size: int = 16,
    device: torch.device | str | None = None,
    progress: bool = True,
    state=None,
    max_bytes: int | None = None,
) -> FeatureCache:
    """The frozen-pass features of ``examples`` from the store at ``root`` (:func:`store_dir` of it), the
    pass run only over the examples it lacks, whose outputs are then stored.

    Readers take no lock. A process with entries to compute takes the reference's lock, looks again (another
    process may have written them meanwhile), computes what is still missing, writes it, and lets go: so two
    runs starting together do the pass once. With several processes (``state``) the main one decides what is
    missing, all share the pass (:func:`features.build_feature_cache`), and the main one writes.
    An example's cached entropy or hidden states are used only when this model's pass makes them (so the
    result equals a fresh pass's); an entry without what this model needs is recomputed and replaced. Copies of
    an example share one entry and one row (:func:`features.build_feature_cache`), so the features are the same,
    bit for bit, whether this call computed or read them.
    """
    global last_stats
    root = store_dir(root)
    max_bytes = store_limit_bytes() if max_bytes is None else max_bytes
    ref_key = reference_key(model)
    lookup = _Lookup(
        model,
        examples,
        pad_token_id,
        root / ref_key,
        [example_key(ref_key, e) for e in examples],
        needs_entropy=model.reconstruction_cfg.token_weight_source == "entropy",
        needs_hidden=model.latent_cfg.encoder_view in ATTENTION_VIEWS,
        stats=StoreStats(),
        rows=[None] * len(examples),
    )
    pass_args = (batch_size, device, progress, state)
    if rank_and_size(state)[1] == 1:
        _fill_one_process(lookup, pass_args)
    else:
        _fill_several_processes(lookup, pass_args, state)
    stats = lookup.stats
    stats.hits = len(examples) - stats.computed
    stats.recomputed_bad = len(lookup.bad)
    if is_main(state):
        _touch([_entry_path(lookup.folder, key) for key in lookup.keys])
        if stats.computed:
            try:
                stats.evicted = evict(root, max_bytes)
            except OSError as exc:
                logger.warning("feature cache: could not evict from %s (%s)", root, exc)
    logger.info(
        "frozen pass: %d of %d examples from the feature cache %s, %d computed",
        stats.hits,
        len(examples),
        lookup.folder,
        stats.computed,
    )
    last_stats = stats
    return _assemble(lookup.rows, lookup.needs_entropy, lookup.needs_hidden)


def _fill_one_process(lookup: _Lookup, pass_args: tuple) -> None:
    """Read what the store has; under the reference's lock, read again, compute the rest and store it."""
    missing = lookup.read(range(len(lookup.examples)))
    if not missing:
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(locked(lookup.folder / ".lock"))
        except OSError as exc:  # the store only saves time: a folder that cannot be written is passed by
            logger.warning("feature cache: cannot lock %s (%s); computing without the store", lookup.folder, exc)
            lookup.compute(missing, *pass_args)
            return
        missing = lookup.read(missing)  # what another process wrote while this one waited
        if missing:
            lookup.compute(missing, *pass_args)
            lookup.store(missing)


def _fill_several_processes(lookup: _Lookup, pass_args: tuple, state) -> None:
    """The main process reads and decides; every process shares the pass; the main one writes, and sends
    what it read to the others."""
    main = is_main(state)
    with locked(lookup.folder / ".lock") if main else contextlib.nullcontext():
        missing = lookup.read(range(len(lookup.examples))) if main else []
        missing = gather_objects(state, missing if main else None)[0]
        if missing:
            lookup.compute(missing, *pass_args)
        if main:
            lookup.store(missing)
        skip = set(missing)
        present = {i: lookup.rows[i] for i in range(len(lookup.examples)) if i not in skip} if main else {}
        for i, row in gather_objects(state, present)[0].items():
            lookup.rows[i] = row


def _touch(paths: Sequence[Path]) -> None:
    """Mark entries as used now (their modification time orders the eviction)."""
    now = time.time()
    for path in paths:
        with contextlib.suppress(OSError):
            os.utime(path, (now, now))


def _write_about(folder: Path, model: CVAEBase) -> None:
    about = folder / "about.json"
    if about.is_file():
        return
    with model.reference.active() as reference:
        config = getattr(reference, "config", None)
        name = getattr(config, "_name_or_path", "") or type(reference).__name__
        dtype = str(next(reference.parameters()).dtype).removeprefix("torch.")
    text = json.dumps({"model": name, "dtype": dtype, "encoder_view": model.encoder_view_params or "default"})
    atomic_write(about, text + "\n", durable=False)
