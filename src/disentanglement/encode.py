"""Reading ``z`` off data, and decoding under a latent read off (``disentangle encode``).

    disentangle encode CHECKPOINT --data validation|train|chatterbot|FILE.jsonl --output latents.jsonl
        [--max-examples N] [--batch-size B] [--seed S] [--iw-samples k] [--prior-samples S] [--exact-limit L]

One row per example of ``--data``, in data order (the order :func:`runs.load_examples` gives:
the split's or the file's order, a ``--max-examples`` subset keeping it); the keys of a row and the two
formats are those of the latent file (:mod:`latent_file`).

The scores are those of ``eval``, example by example: the examples are batched in the same length
order, and the same seeded prior samples (continuous, or discrete beyond ``--exact-limit``
combinations) and importance samples are drawn, so with the same ``--data``, ``--max-examples``,
``--seed``, ``--batch-size``, ``--iw-samples``, ``--prior-samples`` and ``--exact-limit`` the rows
aggregate to the eval report's numbers (to float rounding). Deterministic given ``--seed``.

Output: ``.jsonl`` or ``.parquet`` (:func:`latent_file.write_rows`), written to a temporary file and
renamed. Every option, ``--data`` and ``--output`` are checked before the model loads.

Python API (a notebook)::

    from disentanglement.trainer import load_trained
    from disentanglement.encode import encode_pairs, decode_from_latent

    model, tokenizer, config, _ = load_trained("runs/x/checkpoints/step-001000")
    rows = encode_pairs(model, tokenizer, config, [("Hi there", "Hello! How can I help?")])
    rows[0]["codes"]                      # discrete: the code per slot (continuous: rows[0]["mu"])
    decode_from_latent(model, tokenizer, config, "Hi there", rows[0])     # generate under that latent
    decode_from_latent(model, tokenizer, config, "Hi there", [2])         # or under forced codes

:func:`encode_pairs` encodes raw pairs (tokenised as in training) into rows of this schema;
:func:`decode_from_latent` generates a response to a prompt under a given latent: a row of this file
(its ``codes`` or ``mu``), codes per slot, or a latent vector. Reading a file back, attribute vectors and
a code's typical rows: :mod:`latent_file`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import runs
from .config import DEFAULT_SCORING, Scoring
from .latent_file import check_output, write_rows
from .options import EncodeOptions, check_at_least, with_overrides

if TYPE_CHECKING:  # torch and the models load when a command runs, not for --help
    import torch

    from .config import RunConfig
    from .cvae_base import CVAEBase, FrozenFeatures
    from .data import Example, PromptResponse
    from .evaluation import BatchScores
    from .features import FeatureCache
    from .generation import SamplingOptions
    from .latent_space import LatentSpace


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
    """One row per example, in order (keys in :mod:`latent_file`).

    ``cache`` holds the frozen-pass features of ``examples`` (same indexing, as for
    ``evaluation.evaluate``; None: the frozen pass is run here, on the model's device); ``pairs`` the raw pairs the examples were tokenised from (same order), for
    the ``prompt`` and ``response`` texts (None without them). Each batch is scored by
    ``evaluation.score_batch`` in ``evaluate``'s order and random stream, so the numbers are ``evaluate``'s
    per example. Deterministic given ``seed``; the caller's random state and the model's mode are kept.
    """
    import torch
    from tqdm.auto import tqdm

    from .data import collate, length_order
    from .evaluation import score_batch
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
    space = model.latent_space  # the family's fields of a row
    device = next(model.parameters()).device
    E = len(examples)
    # evaluate's order: the same batches, so the same prior and importance samples
    order = length_order(examples)
    scores: list[dict[str, Any] | None] = [None] * E
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        for start in tqdm(range(0, E, batch_size), desc="encode", disable=not progress, unit="batch"):
            chunk = order[start : start + batch_size]
            batch = collate([examples[i] for i in chunk], pad_token_id, indices=chunk).to(device)
            features = cache.features(batch)
            scored = score_batch(model, batch, features, scoring)
            for index, row_scores in zip(chunk, _batch_row_scores(space, features, scored), strict=True):
                scores[index] = row_scores
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


def _batch_row_scores(space: LatentSpace, features: FrozenFeatures, scored: BatchScores) -> list[dict[str, Any]]:
    """The scores of a batch scored by ``evaluation.score_batch``, one dict per example in batch order:
    ``response_tokens``, ``kl``, ``latent_gain_nats_per_token``, ``iw_nll`` and the latent ``space``'s fields."""
    from .metrics import importance_weighted_nll

    counts = scored.target.sum(-1).cpu().numpy()
    gains = (scored.prior_nll.double().sum(-1) - scored.posterior_nll.double().sum(-1)).cpu().numpy()
    kl = scored.summary.kl_per_unit.double().sum(-1).cpu().numpy()
    iw = importance_weighted_nll(scored.iw_log_weights).double().cpu().numpy()
    latent = space.row_fields(features, scored.summary)
    if scored.decoder_codes is not None:  # the exact mixture's: the decoder's own likeliest code per slot
        latent["decoder_codes"] = scored.decoder_codes.cpu().tolist()
    out = []
    for row in range(len(counts)):
        n = int(counts[row])
        out.append(
            {
                "response_tokens": n,
                "kl": float(kl[row]),
                "latent_gain_nats_per_token": float(gains[row]) / n,
                "iw_nll": float(iw[row]),
                **{key: values[row] for key, values in latent.items()},
            }
        )
    return out


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


# --------------------------------------------------------------------------- the command


def encode_to_file(checkpoint: str | Path, options: EncodeOptions, model_and_tokenizer=None) -> tuple[Path, int]:
    # options first (their numbers are checked as they are made), before the model loads
    scoring = options.scoring()
    check_output(options.output)
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
    path, _ = encode_to_file(checkpoint, with_overrides(EncodeOptions, options, overrides), model_and_tokenizer)
    return path


# --------------------------------------------------------------------------- steering


def latent_vector(model: CVAEBase, latent: Any) -> torch.Tensor:
    """The decoder's latent vector ``[L]`` of ``latent``: a row of :func:`encode_examples` (its ``codes``,
    or its ``mu``), codes per slot (discrete: ``M`` integers), or a latent vector of ``L`` numbers
    (discrete: ``M * code_dim`` numbers, e.g. a mix of the entries the decoder reads, the codebook's or the
    ``code_table``'s; continuous: ``z``)."""
    import torch

    space = model.latent_space
    device = next(model.parameters()).device
    if isinstance(latent, Mapping):
        key = space.latent_key
        if key not in latent:
            raise ValueError(f"a {space.kind} latent row needs the key {key!r}")
        latent = latent[key]
    values = latent.detach().cpu() if isinstance(latent, torch.Tensor) else torch.as_tensor(latent)
    values = values.flatten()
    L = model.latent_vector_dim
    forced = space.forced_vector(values)
    if forced is not None:
        return forced
    if len(values) != L:
        raise ValueError(f"the latent has {len(values)} entries; expected {space.expected_entries()}")
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
