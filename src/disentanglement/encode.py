"""Reading ``z`` off data, and decoding under a latent read off (``disentangle encode``).

    disentangle encode CHECKPOINT --data validation|train|chatterbot|FILE.jsonl --output latents.jsonl
        [--max-examples N] [--batch-size B] [--seed S] [--iw-samples k] [--prior-samples S] [--exact-limit L]

One row per example of ``--data``, in data order (the order :func:`runs.load_examples` gives:
the split's or the file's order, a ``--max-examples`` subset keeping it). Keys of every row:

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
  uniform and its argmax code 0);
- continuous: ``mu``, ``logvar`` (the posterior), ``prior_mu``, ``prior_logvar`` (the prior's; zeros
  for the fixed standard-normal prior).

The scores are those of ``eval``, example by example: the examples are batched in the same length
order, and the same seeded prior samples (continuous, or discrete beyond ``--exact-limit``
combinations) and importance samples are drawn, so with the same ``--data``, ``--max-examples``,
``--seed``, ``--batch-size``, ``--iw-samples``, ``--prior-samples`` and ``--exact-limit`` the rows
aggregate to the eval report's numbers (to float rounding). Deterministic given ``--seed``.

Output: ``.jsonl`` (one JSON object a line) or ``.parquet`` (needs ``pyarrow``; ``label`` is a string
column for string labels, a struct column for objects of factors, JSON text if they mix), written to a
temporary file and renamed. Every option, ``--data`` and ``--output`` are checked before the model loads.

Python API (a notebook)::

    from disentanglement.trainer import load_trained
    from disentanglement.encode import encode_pairs, decode_from_latent, read_latents, attribute_vector

    model, tokenizer, config, _ = load_trained("runs/x/checkpoints/step-001000")
    rows = encode_pairs(model, tokenizer, config, [("Hi there", "Hello! How can I help?")])
    rows[0]["codes"]                      # discrete: the code per slot (continuous: rows[0]["mu"])
    decode_from_latent(model, tokenizer, config, "Hi there", rows[0])     # generate under that latent
    decode_from_latent(model, tokenizer, config, "Hi there", [2])         # or under forced codes
    file = read_latents("latents.jsonl")  # the rows of ``disentangle encode``, checked when used
    polite, _ = attribute_vector(model, file, "style=polite")  # mean(mu | label) - mean(mu), continuous

:func:`encode_pairs` encodes raw pairs (tokenised as in training) into rows of this schema;
:func:`decode_from_latent` generates a response to a prompt under a given latent: a row of this file
(its ``codes`` or ``mu``), codes per slot, or a latent vector. :func:`read_latents` reads an encode file
back (JSONL or Parquet); :func:`row_latent` takes one row's latent, checked against the checkpoint
(family, slots or dimensions, code range), :func:`attribute_vector` an attribute direction and
:func:`code_examples` a code's most typical rows (the ones with the highest posterior probability of
that code among those assigned to it).
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
from .config import DEFAULT_SCORING, Scoring
from .options import EncodeOptions, check_at_least, with_overrides

if TYPE_CHECKING:  # torch and the models load when a command runs, not for --help
    import torch

    from .config import RunConfig
    from .cvae_base import CVAEBase
    from .data import Example, PromptResponse
    from .features import FeatureCache
    from .generation import SamplingOptions

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
DISCRETE_KEYS = ("codes", "posterior", "prior_codes", "prior")
CONTINUOUS_KEYS = ("mu", "logvar", "prior_mu", "prior_logvar")
FORMATS = (".jsonl", ".parquet")


# --------------------------------------------------------------------------- rows


def encode_examples(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache | None,
    pad_token_id: int,
    *,
    pairs: Sequence[PromptResponse] | None = None,
    scoring: Scoring = DEFAULT_SCORING,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per example, in order (keys in the module docstring).

    ``cache`` holds the frozen-pass features of ``examples`` (same indexing, as for
    ``evaluation.evaluate``; None: the frozen pass is run here, on the model's device); ``pairs`` the raw pairs the examples were tokenised from (same order), for
    the ``prompt`` and ``response`` texts (None without them). Each batch is scored by
    ``evaluation.score_batch`` in ``evaluate``'s order and random stream, so the numbers are ``evaluate``'s
    per example. Deterministic given ``seed``; the caller's random state and the model's mode are kept.
    """
    import torch
    from tqdm.auto import tqdm

    from .data import collate
    from .evaluation import score_batch
    from .metrics import importance_weighted_nll
    from .reference import eval_mode

    if not examples:
        raise ValueError("encode needs at least one example")
    if cache is None:
        from .features import build_feature_cache

        cache = build_feature_cache(model, examples, pad_token_id, batch_size, progress=progress)
    if len(cache) != len(examples):
        raise ValueError(f"the feature cache holds {len(cache)} examples, but {len(examples)} were given")
    if pairs is not None and len(pairs) != len(examples):
        raise ValueError(f"{len(pairs)} pairs were given for {len(examples)} examples")
    check_at_least("batch_size", batch_size, 1)
    discrete = model.is_discrete
    device = next(model.parameters()).device
    E = len(examples)
    # evaluate's order: the same batches, so the same prior and importance samples
    order = sorted(range(E), key=lambda i: len(examples[i].prompt_ids) + len(examples[i].response_ids))
    scores: list[dict[str, Any] | None] = [None] * E
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        for start in tqdm(range(0, E, batch_size), desc="encode", disable=not progress, unit="batch"):
            chunk = order[start : start + batch_size]
            batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
            features = cache.features(batch)
            scored = score_batch(model, batch, features, scoring)
            counts = scored.target.sum(-1).cpu().numpy()
            gains = (scored.prior_nll.double().sum(-1) - scored.posterior_nll.double().sum(-1)).cpu().numpy()
            kl = scored.summary.kl_per_unit.double().sum(-1).cpu().numpy()
            iw = importance_weighted_nll(scored.iw_log_weights).double().cpu().numpy()
            summary = scored.summary
            if discrete:
                # as evaluation.posterior_latents: the softmax of the posterior logits
                probs = model.posterior_logits(model.encoder_outputs(features)).softmax(-1).float().cpu()
                latent = {
                    "codes": summary.codes.cpu().tolist(),
                    "posterior": probs.tolist(),
                    "prior_codes": summary.log_p.argmax(-1).cpu().tolist(),
                    "prior": summary.log_p.exp().float().cpu().tolist(),
                }
            else:
                latent = {
                    "mu": summary.mu.float().cpu().tolist(),
                    "logvar": summary.logvar.float().cpu().tolist(),
                    "prior_mu": summary.prior_mu.float().cpu().tolist(),
                    "prior_logvar": summary.prior_logvar.float().cpu().tolist(),
                }
            for row, index in enumerate(chunk):
                n = int(counts[row])
                scores[index] = {
                    "response_tokens": n,
                    "kl": float(kl[row]),
                    "latent_gain_nats_per_token": float(gains[row]) / n,
                    "iw_nll": float(iw[row]),
                    **{key: values[row] for key, values in latent.items()},
                }
    rows = []
    for index, example in enumerate(examples):
        pair = pairs[index] if pairs is not None else None
        rows.append(
            {
                "source": example.source,
                "prompt": pair.prompt if pair is not None else None,
                "response": pair.response if pair is not None else None,
                "label": example.label,
                **scores[index],  # type: ignore[dict-item]
            }
        )
    return rows


