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

import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from . import latent_file
from .config import DataConfig, RunConfig
from .cvae_base import CVAEBase, FrozenFeatures, PosteriorSummary
from .data import PromptResponse, collate, prompt_text_for_generation, tokenize_pairs
from .guidance import Guidance, contrast_sets, guided_generate
from .latent_space import STEERING_MODES, LatentChoice, LatentSpace, SteeringRequest
from .memory import decoder_text_config, memory_attention_mask, positions_from_mask
from .metrics import distinct_n, looping_share
from .reference import eval_mode, reference_hidden_states

MODES = ("codes", "prior", "posterior", "interpolate", "row", "attribute", "traverse")


@dataclass
class SamplingOptions:
    """Decoding options, passed to transformers' ``generate``."""

    greedy: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 64
    seed: int = 0
    #: 0: off; N: no N tokens in a row twice in one generation (transformers' ``no_repeat_ngram_size``: the
    #: token that would repeat an N-gram already generated is never chosen; the prompt is not counted)
    no_repeat_ngram: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.no_repeat_ngram, bool) or not isinstance(self.no_repeat_ngram, int):
            raise ValueError(f"no_repeat_ngram must be an integer >= 0, got {self.no_repeat_ngram!r}")
        if self.no_repeat_ngram < 0:
            raise ValueError(f"no_repeat_ngram must be >= 0 (0: off), got {self.no_repeat_ngram}")

    def generate_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        if self.no_repeat_ngram:
            kwargs["no_repeat_ngram_size"] = self.no_repeat_ngram
        if self.greedy:
            return {"do_sample": False, **kwargs}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0, **kwargs}

    def describe(self) -> str:
        """What the n-gram rule adds to a decoding's description ("" when off)."""
        return f", no {self.no_repeat_ngram}-gram twice" if self.no_repeat_ngram else ""


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
    guidance: Guidance | None = None,
    contrast_keys: Sequence[Any] | None = None,
) -> list[str]:
    """The texts of :func:`generate_responses` (same arguments)."""
    return generate_responses(
        model, tokenizer, prompt_ids, vectors, sampling, batch_size, progress, guidance, contrast_keys
    )[0]


def _text_and_end(tokenizer: Any, row: list[int], eos: set[int]) -> tuple[str, bool]:
    """A generated row's text (its tokens before the first end-of-sequence token) and whether it has that token;
    a row without one ran to ``max_new_tokens`` (rows are only cut short once every row has ended). A decoder whose
    generation config forces an end token at the cap (``forced_eos_token_id``) would have its cut rows read as
    ended; the built-in decoders set none."""
    cut = next((i for i, t in enumerate(row) if t in eos), None)
    return tokenizer.decode(row[:cut], skip_special_tokens=True), cut is not None


@torch.no_grad()
def generate_responses(
    model: CVAEBase,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    vectors: torch.Tensor,
    sampling: SamplingOptions,
    batch_size: int = 16,
    progress: bool = False,
    guidance: Guidance | None = None,
    contrast_keys: Sequence[Any] | None = None,
) -> tuple[list[str], list[bool]]:
    """One response per row (``prompt_ids[r]`` under latent ``vectors[r]``), new tokens only, and whether each
    ended (wrote an end-of-sequence token within ``sampling.max_new_tokens``; False: cut at the cap, its end
    unwritten); with ``progress`` a progress bar (stderr) counts the responses.

    With a ``guidance`` scale above 0, each row is guided against the latents of the rows of its own key in
    ``contrast_keys`` (one key per row, e.g. ``(prompt, slot)``; :mod:`.guidance`): a guided row decodes one
    stream per latent of its set, and ``batch_size`` counts streams. Uses the global torch generator for sampling
    (the caller seeds it).
    """
    from tqdm.auto import tqdm

    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    if guidance is not None and guidance.scale > 0:
        return _guided_texts(model, tokenizer, prompt_ids, vectors, sampling, guidance, contrast_keys, eos, pad,
                             batch_size, progress)  # fmt: skip
    texts: list[str] = []
    ended: list[bool] = []
    bar = tqdm(total=len(prompt_ids), desc="generate", unit="response", disable=not progress)
    with eval_mode(model), bar:
        for start in range(0, len(prompt_ids), batch_size):
            chunk = list(prompt_ids[start : start + batch_size])
            chunk_vectors = vectors[start : start + batch_size]
            embeds, attention = generation_inputs(model, chunk, chunk_vectors, pad)
            if model.latent_memory is not None:
                out = memory_generate(model, embeds, attention, chunk_vectors, sampling, eos, pad)
            else:
                with warnings.catch_warnings():  # the n-gram rule counts the new tokens only, as documented here
                    warnings.filterwarnings("ignore", message="Passing `no_repeat_ngram_size` with `inputs_embeds`")
                    out = model.decoder.generate(
                        inputs_embeds=embeds,
                        attention_mask=attention,
                        pad_token_id=pad,
                        eos_token_id=sorted(eos) or None,
                        **sampling.generate_kwargs(),
                    )
            for row in out.tolist():
                text, finished = _text_and_end(tokenizer, row, eos)
                texts.append(text)
                ended.append(finished)
            bar.update(len(chunk))
    return texts, ended


