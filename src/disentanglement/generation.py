"""Generation from a trained CVAE with a chosen latent (``disentangle generate``).

The decoder generates from ``inputs_embeds`` laid out as in training: ``[z][x]`` (``prefix``) or
``[x][z]`` (``between``), the response following. Batched prompts are LEFT-padded (pad
embeddings first, attention mask 0 there), so that every row's last position is its last
prompt (or latent) position; transformers derives position ids from the attention mask. With the
``memory`` placement the decoder sees ``[x]`` alone and the latent as ``P`` key/value memory slots of
every layer (:func:`memory_generate`, a KV-cached loop: the memory is the first ``P`` entries of the
cache at every step, the attention mask has ``P`` leading ones, and the position ids are the
sequence's own, continuing from its length as in training, not from ``P`` + its length). The
prompt text is :func:`data.prompt_text_for_generation` (the chat template when the run used one),
tokenised and truncated exactly as in training. Only the new tokens are decoded, up to the first
end-of-sequence token.

Latent choices (``mode``):

- ``codes`` (discrete, default): every code of one slot (``slot``), the other slots fixed at
  ``codes`` where given and at the prompt's prior mode ``argmax_k p(k | x)`` elsewhere; or every
  combination of the unforced slots (``all_combinations``, at most ``max_combinations``); or exactly
  the forced codes when ``codes`` fixes every slot and no ``slot`` is named.
- ``prior``: ``num_samples`` latents drawn from ``p(z | x)`` (one response each).
- ``posterior``: the posterior of ``(prompt, reference_response)`` (argmax codes / posterior mean).
- ``interpolate`` (continuous): ``steps`` points on the line between the posterior means of two
  reference responses.

Latents read off data (``latents``: an encode file of ``disentangle encode``, or its rows):

- ``row`` ``I``: the latent of row ``I``. Discrete: its ``codes`` are the forced codes of ``codes`` mode
  (so ``slot`` still sweeps one slot around them); continuous (mode ``row``): its ``mu``.
- ``attribute`` (continuous): ``attributes`` ``["LABEL:SCALE", ...]``; the latent is the base (the row's
  ``mu`` with ``row``, else the prompt's prior mean) plus ``sum SCALE * (mean(mu | LABEL) - mean(mu))``
  over the file's rows (:func:`latent_file.attribute_vector`); the base itself is generated first, for
  comparison (``latent_description["base_only"]`` true).
- ``traverse`` (continuous): dimension ``traverse`` of the base (with any attributes added) set to
  ``base[dim] + offset`` for ``steps`` offsets evenly spaced over ``traverse_range`` (``-3:3``, ends
  included; :func:`traversal_offsets`); each generation's description has ``offset`` and ``value``.
- ``code_examples`` ``N`` (discrete): for every code the generations use, per slot, the ``N`` rows of the
  file most typical of it (assigned to it, highest posterior probability; :func:`latent_file.code_examples`),
  in ``result["code_examples"]``.

Unless ``mode`` is given it is ``traverse`` with ``traverse``, ``attribute`` with ``attributes``, ``row``
with a continuous ``row``, else ``codes`` (discrete) or ``prior`` (continuous).

Diversity: distinct-1 and distinct-2 (whitespace tokens) over the responses to each prompt, across
latents and samples, and their mean over prompts.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from . import latent_file
from .config import DataConfig, RunConfig
from .cvae_base import CVAEBase, FrozenFeatures, PosteriorSummary
from .data import PromptResponse, collate, prompt_text_for_generation, tokenize_pairs
from .memory import memory_attention_mask, positions_from_mask
from .metrics import distinct_n
from .reference import eval_mode, reference_hidden_states
from .shared_discrete_cvae import SharedDiscreteCVAE

logger = logging.getLogger(__name__)
MODES = ("codes", "prior", "posterior", "interpolate", "row", "attribute", "traverse")
#: Continuous modes whose base latent is a row's mu or the prompt's prior mean.
STEERING_MODES = ("row", "attribute", "traverse")


@dataclass
class SamplingOptions:
    """Decoding options, passed to transformers' ``generate``."""

    greedy: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def generate_kwargs(self) -> dict[str, Any]:
        if self.greedy:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": 0,
            "max_new_tokens": self.max_new_tokens,
        }


# --------------------------------------------------------------------------- prompts and latents