def raw_pairs(data: str | None, config: RunConfig, examples: Sequence[Example]) -> list[PromptResponse]:
    """The raw pairs of ``examples`` as :func:`runs.load_examples` loaded them from ``data``, in order.

    An example keeps only token ids; its pair is found again by its ``source`` (``FILE:LINE``, or the
    corpus id), which names one pair of the data. A ``ValueError`` if a source names no pair, several
    pairs, or a pair with another label (the data changed between the two reads).
    """
    from .data import load_pairs

    data = data or "validation"
    data_cfg = config.data if data in runs.SPLITS else dataclasses.replace(config.data, data=data)
    by_source: dict[str, PromptResponse] = {}
    repeated: set[str] = set()
    for pair in load_pairs(data_cfg):
        if pair.source in by_source:
            repeated.add(pair.source)
        by_source[pair.source] = pair
    out = []
    for example in examples:
        pair = by_source.get(example.source)
        if pair is None or example.source in repeated or pair.label != example.label:
            raise ValueError(f"{example.source}: cannot find this example's prompt and response in {data_cfg.data}")
        out.append(pair)
    return out


# --------------------------------------------------------------------------- files


def _check_output(output: str | Path) -> Path:
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

    path = _check_output(output)
    bad = next((found for found in map(first_nonfinite, rows) if found), None)
    if bad:  # Parquet would store NaN silently; JSON cannot hold it: refused for both
        raise ValueError(f"{path}: not written: {bad} (a non-finite result: the model or the data produced NaN)")
    if path.suffix.lower() == ".parquet":
        data = _parquet_bytes(rows)
    else:
        data = "".join(json_text(row, path, ensure_ascii=False) + "\n" for row in rows).encode()
    replace_file_durably(path, data)
    return path