def _guided_texts(
    model: CVAEBase,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    vectors: torch.Tensor,
    sampling: SamplingOptions,
    guidance: Guidance,
    contrast_keys: Sequence[Any] | None,
    eos: set[int],
    pad: int,
    batch_size: int,
    progress: bool,
) -> tuple[list[str], list[bool]]:
    """:func:`generate_responses` under contrastive guidance: a guided row decodes one stream per latent of its
    set, and about ``batch_size`` streams go through at a time (at least one row)."""
    from tqdm.auto import tqdm

    if contrast_keys is None or len(contrast_keys) != len(prompt_ids):
        raise ValueError("guided generation needs one contrast key per row")
    sets = contrast_sets(contrast_keys)
    if all(len(members) < 2 for members in sets):
        raise ValueError("guidance contrasts each latent with the prompt's others, and every prompt here has one")
    texts: list[str] = []
    ended: list[bool] = []
    bar = tqdm(total=len(prompt_ids), desc="generate (guided)", unit="response", disable=not progress)
    with eval_mode(model), bar:
        start = 0
        while start < len(prompt_ids):
            end, streams = start + 1, len(sets[start])
            while end < len(prompt_ids) and streams + len(sets[end]) <= batch_size:
                streams += len(sets[end])
                end += 1
            chunk = range(start, end)
            out = guided_generate(
                model, [prompt_ids[r] for r in chunk], [vectors[sets[r]] for r in chunk],
                [sets[r].index(r) for r in chunk], sampling, guidance, eos, pad,
            )  # fmt: skip
            for row in out.tolist():
                text, finished = _text_and_end(tokenizer, row, eos)
                texts.append(text)
                ended.append(finished)
            bar.update(len(chunk))
            start = end
    return texts, ended


@torch.no_grad()
def decode_step(
    model: CVAEBase,
    inputs: torch.Tensor,
    mask: torch.Tensor,
    cache: DynamicCache | None,
    latent: torch.Tensor | None = None,
) -> tuple[torch.Tensor, DynamicCache]:
    """One step of a KV-cached decoding loop: the next-token logits ``[R, V]`` (float32) after the left-padded
    ``inputs [R, T, H]`` (mask ``[R, T]``), and the cache. With ``cache`` None the whole sequence runs (the
    memory placement's latent ``latent [R, P, H]`` put in the cache's first ``P`` entries; without one a fresh
    cache); with a cache that holds every earlier position, the last input alone, its mask then carrying the
    memory's ``P`` leading ones and its position id continuing the sequence's own."""
    decoder = model.decoder
    positions = positions_from_mask(mask)  # [R, T], the sequence's own positions
    if cache is None and latent is not None:
        extra = model.memory_inputs(latent, mask, positions, inputs.dtype)
        cache, step_inputs = extra["cache"], inputs
    elif cache is None:
        cache = DynamicCache(config=decoder_text_config(decoder))
        extra = {"cache": cache, "attention_mask": mask, "position_ids": positions}
        step_inputs = inputs
    else:  # the cache holds every earlier position: feed the last token only
        step_mask = memory_attention_mask(mask, model.num_latent_tokens) if latent is not None else mask
        extra = {"cache": cache, "attention_mask": step_mask, "position_ids": positions[:, -1:]}
        step_inputs = inputs[:, -1:]
    logits = decoder(inputs_embeds=step_inputs, use_cache=True, logits_to_keep=1, **extra).logits[:, -1]
    return logits.float(), cache


def ban_repeats(scores: torch.Tensor, sampling: SamplingOptions, generated: Sequence[torch.Tensor]) -> torch.Tensor:
    """``scores [R, V]`` with -inf on each token that would complete an N-gram already in the row's ``generated``
    tokens (the earlier steps' ``[R]`` tensors), N ``sampling.no_repeat_ngram`` (transformers'
    ``NoRepeatNGramLogitsProcessor``, as ``generate``'s ``no_repeat_ngram_size``); unchanged when the rule is off."""
    if not sampling.no_repeat_ngram or not generated:
        return scores
    return NoRepeatNGramLogitsProcessor(sampling.no_repeat_ngram)(torch.stack(list(generated), dim=1), scores)


