"""Reading ``z`` off data, and decoding under a latent read off (``disentangle encode``).

    disentangle encode CHECKPOINT --data validation|train|chatterbot|FILE.jsonl --output latents.jsonl
        [--max-examples N] [--batch-size B] [--seed S] [--iw-samples k] [--prior-samples S] [--exact-limit L]

One row per example of ``--data``, in data order (the order :func:`commands.load_examples` gives:
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

:func:`decode_from_latent` generates a response to a prompt under a given latent: a row of this file
(its ``codes`` or ``mu``), codes per slot, or a latent vector.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import commands

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
    cache: FeatureCache,
    pad_token_id: int,
    *,
    pairs: Sequence[PromptResponse] | None = None,
    iw_samples: int = 8,
    prior_samples: int = 16,
    exact_limit: int = 64,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per example, in order (keys in the module docstring).

    ``cache`` holds the frozen-pass features of ``examples`` (same indexing, as for
    ``evaluation.evaluate``); ``pairs`` the raw pairs the examples were tokenised from (same order), for
    the ``prompt`` and ``response`` texts (None without them). Each batch is scored by
    ``evaluation.score_batch`` in ``evaluate``'s order and random stream, so the numbers are ``evaluate``'s
    per example. Deterministic given ``seed``; the caller's random state and the model's mode are kept.
    """
    import torch
    from tqdm.auto import tqdm

    from .data import collate
    from .evaluation import score_batch
    from .metrics import importance_weighted_nll
    from .shared_discrete_cvae import SharedDiscreteCVAE

    if not examples:
        raise ValueError("encode needs at least one example")
    if len(cache) != len(examples):
        raise ValueError(f"the feature cache holds {len(cache)} examples, but {len(examples)} were given")
    if pairs is not None and len(pairs) != len(examples):
        raise ValueError(f"{len(pairs)} pairs were given for {len(examples)} examples")
    for flag, value in (("iw_samples", iw_samples), ("prior_samples", prior_samples), ("batch_size", batch_size)):
        commands._check_at_least(flag, value, 1)
    commands._check_at_least("exact_limit", exact_limit, 0)
    discrete = isinstance(model, SharedDiscreteCVAE)
    device = next(model.parameters()).device
    E = len(examples)
    # evaluate's order: the same batches, so the same prior and importance samples
    order = sorted(range(E), key=lambda i: len(examples[i].prompt_ids) + len(examples[i].response_ids))
    scores: list[dict[str, Any] | None] = [None] * E
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            for start in tqdm(range(0, E, batch_size), desc="encode", disable=not progress, unit="batch"):
                chunk = order[start : start + batch_size]
                batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
                features = cache.features(batch)
                s = score_batch(model, batch, features, iw_samples, prior_samples, exact_limit)
                counts = s.target.sum(-1).cpu().numpy()
                gains = (s.prior_nll.double().sum(-1) - s.posterior_nll.double().sum(-1)).cpu().numpy()
                kl = s.summary.kl_per_unit.double().sum(-1).cpu().numpy()
                iw = importance_weighted_nll(s.iw_log_weights).double().cpu().numpy()
                summary = s.summary
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
    finally:
        model.train(was_training)
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
    """The raw pairs of ``examples`` as :func:`commands.load_examples` loaded them from ``data``, in order.

    An example keeps only token ids; its pair is found again by its ``source`` (``FILE:LINE``, or the
    corpus id), which names one pair of the data. A ``ValueError`` if a source names no pair, several
    pairs, or a pair with another label (the data changed between the two reads).
    """
    from .data import load_pairs

    data = data or "validation"
    data_cfg = config.data if data in commands.SPLITS else dataclasses.replace(config.data, data=data)
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
    commands.check_writable_target(path, "--output")
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

    path = _check_output(output)
    if path.suffix.lower() == ".parquet":
        data = _parquet_bytes(rows)
    else:
        data = "".join(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file_durably(path, data)
    return path


def _encode_to_file(
    checkpoint: str | Path,
    *,
    data: str | None,
    output: str | Path,
    max_examples: int | None,
    iw_samples: int,
    prior_samples: int,
    exact_limit: int,
    seed: int,
    batch_size: int,
    device: str,
    progress: bool,
    model_and_tokenizer,
) -> tuple[Path, int]:
    # options first, before the model loads
    for flag, value in (("--iw-samples", iw_samples), ("--prior-samples", prior_samples), ("--batch-size", batch_size)):
        commands._check_at_least(flag, value, 1)
    commands._check_at_least("--exact-limit", exact_limit, 0)
    commands._check_at_least("--max-examples", max_examples, 1, optional=True)
    _check_output(output)
    commands.check_data_option(checkpoint, data)

    from .features import build_feature_cache

    model, tokenizer, config, _, _, _ = commands.load_checkpoint(checkpoint, model_and_tokenizer, device)
    examples, _ = commands.load_examples(data, config, tokenizer, max_examples, seed)
    pairs = raw_pairs(data, config, examples)
    model_device = next(model.parameters()).device
    cache = build_feature_cache(
        model, examples, tokenizer.pad_token_id, batch_size, model_device, progress, description="frozen pass"
    )
    rows = encode_examples(
        model,
        examples,
        cache,
        tokenizer.pad_token_id,
        pairs=pairs,
        iw_samples=iw_samples,
        prior_samples=prior_samples,
        exact_limit=exact_limit,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
    return write_rows(rows, output), len(rows)


def run_encode(
    checkpoint: str | Path,
    *,
    data: str | None = None,
    output: str | Path,
    max_examples: int | None = None,
    iw_samples: int = 8,
    prior_samples: int = 16,
    exact_limit: int = 64,
    seed: int = 0,
    batch_size: int = 16,
    device: str = "auto",
    progress: bool = True,
    model_and_tokenizer=None,
) -> Path:
    """Encode ``data`` (as ``eval``'s ``--data``) with a checkpoint; write one row per example to ``output``
    (``.jsonl``, or ``.parquet`` with pyarrow). Options, ``data`` and ``output`` are checked before the
    model loads. Returns the path written."""
    path, _ = _encode_to_file(
        checkpoint,
        data=data,
        output=output,
        max_examples=max_examples,
        iw_samples=iw_samples,
        prior_samples=prior_samples,
        exact_limit=exact_limit,
        seed=seed,
        batch_size=batch_size,
        device=device,
        progress=progress,
        model_and_tokenizer=model_and_tokenizer,
    )
    return path


# --------------------------------------------------------------------------- steering


def latent_vector(model: CVAEBase, latent: Any) -> torch.Tensor:
    """The decoder's latent vector ``[L]`` of ``latent``: a row of :func:`encode_examples` (its ``codes``,
    or its ``mu``), codes per slot (discrete: ``M`` integers), or a latent vector of ``L`` numbers
    (discrete: ``M * code_dim`` numbers, e.g. a mix of codebook entries; continuous: ``z``)."""
    import torch

    from .shared_discrete_cvae import SharedDiscreteCVAE

    discrete = isinstance(model, SharedDiscreteCVAE)
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


# --------------------------------------------------------------------------- command line


def add_encode_subcommand(subparsers) -> None:
    """Register ``encode`` on the ``disentangle`` parser."""
    parser = subparsers.add_parser(
        "encode",
        help="read z off data: one row per example (codes or mu, posterior, prior, KL, latent gain)",
        description="Encode every example of --data with a checkpoint and write one row per example, in data "
        "order, to a .jsonl (or .parquet, with pyarrow) file: source, prompt, response, label, the posterior and "
        "prior latents, the per-example KL and latent gain (the numbers eval aggregates, for the same options).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    commands._add_common(parser)
    parser.add_argument("--data", default="validation", help="validation, train, chatterbot or a .jsonl file")
    parser.add_argument("--output", required=True, help="where to write the rows: FILE.jsonl or FILE.parquet")
    parser.add_argument("--max-examples", type=int, help="encode at most this many examples (seeded subset)")
    parser.add_argument(
        "--iw-samples", type=int, default=8, help="posterior samples of the per-example IW bound (as eval's)"
    )
    parser.add_argument(
        "--prior-samples", type=int, default=16, help="prior samples (continuous, or too many code combinations)"
    )
    parser.add_argument(
        "--exact-limit", type=int, default=64, help="enumerate the discrete prior exactly up to this many combinations"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="examples per forward pass")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    parser.set_defaults(func=_encode_main)


def _encode_main(args: argparse.Namespace) -> int:
    path, count = _encode_to_file(
        args.checkpoint,
        data=args.data,
        output=args.output,
        max_examples=args.max_examples,
        iw_samples=args.iw_samples,
        prior_samples=args.prior_samples,
        exact_limit=args.exact_limit,
        seed=args.seed,
        batch_size=args.batch_size,
        device=args.device,
        progress=args.progress,
        model_and_tokenizer=None,
    )
    print(f"wrote {count} rows to {path}")
    return 0
