"""The latent file of ``disentangle encode``: its rows, its two formats, reading and writing it, and what is
read off it (a row's latent, attribute vectors, a code's typical examples).

One row per encoded example (:func:`encode.encode_examples`). Keys of every row:

- ``source`` (``FILE:LINE`` or the corpus id), ``prompt``, ``response`` (the raw texts, before any
  chat template or truncation), ``label`` (as loaded: a string, an object of named factors, or null);
- ``response_tokens``: the number of response tokens scored (after truncation);
- ``kl``: ``KL(q(z | x, y) || p(z | x))`` of the example in nats, summed over slots or dimensions
  (the per-example KL whose mean is the eval report's ``kl.total``);
- ``latent_gain_nats_per_token``: ``(sum_t r_t - sum_t l_t) / response_tokens``, the prior-mixture NLL
  minus the posterior-latent NLL of this example (see ``evaluation.py``); the mean over rows weighted
  by ``response_tokens`` is the report's ``latent_gain_nats_per_token``;
- ``iw_nll``: the importance-weighted bound on ``-log p(y | x)`` of the example in nats (the mean over
  rows is the report's ``iw_nll.nats_per_example``);
- discrete: ``codes`` (argmax code per slot, the latent the decoder is scored under), ``posterior`` (per
  slot the ``K`` probabilities ``softmax_k(-||e_m - E_k||^2 / temperature)``; with the default "nearest"
  assignment the effective posterior is one-hot at ``codes``, these say how clear the choice was),
  ``prior_codes`` and ``prior`` (argmax and probabilities of ``p(k | x)`` per slot; the fixed prior is
  uniform and its argmax code 0); where the prior mixture is exact over the codes (``K^M`` up to
  ``--exact-limit``), ``decoder_codes``: per slot the code the decoder finds likeliest,
  ``argmax_k p(k | x) p(y | x, k)`` (the marginal per slot; eval's ``decoder_posterior``);
- continuous: ``mu``, ``logvar`` (the posterior), ``prior_mu``, ``prior_logvar`` (the prior's; zeros
  for the fixed standard-normal prior).

Formats: ``.jsonl`` (one JSON object a line) or ``.parquet`` (needs ``pyarrow``; ``label`` is a string
column for string labels, a struct column for objects of factors, JSON text if they mix), written to a
temporary file and renamed (:func:`write_rows`).

Python API (a notebook)::

    from disentanglement.latent_file import read_latents, attribute_vector, code_examples

    file = read_latents("latents.jsonl")  # the rows of ``disentangle encode``, checked when used
    polite, _ = attribute_vector(model, file, "style=polite")  # mean(mu | label) - mean(mu), continuous
    code_examples(model, file, slot=0, code=2, count=5)         # discrete: code 2's most typical rows

:func:`read_latents` reads an encode file back (JSONL or Parquet); :func:`row_latent` takes one row's
latent, checked against the checkpoint (family, slots or dimensions, code range), :func:`attribute_vector`
an attribute direction and :func:`code_examples` a code's most typical rows (the ones with the highest
posterior probability of that code among those assigned to it).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import runs
from .latent_space import LATENT_SPACES, ContinuousLatentSpace, DiscreteLatentSpace
from .options import check_at_least

if TYPE_CHECKING:  # torch and the models load when a command runs, not for --help
    import torch

    from .cvae_base import CVAEBase

#: Keys of every row, then those of each latent family, in the order they are written.
COMMON_KEYS = (
    "source",
    "prompt",
    "response",
    "label",
    "response_tokens",
    "kl",
    "latent_gain_nats_per_token",
    "iw_nll",
)
DISCRETE_KEYS = DiscreteLatentSpace.row_keys
CONTINUOUS_KEYS = ContinuousLatentSpace.row_keys
FORMATS = (".jsonl", ".parquet")


def check_output(output: str | Path) -> Path:
    """The output path, or a ``ValueError`` (before anything loads)."""
    if output is None or str(output) == "":
        raise ValueError("--output is required (a .jsonl or .parquet path)")
    path = Path(output)
    runs.check_writable_target(path, "--output")
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"--output {path} must end in .jsonl or .parquet")
    if suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError(
                f"--output {path}: writing Parquet needs pyarrow, which is not installed here; install it "
                "(pip install pyarrow) or write .jsonl"
            ) from None
    return path


def _parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):  # labels that mix strings and objects
        labelled = [dict(row, label=None if row["label"] is None else json.dumps(row["label"])) for row in rows]
        table = pa.Table.from_pylist(labelled)
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def write_rows(rows: list[dict[str, Any]], output: str | Path) -> Path:
    """Write ``rows`` as JSON lines or Parquet (by the suffix), to a temporary file then renamed."""
    from .checkpoints import replace_file_durably
    from .safe_io import first_nonfinite, json_text

    path = check_output(output)
    bad = next((found for found in map(first_nonfinite, rows) if found), None)
    if bad:  # Parquet would store NaN silently; JSON cannot hold it: refused for both
        raise ValueError(f"{path}: not written: {bad} (a non-finite result: the model or the data produced NaN)")
    if path.suffix.lower() == ".parquet":
        data = _parquet_bytes(rows)
    else:
        data = "".join(json_text(row, path, ensure_ascii=False) + "\n" for row in rows).encode()
    replace_file_durably(path, data)
    return path


@dataclasses.dataclass
class LatentRows:
    """The rows of an encode file (:func:`read_latents`), with the file they came from (for messages)."""

    path: str
    rows: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.rows)


def _decode_mixed_labels(rows: list[dict[str, Any]]) -> None:
    """Parquet keeps labels that mix strings and objects as JSON text (:func:`_parquet_bytes`): decode them
    when any label of the column is such an object, in place. Struct labels lose their missing factors."""
    texts = [r.get("label") for r in rows if isinstance(r.get("label"), str)]

    def parsed(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text

    if texts and any(isinstance(parsed(t), dict) for t in texts if t[:1] == "{"):
        for r in rows:
            if isinstance(r.get("label"), str):
                r["label"] = parsed(r["label"])
    for r in rows:
        if isinstance(r.get("label"), dict):
            r["label"] = {k: v for k, v in r["label"].items() if v is not None}


def read_latents(path: str | Path) -> LatentRows:
    """Read the rows of a ``disentangle encode`` file (``.jsonl`` or ``.parquet``).

    A ``FileNotFoundError`` for a missing file, a ``ValueError`` naming the file (and line) for another
    suffix, a line that is not a JSON object, or no rows. The rows are checked against a model only where
    they are used (:func:`row_latent`, :func:`attribute_vector`, :func:`code_examples`).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--latents {path}: no such file (write one with disentangle encode)")
    if path.is_dir():
        raise ValueError(f"--latents {path} is a directory; expected the .jsonl or .parquet file of disentangle encode")
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"--latents {path} must end in .jsonl or .parquet (a file written by disentangle encode)")
    rows: list[dict[str, Any]] = []
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"--latents {path}: reading Parquet needs pyarrow, which is not installed here") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises its own error types for a damaged file
            raise ValueError(f"--latents {path}: not a readable Parquet file ({exc})") from None
        _decode_mixed_labels(rows)
    else:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise ValueError(f"--latents {path}:{number}: not a JSON line") from None
                if not isinstance(row, dict):
                    raise ValueError(f"--latents {path}:{number}: a row must be a JSON object")
                rows.append(row)
    if not rows:
        raise ValueError(f"--latents {path} holds no rows")
    return LatentRows(str(path), rows)