def choose_tokens(
    scores: torch.Tensor, sampling: SamplingOptions, generated: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """The next token of each row of ``scores [R, V]`` (logits or log-probabilities): the argmax when greedy,
    else a draw after temperature, then top-p (no top-k), as ``generate`` samples; never a token
    :func:`ban_repeats` bans after the row's ``generated`` tokens."""
    scores = ban_repeats(scores, sampling, generated)
    if sampling.greedy:
        return scores.argmax(-1)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature), TopPLogitsWarper(sampling.top_p)])
    return torch.multinomial(torch.softmax(warpers(None, scores), dim=-1), 1).squeeze(1)


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
    and values are appended to it (:func:`decode_step`): the first step runs the prompt, each later step the
    last token alone. Without it every step recomputes the whole sequence under a fresh memory cache (the
    plain version, for tests). Sampling as :func:`choose_tokens`.
    """
    embed = model.decoder.get_input_embeddings()
    latent = model.latent_embeddings(vectors.to(embeds.device))  # [R, P, H]
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=embeds.device)
    unfinished = torch.ones(embeds.shape[0], dtype=torch.bool, device=embeds.device)
    inputs, mask, cache = embeds, attention, None
    tokens: list[torch.Tensor] = []
    for _ in range(sampling.max_new_tokens):
        logits, cache = decode_step(model, inputs, mask, cache if use_cache else None, latent)
        next_tokens = choose_tokens(logits, sampling, tokens)
        next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
        tokens.append(next_tokens)
        unfinished &= ~torch.isin(next_tokens, eos_ids)
        if not unfinished.any():
            break
        inputs = torch.cat([inputs, embed(next_tokens).unsqueeze(1).to(inputs.dtype)], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return torch.stack(tokens, dim=1)


# --------------------------------------------------------------------------- what to generate


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


@dataclass
class _Steering:
    """What the latent file gives a call of :func:`generate` (checked against the model)."""

    file: Any = None  # latent_file.LatentRows
    row_value: list | None = None  # the row's codes or mu
    row_description: dict[str, Any] = field(default_factory=dict)
    attributes: list[tuple[torch.Tensor, dict[str, Any], float]] = field(default_factory=list)


def _check_steering(
    model: CVAEBase,
    space: LatentSpace,
    mode: str,
    latents: Any,
    row: int | None,
    attributes: list[str],
    traverse: int | None,
    codes: Any,
    code_examples: int,
) -> _Steering:
    """Check the latent-file options against the mode and the model's latent ``space``; read the row and the
    attributes."""
    if mode in STEERING_MODES:
        space.require(f"mode {mode}")
    _check_steering_options(model, space, mode, row, attributes, traverse, codes, code_examples)
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
            f"--latents is read by --row, --attribute or --code-examples; give one of them ({space.kind} model)"
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


def _check_steering_options(
    model: CVAEBase,
    space: LatentSpace,
    mode: str,
    row: int | None,
    attributes: list[str],
    traverse: int | None,
    codes: Any,
    code_examples: int,
) -> None:
    """``--attribute``, ``--traverse``, ``--row`` and ``--code-examples`` against the mode and the family."""
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
    if space.supports("mode codes") and row is not None and codes is not None:
        raise ValueError("--row and --codes both fix the codes; give one of them")
    if code_examples:
        space.require("--code-examples")
        if mode != "codes":
            raise ValueError(f"--code-examples is used by mode codes, not {mode!r}")
        if isinstance(code_examples, bool) or not isinstance(code_examples, int) or code_examples < 0:
            raise ValueError(f"--code-examples must be an integer >= 0, got {code_examples!r}")


def _resolve_mode(
    mode: str | None, space: LatentSpace, traverse: int | None, attributes: Sequence[str], row: int | None
) -> str:
    """The generation mode: ``mode`` if given, else the one the steering options ask for."""
    if mode is None:
        if traverse is not None:
            mode = "traverse"
        elif attributes:
            mode = "attribute"
        else:
            mode = space.default_mode(row)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def _check_mode_inputs(
    mode: str, space: LatentSpace, reference_response: str | None, reference_response_b: str | None
) -> None:
    """A clear error when ``mode`` does not fit the latent family or lacks its reference responses."""
    if mode in ("codes", "interpolate"):
        space.require(f"mode {mode}")
    if mode in ("posterior", "interpolate") and reference_response is None:
        raise ValueError(f"mode {mode!r} needs --reference-response")
    if mode == "interpolate" and reference_response_b is None:
        raise ValueError("mode 'interpolate' needs --reference-response-b")


def check_codes_options(space: LatentSpace, slot: int | None, codes: Any, all_combinations: bool) -> None:
    """``--codes``, ``--slot`` and ``--all-combinations`` choose codes: refused by a family without codes
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
    if given:
        space.require("codes options", flags=", ".join(given), count="an option" if len(given) == 1 else "options")