def encode_prompts(prompts: Sequence[str], tokenizer: Any, data_cfg: DataConfig) -> list[list[int]]:
    """Prompt token ids as in training: formatted, tokenised without special tokens, last tokens kept."""
    if not prompts:
        raise ValueError("at least one prompt is needed")
    texts = [prompt_text_for_generation(p, tokenizer, data_cfg) for p in prompts]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out = []
    for prompt, ids in zip(prompts, encoded, strict=True):
        ids = list(ids)[-data_cfg.max_prompt_tokens :]
        if not ids:
            raise ValueError(f"the prompt {prompt!r} tokenises to zero tokens")
        out.append(ids)
    return out


def _device(model: CVAEBase) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def prompt_features(model: CVAEBase, prompt_ids: Sequence[list[int]], pad_token_id: int) -> FrozenFeatures:
    """The prior's features of prompts alone: the reference's hidden state (``hidden_states[encoder_layer]``,
    the last layer by default) at the last prompt token.

    The model is causal, so this equals the training features of ``[x][y]`` at that position. Only
    ``prior_features`` is filled (``[B, H]``); the other fields are empty.
    """
    device = _device(model)
    lengths = torch.tensor([len(ids) for ids in prompt_ids], device=device)
    ids = torch.full((len(prompt_ids), int(lengths.max())), pad_token_id, dtype=torch.long, device=device)
    for row, seq in enumerate(prompt_ids):
        ids[row, : len(seq)] = torch.tensor(seq, device=device)
    attention = (torch.arange(ids.shape[1], device=device).unsqueeze(0) < lengths.unsqueeze(1)).long()
    with model.reference.active() as reference:
        hidden_states = reference_hidden_states(reference, ids, attention)
    hidden = hidden_states[model.latent_cfg.encoder_layer].float()  # the prior's layer, as in training
    prior = hidden[torch.arange(len(prompt_ids), device=device), lengths - 1]  # [B, H]
    empty = prior.new_zeros(len(prompt_ids), 0)
    return FrozenFeatures(zfree_token_nll=empty, prior_features=prior, encoder_features=empty)


@torch.no_grad()
def reference_posterior(
    model: CVAEBase, tokenizer: Any, data_cfg: DataConfig, prompt: str, response: str
) -> PosteriorSummary:
    """The posterior of one ``(prompt, response)`` pair, tokenised as in training."""
    examples, _ = tokenize_pairs([PromptResponse(prompt, response, None, "reference response")], tokenizer, data_cfg)
    batch = collate(examples, tokenizer.pad_token_id).to(_device(model))
    return model.posterior_summary(model.frozen_pass(batch))