def as_latent_rows(latents: LatentRows | str | Path | Sequence[Mapping[str, Any]]) -> LatentRows:
    """``latents`` as :class:`LatentRows`: an encode file's path is read (:func:`read_latents`), rows are
    copied; a ``ValueError`` for no rows."""
    if isinstance(latents, LatentRows):
        return latents
    if isinstance(latents, str | Path):
        return read_latents(latents)
    rows = [dict(r) for r in latents]
    if not rows:
        raise ValueError("the latent rows are empty")
    return LatentRows("<rows>", rows)


def _row_value(model: CVAEBase, file: LatentRows, index: int) -> list:
    """Row ``index``'s ``codes`` (discrete: ``M`` integers in ``[0, K)``) or ``mu`` (continuous: ``D`` finite
    numbers), checked against the model; a ``ValueError`` naming the file, row and field otherwise."""
    space = model.latent_space
    row = file.rows[index]
    key = space.latent_key
    where = f"--latents {file.path} row {index}"
    if key not in row or row[key] is None:
        other = next((s for s in LATENT_SPACES if s.latent_key != key and s.latent_key in row), None)
        if other is not None:
            raise ValueError(
                f"{where} has {other.latent_key!r}, not {key!r}: it is an encode file of a {other.kind} model, and "
                f"this checkpoint is {space.kind}; encode the data with this checkpoint"
            )
        raise ValueError(f"{where} has no {key!r} field: not a row of disentangle encode")
    value = row[key]
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}: {key!r} must be a list, got {value!r}")
    return space.parse_row_latent(value, where)


def row_latent(model: CVAEBase, latents: LatentRows | str | Path | Sequence[Mapping[str, Any]], index: int) -> list:
    """The latent of row ``index`` of an encode file: its ``codes`` (discrete) or ``mu`` (continuous), checked
    against the model (family, number of slots or dimensions, code range) with errors naming the file,
    the row and the field."""
    file = as_latent_rows(latents)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(file):
        raise ValueError(f"--row {index!r} is outside [0, {len(file)}) for --latents {file.path} ({len(file)} rows)")
    return _row_value(model, file, index)