def diversity(prompts: Sequence[str], generations: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``distinct_1`` and ``distinct_2`` of each prompt's responses (``per_prompt``) and their means;
    ``looping_share``, the share of all responses that repeat themselves (:func:`metrics.looping_share`)."""
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
        "looping_share": looping_share([g["text"] for g in generations]),
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
    guidance: Guidance | None = None,
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
    the number of latents drawn (one response each). With ``guidance`` (scale above 0) each response is
    guided against the prompt's other latents of the call (:mod:`.guidance`; the same sample index), so
    every prompt needs two latents or more; the result's ``guidance`` says how. Returns a JSON-able dict: ``latent``,
    ``mode``, ``sampling``, ``prompts``, ``generations`` (one record per response: ``prompt_index``,
    ``prompt``, ``latent`` label, ``latent_description``, ``sample``, ``text``, ``ended``: False when the
    response ran to ``sampling.max_new_tokens`` without its end) and ``diversity``
    (``distinct_1``, ``distinct_2`` averaged over prompts, and ``per_prompt``), and ``truncated_share``, the share
    of responses cut at the cap. Deterministic given
    ``sampling.seed``; the caller's random state is left untouched.
    """
    sampling = sampling or SamplingOptions()
    space = model.latent_space
    request, steering = _checked_request(
        model, space, mode, slot, codes, all_combinations, max_combinations, num_samples, reference_response,
        reference_response_b, steps, latents, row, list(attributes or []), traverse, traverse_range, code_examples,
    )  # fmt: skip
    mode = request.mode
    guidance = guidance if guidance is not None and guidance.scale > 0 else None
    choices, rows, texts, ended = _generate_choices(
        model, tokenizer, config, prompts, request, reference_response, reference_response_b, sampling, guidance,
        batch_size, progress,
    )  # fmt: skip
    generations = [
        {
            "prompt_index": c.prompt_index,
            "prompt": prompts[c.prompt_index],
            "latent": c.label,
            "latent_description": c.description,
            "sample": s,
            "text": text,
            "ended": finished,
        }
        for (c, s), text, finished in zip(rows, texts, ended, strict=True)
    ]
    result: dict[str, Any] = {
        "latent": space.kind,
        "mode": mode,
        "sampling": asdict(sampling),
        "guidance": asdict(guidance) if guidance is not None else None,
        "prompts": list(prompts),
        "generations": generations,
        "diversity": diversity(prompts, generations),
        "truncated_share": sum(not g["ended"] for g in generations) / len(generations),
    }
    _add_request_fields(result, model, request, steering, choices, code_examples)
    if reference_response is not None:
        result["reference_response"] = reference_response
    if reference_response_b is not None:
        result["reference_response_b"] = reference_response_b
    return result


def _checked_request(
    model: CVAEBase,
    space: LatentSpace,
    mode: str | None,
    slot: int | None,
    codes: str | Sequence[int | None] | None,
    all_combinations: bool,
    max_combinations: int,
    num_samples: int,
    reference_response: str | None,
    reference_response_b: str | None,
    steps: int,
    latents: Any,
    row: int | None,
    attributes: list[str],
    traverse: int | None,
    traverse_range: str | Sequence[float],
    code_examples: int,
) -> tuple[SteeringRequest, _Steering]:
    """:func:`generate`'s options checked against each other and the model's latent ``space``, before anything
    is generated: the request for the latent space, and what the latent file gave."""
    mode = _resolve_mode(mode, space, traverse, attributes, row)
    steering = _check_steering(model, space, mode, latents, row, attributes, traverse, codes, code_examples)
    offsets = traversal_offsets(*parse_range(traverse_range), steps) if mode == "traverse" else []
    _check_mode_inputs(mode, space, reference_response, reference_response_b)
    check_codes_options(space, slot, codes, all_combinations)
    if num_samples < 1 or steps < 1 or max_combinations < 1:
        raise ValueError("num_samples, steps and max_combinations must be >= 1")
    if codes is not None and not isinstance(codes, str):
        codes = ",".join("-" if c is None else str(c) for c in codes)
    request = SteeringRequest(
        mode,
        num_samples,
        steps,
        slot,
        codes,
        all_combinations,
        max_combinations,
        row=row,
        row_value=steering.row_value,
        row_description=steering.row_description,
        attributes=steering.attributes,
        traverse=traverse,
        offsets=offsets,
    )
    return request, steering


def _generate_choices(
    model: CVAEBase,
    tokenizer: Any,
    config: RunConfig,
    prompts: Sequence[str],
    request: SteeringRequest,
    reference_response: str | None,
    reference_response_b: str | None,
    sampling: SamplingOptions,
    guidance: Guidance | None,
    batch_size: int,
    progress: bool,
) -> tuple[list[LatentChoice], list[tuple[LatentChoice, int]], list[str], list[bool]]:
    """The latents the model's latent space plans for ``request``, and the responses under them: the
    choices, the ``(choice, sample)`` rows generated, their texts and whether each ended (in eval mode, under
    ``sampling.seed``)."""
    mode = request.mode
    pad = tokenizer.pad_token_id
    prompt_ids = encode_prompts(prompts, tokenizer, config.data)
    device = _device(model)
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(sampling.seed)
        features = prompt_features(model, prompt_ids, pad)
        if reference_response is not None and mode in ("posterior", "interpolate"):
            request.posteriors = [
                reference_posterior(model, tokenizer, config.data, p, reference_response) for p in prompts
            ]
        if mode == "interpolate":
            request.posteriors_b = [
                reference_posterior(model, tokenizer, config.data, p, reference_response_b) for p in prompts
            ]
        choices = model.latent_space.plan(features, request)
        repeats = 1 if mode == "prior" else request.num_samples
        rows = [(c, s) for c in choices for s in range(repeats)]
        vectors = torch.stack([c.vector for c, _ in rows])
        keys = [(c.prompt_index, s) for c, s in rows]
        if guidance is not None and len(set(keys)) == len(keys):
            raise ValueError(
                f"--guidance contrasts each latent with the prompt's other latents, and mode {mode!r} gives one "
                "latent per prompt here: sweep codes, draw several prior latents or traverse"
            )
        texts, ended = generate_responses(
            model, tokenizer, [prompt_ids[c.prompt_index] for c, _ in rows], vectors, sampling, batch_size, progress,
            guidance, keys,
        )  # fmt: skip
    return choices, rows, texts, ended


def _add_request_fields(
    result: dict[str, Any],
    model: CVAEBase,
    request: SteeringRequest,
    steering: _Steering,
    choices: list[LatentChoice],
    code_examples: int,
) -> None:
    """The result's fields of the options that chose the latents: ``slot`` and ``all_combinations`` (mode
    codes), ``latents``, ``row``, ``traverse`` and ``code_examples``."""
    if request.mode == "codes":  # a family with codes (others refuse the mode)
        fixed = request.codes is not None or request.row_value is not None  # a row's codes are forced codes
        slot = request.slot
        result["slot"] = slot if slot is not None else (0 if not fixed and not request.all_combinations else None)
        result["all_combinations"] = request.all_combinations
    if steering.file is not None:
        result["latents"] = steering.file.path
    if request.row is not None:
        result["row"] = request.row
    if request.mode == "traverse":
        result["traverse"] = {"dim": request.traverse, "offsets": request.offsets}
    if code_examples:
        used = sorted({(m, k) for c in choices for m, k in enumerate(c.description["codes"])})
        result["code_examples"] = [
            latent_file.code_examples(model, steering.file, m, k, code_examples) for m, k in used
        ]


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
            cut = "" if g.get("ended", True) else f" [cut at {result['sampling']['max_new_tokens']} tokens]"
            lines.append(f"  {label.ljust(width)} | {text}{cut}")
        d = result["diversity"]["per_prompt"][p]
        lines.append(
            f"  distinct-1 {d['distinct_1']:.3f}  distinct-2 {d['distinct_2']:.3f}  ({d['responses']} responses)"
        )
        lines.append("")
    d = result["diversity"]
    lines.append(
        f"mean over prompts: distinct-1 {d['distinct_1']:.3f}  distinct-2 {d['distinct_2']:.3f}; "
        f"responses that repeat themselves {d['looping_share']:.3f}"
        + (f"; cut at the token cap {result['truncated_share']:.3f}" if result.get("truncated_share") else "")
    )
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