def _encode_to_file(checkpoint: str | Path, options: EncodeOptions, model_and_tokenizer=None) -> tuple[Path, int]:
    # options first (their numbers are checked as they are made), before the model loads
    scoring = options.scoring()
    _check_output(options.output)
    runs.check_data_option(checkpoint, options.data)

    model, tokenizer, config, _, _, _ = runs.load_checkpoint(checkpoint, model_and_tokenizer, options.device)
    examples, _ = runs.load_examples(options.data, config, tokenizer, options.max_examples, options.seed)
    pairs = raw_pairs(options.data, config, examples)
    cache = runs.stored_features(model, examples, tokenizer.pad_token_id, options.batch_size, progress=options.progress)
    rows = encode_examples(
        model,
        examples,
        cache,
        tokenizer.pad_token_id,
        pairs=pairs,
        scoring=scoring,
        batch_size=options.batch_size,
        seed=options.seed,
        progress=options.progress,
    )
    return write_rows(rows, options.output), len(rows)


def run_encode(
    checkpoint: str | Path, options: EncodeOptions | None = None, *, model_and_tokenizer=None, **overrides: Any
) -> Path:
    """Encode ``data`` (as ``eval``'s ``--data``) with a checkpoint; write one row per example to ``output``
    (``.jsonl``, or ``.parquet`` with pyarrow). ``options`` (default :class:`options.EncodeOptions`) with the
    keyword ``overrides`` on top (``run_encode(ckpt, output="latents.jsonl", data="train")``). Options,
    ``data`` and ``output`` are checked before the model loads. Returns the path written."""
    path, _ = _encode_to_file(checkpoint, with_overrides(EncodeOptions, options, overrides), model_and_tokenizer)
    return path


# --------------------------------------------------------------------------- steering


def latent_vector(model: CVAEBase, latent: Any) -> torch.Tensor:
    """The decoder's latent vector ``[L]`` of ``latent``: a row of :func:`encode_examples` (its ``codes``,
    or its ``mu``), codes per slot (discrete: ``M`` integers), or a latent vector of ``L`` numbers
    (discrete: ``M * code_dim`` numbers, e.g. a mix of codebook entries; continuous: ``z``)."""
    import torch

    discrete = model.is_discrete
    device = next(model.parameters()).device
    if isinstance(latent, Mapping):
        key = "codes" if discrete else "mu"
        if key not in latent:
            raise ValueError(f"a {'discrete' if discrete else 'continuous'} latent row needs the key {key!r}")
        latent = latent[key]
    values = latent.detach().cpu() if isinstance(latent, torch.Tensor) else torch.as_tensor(latent)
    values = values.flatten()
    L = model.latent_vector_dim
    if discrete and not values.is_floating_point() and values.dtype != torch.bool and len(values) == model.num_slots:
        codes = values.long()
        if bool(((codes < 0) | (codes >= model.codebook_size)).any()):
            raise ValueError(f"codes {codes.tolist()} must lie in [0, {model.codebook_size})")
        return model.codes_to_vector(codes.unsqueeze(0).to(device))[0].detach()
    if len(values) != L:
        expected = f"{model.num_slots} integer codes or {L} numbers" if discrete else f"{L} numbers"
        raise ValueError(f"the latent has {len(values)} entries; expected {expected}")
    vector = values.double()
    if not bool(torch.isfinite(vector).all()):
        raise ValueError("the latent vector must be finite")
    return vector.to(device=device, dtype=model.latent_projection.weight.dtype)