def generation_inputs(
    model: CVAEBase, prompt_ids: Sequence[list[int]], vectors: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``inputs_embeds [R, W, H]`` and ``attention_mask [R, W]`` for ``[z][x]`` or ``[x][z]``
    (``[x]`` alone for the memory placement, whose latent goes to the cache).

    ``prompt_ids`` has one entry per row, ``vectors`` is ``[R, L]``.
    """
    device = _device(model)
    embed = model.decoder.get_input_embeddings()
    latent = model.latent_embeddings(vectors.to(device))  # [R, P, H]
    placement = model.latent_cfg.latent_placement
    rows = []
    for row, ids in enumerate(prompt_ids):
        tokens = embed(torch.tensor(ids, device=device))  # [Tx, H]
        z = latent[row].to(tokens.dtype)
        if placement == "memory":
            rows.append(tokens)
        else:
            rows.append(torch.cat([z, tokens]) if placement == "prefix" else torch.cat([tokens, z]))
    width = max(r.shape[0] for r in rows)
    pad = embed(torch.tensor([pad_token_id], device=device))[0]  # [H]
    embeds = pad.expand(len(rows), width, -1).clone()
    attention = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        embeds[i, width - r.shape[0] :] = r
        attention[i, width - r.shape[0] :] = 1
    return embeds, attention


def _eos_ids(model: CVAEBase, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model.decoder, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))
    return ids


@torch.no_grad()
def generate_texts(
    model: CVAEBase,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    vectors: torch.Tensor,
    sampling: SamplingOptions,
    batch_size: int = 16,
    progress: bool = False,
) -> list[str]:
    """One response per row (``prompt_ids[r]`` under latent ``vectors[r]``), new tokens only; with ``progress``
    a progress bar (stderr) counts the responses.

    Uses the global torch generator for sampling (the caller seeds it).
    """
    from tqdm.auto import tqdm

    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    texts: list[str] = []
    bar = tqdm(total=len(prompt_ids), desc="generate", unit="response", disable=not progress)
    with eval_mode(model), bar:
        for start in range(0, len(prompt_ids), batch_size):
            chunk = list(prompt_ids[start : start + batch_size])
            chunk_vectors = vectors[start : start + batch_size]
            embeds, attention = generation_inputs(model, chunk, chunk_vectors, pad)
            if model.latent_memory is not None:
                out = memory_generate(model, embeds, attention, chunk_vectors, sampling, eos, pad)
            else:
                out = model.decoder.generate(
                    inputs_embeds=embeds,
                    attention_mask=attention,
                    pad_token_id=pad,
                    eos_token_id=sorted(eos) or None,
                    **sampling.generate_kwargs(),
                )
            for row in out.tolist():
                cut = next((i for i, t in enumerate(row) if t in eos), len(row))
                texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
            bar.update(len(chunk))
    return texts


@torch.no_grad()
def memory_generate(
    model: CVAEBase,
    embeds: torch.Tensor,
    attention: torch.Tensor,
    vectors: torch.Tensor,
    sampling: SamplingOptions,
    eos: set[int],
    pad: int,
    use_cache: bool = True,
) -> torch.Tensor:
    """New token ids ``[R, S]`` (``S <= max_new_tokens``; ``pad`` after a row's end-of-sequence token) under
    the memory placement, from the left-padded prompts ``embeds [R, W, H]``, ``attention [R, W]`` and the
    latents ``vectors [R, L]``.

    With ``use_cache`` the memory cache (``P`` slots per layer) is built once and the decoder's own keys
    and values are appended to it: the first step runs the prompt, each later step the last token alone,
    with ``P`` leading ones on the mask and position ids continuing from the sequence's length. Without it
    every step recomputes the whole sequence under a fresh memory cache (the plain version, for tests).
    Sampling as ``generate`` does it for :class:`SamplingOptions` (temperature, then top-p; no top-k).
    """
    decoder = model.decoder
    embed = decoder.get_input_embeddings()
    latent = model.latent_embeddings(vectors.to(embeds.device))  # [R, P, H]
    P = model.num_latent_tokens
    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature), TopPLogitsWarper(sampling.top_p)])
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=embeds.device)
    unfinished = torch.ones(embeds.shape[0], dtype=torch.bool, device=embeds.device)
    inputs, mask, cache = embeds, attention, None
    tokens: list[torch.Tensor] = []
    for _ in range(sampling.max_new_tokens):
        positions = positions_from_mask(mask)  # [R, W + s], the sequence's own positions
        if cache is None:
            extra = model.memory_inputs(latent, mask, positions, inputs.dtype)
            cache = extra["cache"]
            step_inputs = inputs
        else:  # the cache holds the memory and every earlier position: feed the last token only
            extra = {
                "cache": cache,
                "attention_mask": memory_attention_mask(mask, P),
                "position_ids": positions[:, -1:],
            }
            step_inputs = inputs[:, -1:]
        logits = decoder(inputs_embeds=step_inputs, use_cache=True, logits_to_keep=1, **extra).logits[:, -1].float()
        if not use_cache:
            cache = None
        if sampling.greedy:
            next_tokens = logits.argmax(-1)
        else:
            probs = torch.softmax(warpers(None, logits), dim=-1)
            next_tokens = torch.multinomial(probs, 1).squeeze(1)
        next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
        tokens.append(next_tokens)
        unfinished &= ~torch.isin(next_tokens, eos_ids)
        if not unfinished.any():
            break
        inputs = torch.cat([inputs, embed(next_tokens).unsqueeze(1).to(inputs.dtype)], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return torch.stack(tokens, dim=1)


# --------------------------------------------------------------------------- what to generate


@dataclass
class LatentChoice:
    """One latent to decode for one prompt, with a JSON-able description."""

    prompt_index: int
    label: str
    description: dict[str, Any]
    vector: torch.Tensor  # [L]


def parse_codes(text: str | None, num_slots: int, codebook_size: int) -> list[int | None] | None:
    """``"0,2"`` -> ``[0, 2]``; ``-`` leaves a slot free (its prior mode, or swept). None stays None."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != num_slots:
        raise ValueError(f"--codes needs one entry per slot ({num_slots}), got {len(parts)} in {text!r}")
    codes: list[int | None] = []
    for part in parts:
        if part in ("-", "*", ""):
            codes.append(None)
            continue
        try:
            code = int(part)
        except ValueError:
            raise ValueError(f"--codes entries must be integers or '-', got {part!r}") from None
        if not 0 <= code < codebook_size:
            raise ValueError(f"--codes entry {code} is outside [0, {codebook_size})")
        codes.append(code)
    return codes


def _discrete_plan(
    model: SharedDiscreteCVAE,
    features: FrozenFeatures,
    mode: str,
    slot: int | None,
    codes: list[int | None] | None,
    all_combinations: bool,
    max_combinations: int,
    num_samples: int,
    posteriors: list[PosteriorSummary] | None,
) -> list[LatentChoice]:
    M, K = model.num_slots, model.codebook_size
    log_p = model.prior_log_probs(features)  # [B, M, K]
    B = log_p.shape[0]
    choices: list[LatentChoice] = []

    def add(p: int, combo: Sequence[int], label: str, **extra: Any) -> None:
        codes_t = torch.tensor([list(combo)], device=log_p.device)
        choices.append(LatentChoice(p, label, dict(extra, codes=list(combo)), model.codes_to_vector(codes_t)[0]))

    if mode == "prior":
        for p in range(B):
            draws = torch.multinomial(log_p[p].exp(), num_samples, replacement=True).T  # [S, M]
            for s, combo in enumerate(draws.tolist()):
                add(p, combo, f"prior#{s} codes={','.join(map(str, combo))}", prior_sample=s)
        return choices
    if mode == "posterior":
        assert posteriors is not None
        for p, summary in enumerate(posteriors):
            combo = summary.codes[0].tolist()
            add(p, combo, f"posterior codes={','.join(map(str, combo))}", posterior_of="reference_response")
        return choices
    if slot is not None and not 0 <= slot < M:
        raise ValueError(f"--slot {slot} is outside [0, {M})")
    forced = codes if codes is not None else [None] * M
    sweep = slot if slot is not None else (0 if codes is None else None)
    for p in range(B):
        mode_codes = log_p[p].argmax(-1).tolist()  # [M], the prior mode
        base = [forced[m] if forced[m] is not None else mode_codes[m] for m in range(M)]
        if all_combinations:
            options = [[forced[m]] if forced[m] is not None else list(range(K)) for m in range(M)]
            combos = list(itertools.islice(itertools.product(*options), max_combinations))
            total = math.prod(len(o) for o in options)
            if p == 0 and total > max_combinations:
                logger.warning("generating the first %d of %d code combinations", max_combinations, total)
        elif sweep is not None:
            combos = [tuple(base[:sweep] + [k] + base[sweep + 1 :]) for k in range(K)]
        else:
            combos = [tuple(base)]
        for combo in combos:
            add(p, combo, f"codes={','.join(map(str, combo))}")
    return choices


def _continuous_plan(
    model: CVAEBase,
    features: FrozenFeatures,
    mode: str,
    num_samples: int,
    steps: int,
    posteriors: list[PosteriorSummary] | None,
    posteriors_b: list[PosteriorSummary] | None,
) -> list[LatentChoice]:
    choices: list[LatentChoice] = []
    B = features.prior_features.shape[0]

    def z_list(z: torch.Tensor) -> list[float]:
        return [round(float(v), 5) for v in z]

    if mode == "prior":
        draws = model.prior_vectors(features, num_samples)  # [S, B, D]
        for p in range(B):
            for s in range(num_samples):
                choices.append(
                    LatentChoice(p, f"prior#{s}", {"prior_sample": s, "z": z_list(draws[s, p])}, draws[s, p])
                )
    elif mode == "posterior":
        assert posteriors is not None
        for p, summary in enumerate(posteriors):
            mu = summary.mu[0]
            choices.append(LatentChoice(p, "posterior", {"posterior_of": "reference_response", "z": z_list(mu)}, mu))
    else:  # interpolate
        assert posteriors is not None and posteriors_b is not None
        for p, (a, b) in enumerate(zip(posteriors, posteriors_b, strict=True)):
            for i in range(steps):
                t = i / (steps - 1) if steps > 1 else 0.0
                z = (1 - t) * a.mu[0] + t * b.mu[0]
                choices.append(LatentChoice(p, f"t={t:.2f}", {"t": t, "z": z_list(z)}, z))
    return choices


def parse_range(text: str | Sequence[float]) -> tuple[float, float]:
    """``"-3:3"`` -> ``(-3.0, 3.0)`` (a pair of numbers passes through); low < high, both finite."""
    if isinstance(text, str):
        low_text, sep, high_text = text.partition(":")
        if not sep:
            raise ValueError(f"--range {text!r} must be LOW:HIGH, e.g. -3:3")
        try:
            low, high = float(low_text), float(high_text)
        except ValueError:
            raise ValueError(f"--range {text!r}: LOW and HIGH must be numbers") from None
    else:
        low, high = (float(v) for v in text)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"--range needs finite LOW < HIGH, got {low}:{high}")
    return low, high


def traversal_offsets(low: float, high: float, steps: int) -> list[float]:
    """``steps`` (>= 2) evenly spaced offsets from ``low`` to ``high``, ends included: ``low + (high - low) i /
    (steps - 1)``; ``(-3, 3, 7)`` gives ``-3, -2, ..., 3``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"--steps must be an integer >= 2 for a traversal, got {steps!r}")
    return [low + (high - low) * i / (steps - 1) for i in range(steps)]


def _steering_plan(
    model: CVAEBase,
    features: FrozenFeatures,
    mode: str,
    row_mu: torch.Tensor | None,
    row_description: dict[str, Any],
    attributes: list[tuple[torch.Tensor, dict[str, Any], float]],
    traverse: int | None,
    offsets: list[float],
) -> list[LatentChoice]:
    """Continuous ``row``, ``attribute`` and ``traverse`` latents (see the module docstring)."""
    prior_mu, _ = model.prior(features)  # [B, D]
    choices: list[LatentChoice] = []

    def z_list(z: torch.Tensor) -> list[float]:
        return [round(float(v), 5) for v in z]

    for p in range(prior_mu.shape[0]):
        if row_mu is not None:
            base, base_name = row_mu.to(prior_mu), f"row {row_description['row']}"
            common: dict[str, Any] = {"base": "row", **row_description}
        else:
            base, base_name = prior_mu[p], "prior mean"
            common = {"base": "prior_mean"}
        if mode == "row":
            choices.append(LatentChoice(p, base_name, {**common, "z": z_list(base)}, base))
            continue
        steered, name = base.clone(), base_name
        for vector, description, scale in attributes:
            steered = steered + scale * vector.to(steered)
            name += f" {'+' if scale >= 0 else '-'} {abs(scale):g}*{description['label']}"
        common["attributes"] = [{**d, "scale": scale} for _, d, scale in attributes]
        if mode == "attribute":
            choices.append(LatentChoice(p, base_name, {**common, "base_only": True, "z": z_list(base)}, base))
            choices.append(LatentChoice(p, name, {**common, "base_only": False, "z": z_list(steered)}, steered))
            continue
        assert traverse is not None
        for offset in offsets:
            z = steered.clone()
            z[traverse] = steered[traverse] + offset
            value = float(z[traverse])
            label = f"{name} dim{traverse}{offset:+.2f} (z[{traverse}]={value:+.3f})"  # the offset and the value
            description = {**common, "dim": traverse, "offset": offset, "value": value, "z": z_list(z)}
            choices.append(LatentChoice(p, label, description, z))
    return choices


@dataclass
class _Steering:
    """What the latent file gives a call of :func:`generate` (checked against the model)."""

    file: Any = None  # latent_file.LatentRows
    row_value: list | None = None  # the row's codes or mu
    row_description: dict[str, Any] = field(default_factory=dict)
    attributes: list[tuple[torch.Tensor, dict[str, Any], float]] = field(default_factory=list)


def _check_steering(
    model: CVAEBase,
    discrete: bool,
    mode: str,
    latents: Any,
    row: int | None,
    attributes: list[str],
    traverse: int | None,
    codes: Any,
    code_examples: int,
) -> _Steering:
    """Check the latent-file options against the mode and the model; read the row and the attributes."""
    family = "discrete" if discrete else "continuous"
    if mode in STEERING_MODES and discrete:
        flag = {"row": "--mode row", "attribute": "--attribute", "traverse": "--traverse"}[mode]
        raise ValueError(f"{flag} needs a continuous model; a discrete model is steered with --codes or --row")
    if attributes and mode not in ("attribute", "traverse"):
        raise ValueError(f"--attribute is used by modes attribute and traverse, not {mode!r}")
    if traverse is not None and mode != "traverse":
        raise ValueError(f"--traverse is used by mode traverse, not {mode!r}")
    if mode == "attribute" and not attributes:
        raise ValueError("mode 'attribute' needs --attribute LABEL:SCALE (and --latents FILE)")
    if mode == "traverse":
        if traverse is None:
            raise ValueError("mode 'traverse' needs --traverse DIM")
        D = model.latent_vector_dim
        if isinstance(traverse, bool) or not isinstance(traverse, int) or not 0 <= traverse < D:
            raise ValueError(f"--traverse {traverse!r} is outside [0, {D}) (this checkpoint's latent dimensions)")
    if mode == "row" and row is None:
        raise ValueError("mode 'row' needs --latents FILE --row I")
    if row is not None and mode not in ("codes", *STEERING_MODES):
        raise ValueError(f"--row is used by modes codes (discrete), row, attribute and traverse, not {mode!r}")
    if discrete and row is not None and codes is not None:
        raise ValueError("--row and --codes both fix the codes; give one of them")
    if code_examples:
        if not discrete:
            raise ValueError("--code-examples needs a discrete model (a code's typical responses)")
        if mode != "codes":
            raise ValueError(f"--code-examples is used by mode codes, not {mode!r}")
        if isinstance(code_examples, bool) or not isinstance(code_examples, int) or code_examples < 0:
            raise ValueError(f"--code-examples must be an integer >= 0, got {code_examples!r}")
    needs_file = [
        flag
        for flag, used in (("--row", row is not None), ("--attribute", attributes), ("--code-examples", code_examples))
        if used
    ]
    steering = _Steering()
    if latents is None:
        if needs_file:
            verb = "needs" if len(needs_file) == 1 else "need"
            raise ValueError(f"{' and '.join(needs_file)} {verb} --latents FILE (an output of disentangle encode)")
        return steering
    if not needs_file:
        raise ValueError(
            f"--latents is read by --row, --attribute or --code-examples; give one of them ({family} model)"
        )
    steering.file = latent_file.as_latent_rows(latents)
    if row is not None:
        steering.row_value = latent_file.row_latent(model, steering.file, row)
        source = steering.file.rows[row].get("source")
        steering.row_description = {"row": row, "row_source": source, "latents": steering.file.path}
    for spec in attributes:
        label, scale = latent_file.parse_attribute(spec)
        vector, description = latent_file.attribute_vector(model, steering.file, label)
        steering.attributes.append((vector, description, scale))
    return steering


def _resolve_mode(
    mode: str | None, discrete: bool, traverse: int | None, attributes: Sequence[str], row: int | None
) -> str:
    """The generation mode: ``mode`` if given, else the one the steering options ask for."""
    if mode is None:
        if traverse is not None:
            mode = "traverse"
        elif attributes:
            mode = "attribute"
        elif row is not None and not discrete:
            mode = "row"
        else:
            mode = "codes" if discrete else "prior"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def _check_mode_inputs(
    mode: str, discrete: bool, reference_response: str | None, reference_response_b: str | None
) -> None:
    """A clear error when ``mode`` does not fit the latent family or lacks its reference responses."""
    if mode == "codes" and not discrete:
        raise ValueError("mode 'codes' needs a discrete model; use prior, posterior or interpolate")
    if mode == "interpolate" and discrete:
        raise ValueError("mode 'interpolate' needs a continuous model")
    if mode in ("posterior", "interpolate") and reference_response is None:
        raise ValueError(f"mode {mode!r} needs --reference-response")
    if mode == "interpolate" and reference_response_b is None:
        raise ValueError("mode 'interpolate' needs --reference-response-b")


def _check_discrete_options(discrete: bool, slot: int | None, codes: Any, all_combinations: bool) -> None:
    """``--codes``, ``--slot`` and ``--all-combinations`` choose codes: refused on a continuous model
    (which would otherwise sample from the prior as if they were not given)."""
    given = [
        flag
        for flag, used in (
            ("--codes", codes is not None),
            ("--slot", slot is not None),
            ("--all-combinations", all_combinations),
        )
        if used
    ]
    if given and not discrete:
        raise ValueError(
            f"{', '.join(given)}: {'an option' if len(given) == 1 else 'options'} of a discrete model (codes); this "
            "checkpoint is continuous: use --mode prior, posterior, interpolate, row, attribute or traverse"
        )


def diversity(prompts: Sequence[str], generations: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``distinct_1`` and ``distinct_2`` of each prompt's responses (``per_prompt``) and their means."""
    per_prompt = []
    for p, prompt in enumerate(prompts):
        mine = [g["text"] for g in generations if g["prompt_index"] == p]
        per_prompt.append(
            {
                "prompt": prompt,
                "responses": len(mine),
                "distinct_1": distinct_n(mine, 1),
                "distinct_2": distinct_n(mine, 2),
            }
        )
    return {
        "distinct_1": sum(d["distinct_1"] for d in per_prompt) / len(per_prompt),
        "distinct_2": sum(d["distinct_2"] for d in per_prompt) / len(per_prompt),
        "per_prompt": per_prompt,
    }


def generate(
    model: CVAEBase,
    tokenizer: Any,
    config: RunConfig,
    prompts: Sequence[str],
    *,
    mode: str | None = None,
    slot: int | None = None,
    codes: str | Sequence[int | None] | None = None,
    all_combinations: bool = False,
    max_combinations: int = 64,
    num_samples: int = 1,
    reference_response: str | None = None,
    reference_response_b: str | None = None,
    steps: int = 5,
    latents: Any = None,
    row: int | None = None,
    attributes: Sequence[str] | None = None,
    traverse: int | None = None,
    traverse_range: str | Sequence[float] = (-3.0, 3.0),
    code_examples: int = 0,
    sampling: SamplingOptions | None = None,
    batch_size: int = 16,
    progress: bool = False,
) -> dict[str, Any]:
    """Generate responses to ``prompts`` under chosen latents (see the module docstring); ``progress`` shows a
    progress bar over the responses.

    ``latents`` is an encode file's path, its :class:`latent_file.LatentRows` or its rows; ``row``,
    ``attributes`` and ``code_examples`` need it. Example (a notebook)::

        generate(model, tokenizer, config, ["Hi"], latents="z.jsonl", attributes=["polite:2"])
        generate(model, tokenizer, config, ["Hi"], traverse=0, traverse_range="-3:3", steps=7)

    ``num_samples`` is the number of responses per latent, except in ``prior`` mode where it is
    the number of latents drawn (one response each). Returns a JSON-able dict: ``latent``,
    ``mode``, ``sampling``, ``prompts``, ``generations`` (one record per response: ``prompt_index``,
    ``prompt``, ``latent`` label, ``latent_description``, ``sample``, ``text``) and ``diversity``
    (``distinct_1``, ``distinct_2`` averaged over prompts, and ``per_prompt``). Deterministic given
    ``sampling.seed``; the caller's random state is left untouched.
    """
    sampling = sampling or SamplingOptions()
    discrete = model.is_discrete
    attributes = list(attributes or [])
    mode = _resolve_mode(mode, discrete, traverse, attributes, row)
    steering = _check_steering(model, discrete, mode, latents, row, attributes, traverse, codes, code_examples)
    offsets = traversal_offsets(*parse_range(traverse_range), steps) if mode == "traverse" else []
    _check_mode_inputs(mode, discrete, reference_response, reference_response_b)
    _check_discrete_options(discrete, slot, codes, all_combinations)
    if num_samples < 1 or steps < 1 or max_combinations < 1:
        raise ValueError("num_samples, steps and max_combinations must be >= 1")
    if codes is not None and not isinstance(codes, str):
        codes = ",".join("-" if c is None else str(c) for c in codes)
    pad = tokenizer.pad_token_id
    prompt_ids = encode_prompts(prompts, tokenizer, config.data)
    device = _device(model)
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(sampling.seed)
        features = prompt_features(model, prompt_ids, pad)
        posteriors = posteriors_b = None
        if reference_response is not None and mode in ("posterior", "interpolate"):
            posteriors = [reference_posterior(model, tokenizer, config.data, p, reference_response) for p in prompts]
        if mode == "interpolate":
            posteriors_b = [
                reference_posterior(model, tokenizer, config.data, p, reference_response_b) for p in prompts
            ]
        if discrete:
            if steering.row_value is not None:
                codes = ",".join(map(str, steering.row_value))
            parsed = parse_codes(codes, model.num_slots, model.codebook_size)
            choices = _discrete_plan(
                model,
                features,
                mode,
                slot,
                parsed,
                all_combinations,
                max_combinations,
                num_samples,
                posteriors,
            )
            for choice in choices:
                choice.description.update(steering.row_description)
                if steering.row_value is not None:  # the output names the row
                    choice.label = f"row {row} {choice.label}"
        elif mode in STEERING_MODES:
            row_mu = None if steering.row_value is None else torch.tensor(steering.row_value)
            choices = _steering_plan(
                model,
                features,
                mode,
                row_mu,
                steering.row_description,
                steering.attributes,
                traverse,
                offsets,
            )
        else:
            choices = _continuous_plan(model, features, mode, num_samples, steps, posteriors, posteriors_b)
        repeats = 1 if mode == "prior" else num_samples
        rows = [(c, s) for c in choices for s in range(repeats)]
        vectors = torch.stack([c.vector for c, _ in rows])
        texts = generate_texts(
            model, tokenizer, [prompt_ids[c.prompt_index] for c, _ in rows], vectors, sampling, batch_size, progress
        )
    generations = [
        {
            "prompt_index": c.prompt_index,
            "prompt": prompts[c.prompt_index],
            "latent": c.label,
            "latent_description": c.description,
            "sample": s,
            "text": text,
        }
        for (c, s), text in zip(rows, texts, strict=True)
    ]
    result: dict[str, Any] = {
        "latent": "discrete" if discrete else "continuous",
        "mode": mode,
        "sampling": asdict(sampling),
        "prompts": list(prompts),
        "generations": generations,
        "diversity": diversity(prompts, generations),
    }
    if discrete and mode == "codes":
        result["slot"] = slot if slot is not None else (0 if codes is None and not all_combinations else None)
        result["all_combinations"] = all_combinations
    if latents is not None:
        result["latents"] = steering.file.path
    if row is not None:
        result["row"] = row
    if mode == "traverse":
        result["traverse"] = {"dim": traverse, "offsets": offsets}
    if code_examples:
        used = sorted({(m, k) for c in choices for m, k in enumerate(c.description["codes"])})
        result["code_examples"] = [
            latent_file.code_examples(model, steering.file, m, k, code_examples) for m, k in used
        ]
    if reference_response is not None:
        result["reference_response"] = reference_response
    if reference_response_b is not None:
        result["reference_response_b"] = reference_response_b
    return result


def format_generations(result: dict[str, Any]) -> str:
    """A readable text table: per prompt, one line per latent and sample, then the diversity."""
    lines: list[str] = []
    if result.get("row") is not None:
        described = next(
            (g["latent_description"] for g in result["generations"] if "row_source" in g["latent_description"]), {}
        )
        source = f" ({described['row_source']})" if described.get("row_source") else ""
        lines += [f"latent of row {result['row']} of {result.get('latents')}{source}", ""]
    if result.get("traverse"):
        t = result["traverse"]
        lines += [f"traversal of dimension {t['dim']}: offsets {', '.join(f'{o:+g}' for o in t['offsets'])}", ""]
    for p, prompt in enumerate(result["prompts"]):
        rows = [g for g in result["generations"] if g["prompt_index"] == p]
        labels = [g["latent"] + (f" #{g['sample']}" if g["sample"] else "") for g in rows]
        width = max([len("latent"), *map(len, labels)])
        lines.append(f"prompt {p}: {prompt!r}")
        lines.append(f"  {'latent'.ljust(width)} | response")
        lines.append(f"  {'-' * width}-+-{'-' * 40}")
        for label, g in zip(labels, rows, strict=True):
            text = g["text"].replace("\n", "\\n")
            lines.append(f"  {label.ljust(width)} | {text}")
        d = result["diversity"]["per_prompt"][p]
        lines.append(
            f"  distinct-1 {d['distinct_1']:.3f}  distinct-2 {d['distinct_2']:.3f}  ({d['responses']} responses)"
        )
        lines.append("")
    d = result["diversity"]
    lines.append(f"mean over prompts: distinct-1 {d['distinct_1']:.3f}  distinct-2 {d['distinct_2']:.3f}")
    for entry in result.get("code_examples", []):
        lines.append("")
        lines.append(
            f"slot {entry['slot']} code {entry['code']}: {entry['rows_with_code']} rows of {result['latents']} "
            f"({100 * entry['share']:.1f}%); most typical:"
        )
        for ex in entry["examples"]:
            response = str(ex["response"]).replace("\n", "\\n")
            label = f" [{json.dumps(ex['label'])}]" if ex["label"] is not None else ""
            lines.append(f"  p={ex['probability']:.3f} row {ex['row']}{label}: {response}")
        if not entry["examples"]:
            lines.append("  (no row of the file is assigned to this code)")
    return "\n".join(lines)