def parse_attribute(spec: str) -> tuple[str, float]:
    """``"LABEL:SCALE"`` -> ``(LABEL, SCALE)``, split at the last colon (a label may hold colons); LABEL is
    ``value`` or ``factor=value``. A ``ValueError`` naming the flag otherwise."""
    label, sep, scale = str(spec).rpartition(":")
    if not sep or not label:
        raise ValueError(f"--attribute {spec!r} must be LABEL:SCALE (e.g. polite:2 or style=polite:-1.5)")
    try:
        value = float(scale)
    except ValueError:
        raise ValueError(f"--attribute {spec!r}: the scale {scale!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"--attribute {spec!r}: the scale must be finite")
    return label, value


def _row_factors(file: LatentRows) -> list[dict[str, str] | None]:
    from .data import label_factors

    out = []
    for row in file.rows:
        label = row.get("label")
        out.append(None if label is None else {k: str(v) for k, v in (label_factors(label) or {}).items()})
    return out


def available_labels(latents: LatentRows | str | Path | Sequence[Mapping[str, Any]]) -> list[str]:
    """Every label an attribute can name in this file: ``value`` for string labels, ``factor=value`` for
    objects of factors, sorted."""
    from .data import SINGLE_FACTOR

    found = {(name, value) for f in _row_factors(as_latent_rows(latents)) if f for name, value in f.items()}
    return sorted(value if name == SINGLE_FACTOR else f"{name}={value}" for name, value in found)


def resolve_label(latents: LatentRows | str | Path | Sequence[Mapping[str, Any]], label: str) -> tuple[str, str]:
    """``(factor, value)`` named by ``label`` in this file: ``factor=value``, or a plain ``value`` found in one
    factor only. A ``ValueError`` listing the available labels when it names none, or several factors."""
    file = as_latent_rows(latents)
    factors = _row_factors(file)
    names = {name for f in factors if f for name in f}
    if not names:
        raise ValueError(f"--latents {file.path} has no labels; an attribute needs an encode file of labelled data")
    pairs = {(name, value) for f in factors if f for name, value in f.items()}
    shown = ", ".join(available_labels(file))
    factor, sep, value = label.partition("=")
    if sep and factor in names:
        if (factor, value) not in pairs:
            raise ValueError(f"--attribute: no row of {file.path} has {label!r}; available labels: {shown}")
        return factor, value
    matches = sorted(name for name, v in pairs if v == label)
    if not matches:
        raise ValueError(f"--attribute: no row of {file.path} has the label {label!r}; available labels: {shown}")
    if len(matches) > 1:
        options = ", ".join(f"{name}={label}" for name in matches)
        raise ValueError(f"--attribute {label!r} is a value of several factors in {file.path}; name one: {options}")
    return matches[0], label


def attribute_vector(
    model: CVAEBase, latents: LatentRows | str | Path | Sequence[Mapping[str, Any]], label: str
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The attribute direction ``mean(mu | label) - mean(mu)`` of a continuous model's encode file, ``[D]``
    (the model's dtype and device), and its description ``{label, factor, value, rows, total_rows}``.

    ``mean(mu)`` is over every row of the file (labelled or not), ``mean(mu | label)`` over the rows whose
    label has that factor value (see :func:`resolve_label`); every row's ``mu`` is checked. Computed in
    float64. Example: ``z = prior_mu + 2.0 * attribute_vector(model, rows, "polite")[0]``.
    """
    import torch

    model.latent_space.require("attribute")
    file = as_latent_rows(latents)
    factor, value = resolve_label(file, label)
    mu = torch.tensor([_row_value(model, file, i) for i in range(len(file))], dtype=torch.float64)  # [E, D]
    chosen = torch.tensor([bool(f) and f.get(factor) == value for f in _row_factors(file)])  # [E]
    vector = mu[chosen].mean(0) - mu.mean(0)  # [D]
    device = next(model.parameters()).device
    description = {"label": label, "factor": factor, "value": value, "rows": int(chosen.sum()), "total_rows": len(file)}
    return vector.to(device=device, dtype=model.latent_projection.weight.dtype), description


def code_examples(
    model: CVAEBase,
    latents: LatentRows | str | Path | Sequence[Mapping[str, Any]],
    slot: int,
    code: int,
    count: int,
) -> dict[str, Any]:
    """What code ``code`` of slot ``slot`` means: the ``count`` rows assigned to it (``codes[slot] == code``)
    with the highest posterior probability ``posterior[slot][code]``, ties in file order.

    Returns ``{slot, code, rows_with_code, share, examples}``; each example ``{row, source, prompt, response,
    label, probability}``. Every row's codes are checked against the model.
    """
    space = model.latent_space
    space.require("code examples")
    file = as_latent_rows(latents)
    if not 0 <= slot < model.num_slots or not 0 <= code < model.codebook_size:
        raise ValueError(f"slot {slot} / code {code} is outside [0, {model.num_slots}) x [0, {model.codebook_size})")
    check_at_least("--code-examples", count, 1)
    assigned = []
    for i in range(len(file.rows)):
        if _row_value(model, file, i)[slot] != code:
            continue
        probability = space.row_posterior(file, i)[slot][code]
        assigned.append((probability, i))
    assigned.sort(key=lambda t: (-t[0], t[1]))
    examples = [
        {
            "row": i,
            "source": file.rows[i].get("source"),
            "prompt": file.rows[i].get("prompt"),
            "response": file.rows[i].get("response"),
            "label": file.rows[i].get("label"),
            "probability": probability,
        }
        for probability, i in assigned[:count]
    ]
    return {
        "slot": slot,
        "code": code,
        "rows_with_code": len(assigned),
        "share": len(assigned) / len(file),
        "examples": examples,
    }