def decode_from_latent(
    model: CVAEBase,
    tokenizer: Any,
    config: RunConfig,
    prompt: str,
    latent: Any,
    sampling: SamplingOptions | None = None,
) -> str:
    """The response to ``prompt`` generated under ``latent`` (see :func:`latent_vector`), new tokens only.

    A thin wrapper of ``generation.encode_prompts`` and ``generation.generate_texts`` (the prompt formatted
    and truncated as in training). Deterministic given ``sampling.seed``, the caller's random state kept;
    equal to ``generation.generate(..., mode="codes", codes=...)`` for the same codes and sampling.
    """
    import torch

    from .generation import SamplingOptions, encode_prompts, generate_texts

    sampling = sampling or SamplingOptions()
    vector = latent_vector(model, latent)
    prompt_ids = encode_prompts([prompt], tokenizer, config.data)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(sampling.seed)
        return generate_texts(model, tokenizer, prompt_ids, vector.unsqueeze(0), sampling)[0]


# --------------------------------------------------------------------------- reading encode files back


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


def _as_latent_rows(latents: LatentRows | str | Path | Sequence[Mapping[str, Any]]) -> LatentRows:
    if isinstance(latents, LatentRows):
        return latents
    if isinstance(latents, str | Path):
        return read_latents(latents)
    rows = [dict(r) for r in latents]
    if not rows:
        raise ValueError("the latent rows are empty")
    return LatentRows("<rows>", rows)


def _model_kind(model: CVAEBase) -> tuple[bool, str]:
    discrete = model.is_discrete
    return discrete, "discrete" if discrete else "continuous"


def _row_value(model: CVAEBase, file: LatentRows, index: int) -> list:
    """Row ``index``'s ``codes`` (discrete: ``M`` integers in ``[0, K)``) or ``mu`` (continuous: ``D`` finite
    numbers), checked against the model; a ``ValueError`` naming the file, row and field otherwise."""
    discrete, kind = _model_kind(model)
    row = file.rows[index]
    key, other = ("codes", "mu") if discrete else ("mu", "codes")
    where = f"--latents {file.path} row {index}"
    if key not in row or row[key] is None:
        if other in row:
            family = "continuous" if discrete else "discrete"
            raise ValueError(
                f"{where} has {other!r}, not {key!r}: it is an encode file of a {family} model, and this checkpoint "
                f"is {kind}; encode the data with this checkpoint"
            )
        raise ValueError(f"{where} has no {key!r} field: not a row of disentangle encode")
    value = row[key]
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}: {key!r} must be a list, got {value!r}")
    if discrete:
        M, K = model.num_slots, model.codebook_size
        if len(value) != M:
            raise ValueError(f"{where}: 'codes' has {len(value)} entries; this checkpoint has {M} slot(s)")
        for code in value:
            if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < K:
                raise ValueError(f"{where}: code {code!r} is not an integer in [0, {K}) (this checkpoint's codebook)")
        return [int(c) for c in value]
    D = model.latent_vector_dim
    if len(value) != D:
        raise ValueError(f"{where}: 'mu' has {len(value)} entries; this checkpoint's latent has {D} dimensions")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{where}: 'mu' holds {v!r}; expected finite numbers")
    return [float(v) for v in value]


def _row_posterior(model: CVAEBase, file: LatentRows, index: int) -> list[list[float]]:
    """Row ``index``'s ``posterior``: ``M`` lists of ``K`` probabilities (this checkpoint's slots and codebook);
    a ``ValueError`` naming the file, row and field otherwise (a posterior of another K is never read)."""
    M, K = model.num_slots, model.codebook_size
    posterior = file.rows[index].get("posterior")
    where = f"--latents {file.path} row {index}: 'posterior'"
    if not isinstance(posterior, list | tuple) or len(posterior) != M:
        got = f"{len(posterior)} entries" if isinstance(posterior, list | tuple) else repr(posterior)
        raise ValueError(f"{where} must be {M} list(s) of {K} probabilities (this checkpoint's slots), got {got}")
    for m, probs in enumerate(posterior):
        if not isinstance(probs, list | tuple) or len(probs) != K:
            got = f"{len(probs)} entries" if isinstance(probs, list | tuple) else repr(probs)
            raise ValueError(
                f"{where} of slot {m} must have {K} probabilities (this checkpoint's codebook size), got {got}: "
                "an encode file of another checkpoint?"
            )
        for p in probs:
            if isinstance(p, bool) or not isinstance(p, int | float) or not (math.isfinite(p) and 0 <= p <= 1):
                raise ValueError(f"{where} of slot {m} holds {p!r}; expected probabilities in [0, 1]")
    return [[float(p) for p in probs] for probs in posterior]


def row_latent(model: CVAEBase, latents: LatentRows | str | Path | Sequence[Mapping[str, Any]], index: int) -> list:
    """The latent of row ``index`` of an encode file: its ``codes`` (discrete) or ``mu`` (continuous), checked
    against the model (family, number of slots or dimensions, code range) with errors naming the file,
    the row and the field."""
    file = _as_latent_rows(latents)
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

    found = {(name, value) for f in _row_factors(_as_latent_rows(latents)) if f for name, value in f.items()}
    return sorted(value if name == SINGLE_FACTOR else f"{name}={value}" for name, value in found)


def resolve_label(latents: LatentRows | str | Path | Sequence[Mapping[str, Any]], label: str) -> tuple[str, str]:
    """``(factor, value)`` named by ``label`` in this file: ``factor=value``, or a plain ``value`` found in one
    factor only. A ``ValueError`` listing the available labels when it names none, or several factors."""
    file = _as_latent_rows(latents)
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

    discrete, _ = _model_kind(model)
    if discrete:
        raise ValueError("--attribute needs a continuous model (a discrete model is steered by forcing codes)")
    file = _as_latent_rows(latents)
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
    discrete, kind = _model_kind(model)
    if not discrete:
        raise ValueError("code examples need a discrete model")
    file = _as_latent_rows(latents)
    if not 0 <= slot < model.num_slots or not 0 <= code < model.codebook_size:
        raise ValueError(f"slot {slot} / code {code} is outside [0, {model.num_slots}) x [0, {model.codebook_size})")
    check_at_least("--code-examples", count, 1)
    assigned = []
    for i in range(len(file.rows)):
        if _row_value(model, file, i)[slot] != code:
            continue
        probability = _row_posterior(model, file, i)[slot][code]
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


def encode_pairs(
    model: CVAEBase,
    tokenizer: Any,
    config: RunConfig,
    pairs: Sequence[PromptResponse | Mapping[str, Any] | Sequence[Any]],
    *,
    scoring: Scoring = DEFAULT_SCORING,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Encode raw pairs into rows of the encode schema (module docstring), tokenised as in training.

    ``pairs``: :class:`data.PromptResponse` objects, ``(prompt, response)`` or ``(prompt, response, label)``
    tuples, or ``{"prompt", "response", "label"?}`` mappings; the rows' ``source`` is ``pair:I`` where the
    pair has none. Example::

        rows = encode_pairs(model, tokenizer, config, [("Where is my order?", "It ships tomorrow.")])
        rows[0]["codes"], rows[0]["posterior"]   # discrete; continuous: rows[0]["mu"], rows[0]["logvar"]
    """
    from .data import PromptResponse, tokenize_pairs

    normalised: list[PromptResponse] = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, PromptResponse):
            normalised.append(pair)
            continue
        if isinstance(pair, Mapping):
            prompt, response, label = pair.get("prompt"), pair.get("response"), pair.get("label")
            source = pair.get("source") or f"pair:{i}"
        elif isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) in (2, 3):
            prompt, response, label, source = pair[0], pair[1], pair[2] if len(pair) == 3 else None, f"pair:{i}"
        else:
            raise ValueError(f"pair {i}: expected (prompt, response[, label]) or a mapping, got {pair!r}")
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ValueError(f"pair {i}: the prompt and the response must be strings")
        normalised.append(PromptResponse(prompt, response, label, str(source)))
    if not normalised:
        raise ValueError("encode_pairs needs at least one pair")
    examples, _ = tokenize_pairs(normalised, tokenizer, config.data)
    return encode_examples(
        model,
        examples,
        None,
        tokenizer.pad_token_id,
        pairs=normalised,
        scoring=scoring,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
