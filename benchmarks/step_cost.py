"""What one training step costs: plain prefix tuning against the CVAE objective (docs/design.md section 7).

Usage::

    python benchmarks/step_cost.py --model tiny|embedded|config:NAME [--batch-size 8] [--repeats R] [--warmup W]
        [--threads N] [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|both] [--skip-memory]
        [--skip-scaling] [--breakdown] [--gradient-checkpointing] [--peft]
    python benchmarks/step_cost.py --models config:NAME,config:NAME,... [options]

``config:NAME`` is a decoder of ``disentanglement.testing.MODEL_SHAPES[NAME]``'s shape (SmolLM2-135M, -360M,
-1.7B, the Llama-3.2-1B shape) with random weights, built in the benchmark's dtype on its device, timed on
synthetic token ids of the tiny model's lengths. ``--models`` runs cases (f), (a), (c), (e) (and (g)) for
each listed model and prints one table against the decoder's size (its last line: a JSON list of records).

``--repeats``/``--warmup`` default to 20/3 for ``tiny`` and 10/2 for ``embedded`` (whose step takes
seconds on 2 CPU cores; a full embedded run then stays near 5 minutes). On a machine shared with other
work, ``--threads 1`` avoids OpenMP threads waiting on each other when a core is taken (with 2 threads
on 2 busy cores the tiny model's steps become 10-30 times slower and very noisy); the header and the
footer print the load average so that a noisy run can be recognised.

A *step* is forward + backward + AdamW step + ``zero_grad`` on the trainable parameters, with the
model in train mode (the frozen decoder stays in eval mode, as in training). Every case runs on the
same decoder object and the same list of batches:

(a) plain prefix tuning: one trainable latent vector ``[latent_vector_dim]``, expanded over the
    batch and passed through the CVAE's own ``decode`` (same injection, same windowed and chunked
    LM head), loss = uniform token-mean cross-entropy (``losses.reconstruction_loss``); AdamW over
    that vector and ``latent_projection``. No encoder, no reference, no features.
(b) the CVAE (discrete, default nearest-code recipe), raw reconstruction term only (the other five
    weights 0, beta 0), features from a :class:`FeatureCache` built once beforehand.
(c) the same CVAE class with all six reconstruction terms weighted (``token_weight_alpha`` 1,
    ``zfree_reference_scale`` = c_base of the cache), KL with a constant beta > 0, cached features.
(d) as (c) without the cache: ``forward(batch, None)`` runs ``frozen_pass`` itself every step.
(e) one no-grad ``frozen_pass(batch)`` alone, to check that (d) - (c) is about one such pass.
(m) as (a) with ``latent_placement: memory``: the vector's ``P`` slot embeddings mapped to a key and a
    value per attention layer (``latent_memory``, trained too) and given to the decoder as its cache.
(n) as (c) with ``latent_placement: memory`` (same terms, KL, cached features).

(f) the decoder's own forward and backward: its token embeddings of ``[x][y]`` as a leaf that requires grad,
    full logits, float32 cross-entropy over the response tokens, backward to the inputs; no optimizer.
    The yardstick of "the CVAE's cost grows no faster than the decoder's own forward + backward": (c)/(f).
(g) with ``--gradient-checkpointing``: as (c), the decoder's layers checkpointed
    (``models.enable_activation_checkpointing``, on for (g)'s steps only; the decoder is shared).

(t) with ``--peft``: what a user writes who wants a learned prefix alone, peft prompt tuning
    (``PromptTuningConfig``, ``latent_tokens`` virtual tokens, on its own copy of the decoder): the
    standard forward with ``labels`` (-100 off the response), the model's default ``use_cache`` and the
    full ``[B, P + T, V]`` logits, AdamW at ``latent_lr`` over the virtual tokens. (c)/(t) is the issue
    "side by side with the peers"'s goal, measured interleaved on the same batches (``benchmarks/peers/``
    runs the systems one after the other); (b) and (c) read the feature cache, built before the steps,
    which (t) does not need: (d)/(t) is the CVAE's step with its frozen pass inside.

(m)/(a) and (n)/(c) are the memory placement's cost beside the prefix's: the decoder runs over ``T``
positions instead of ``T + P`` and every layer attends to ``P`` more keys.

(b)-(d) also run ``post_step`` (dead-code restart), as the trainer does after each optimizer step;
the cached features and token weights are looked up inside the timed step
(``cache.features(batch, model.weighting_params)``), as in training.
The optimizer is ``trainer.make_optimizer`` (its settings, e.g. ``foreach``/``fused``, also serve (a)),
so a change there shows here. Gradient clipping and metric logging of the trainer are not part of a step.

Timing: ``--warmup`` untimed repetitions, then ``--repeats`` timed ones; each repetition runs every
case once on the same batch (round-robin, the starting case rotating every repetition), so that load
from other work on the machine falls on all cases alike. Reported: the median (and quartiles) per
case, ratios of medians to (a), and, as a cross-check robust to drifting load and to batches of
different lengths, the median of the per-repetition (paired) ratios.

Peak memory, CPU: each case runs in a fresh subprocess (this script with ``--measure-memory CASE``)
that loads the same decoder and the same first batches, then returns freed memory to the OS
(``gc.collect`` and glibc's ``malloc_trim``), resets the kernel's resident-set high-water mark by
writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), runs 2 steps (the first one's
allocations, optimizer state included, count) and reads ``VmHWM`` from
``/proc/self/status``: peak = VmHWM - RSS at the reset. The subprocess runs with a fixed
``MALLOC_MMAP_THRESHOLD_`` (64 KiB) so that every sizeable tensor is its own mmap that is returned on
free; RSS then follows live tensors and a buffer freed during setup cannot hide a step's allocation.
This is exact for the high-water mark (no sampling can miss a short peak). Where ``clear_refs`` is
not writable, a background thread samples ``VmRSS`` every millisecond instead (a lower bound).
CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the memory
allocated before the steps, in the main process. On CUDA the weights stay float32 and steps run under
bf16 autocast, as the trainer's ``mixed_precision="bf16"`` (this path has not been run on a GPU yet).

Scaling: the tiny in-process Llama (built here, hidden 32, 2 layers), batches of identical
lengths (no padding), case (c) and (a) against response length at a fixed vocabulary and against
vocabulary size at a fixed length, interleaved round-robin like the main table; a least-squares
line ``t = t0 + k x`` says whether the cost grows linearly (small residuals) and what the fixed
per-step overhead ``t0`` is.

Breakdown (``--breakdown``, tiny or embedded): where (c)'s extra cost over (a) goes, as a ladder of
steps that add one part at a time, timed round-robin like the main table, with the number of ATen
operators each dispatches (forward, backward and optimizer; counted once with a ``TorchDispatchMode``):
(a); (h) the CVAE's latent heads (encoder, prior, nearest code, KL and codebook losses, their AdamW
parameter group, ``post_step``) with the uniform token-mean cross-entropy, features looked up before
the step; (p) the whole ``forward`` of (c), features and cached token weights looked up before the
step (added: the weights aligned to the conditioned positions, the six-term stack, the output record);
(c) as in the main table (the feature and weight lookup inside the step). Operators: the fewest over
5 steps (a dead-code restart or the optimizer's first step dispatches more).

Decoder dtype (``--dtype``): the decoder's weights in float32 or bfloat16, the CVAE's heads, latent
parameters, optimizer state and losses float32 in both, as in training; ``auto`` is what training
chooses here (``lm.resolve_dtype``: bfloat16 on CUDA and on a CPU with AMX-BF16 or AVX512-BF16).
``both`` builds both decoders from the same float32 weights and times every case in both dtypes in
one round-robin (each repetition runs all ten steps on the same batch), then prints, besides each
dtype's table, the float32 / bfloat16 time of each case as a ratio of medians and as the median of
the per-repetition (paired) ratios; breakdown and scaling, when asked for, run once per dtype.
The frozen pass's throughput is (e)'s: the batch's real (unpadded) tokens per second, median over
repetitions.

The last line printed is one JSON object: ``model``, ``dtype``, ``c_over_a``, ``c_over_b``, ``d_over_a``,
``e_over_a``, ``m_over_a``, ``n_over_c``, ``c_over_f``, ``a_over_f`` (and ``g_over_c``; with ``--peft``
``b_over_t``, ``c_over_t``, ``d_over_t`` and their paired medians ``..._paired``) (ratios of medians),
``peak_mib`` (``a``-``d``, ``f``, ``m``, ``n`` (and ``g``, ``t``), MiB; null with ``--skip-memory``), ``ms`` (median ms per step of every case) and ``frozen_pass_tokens_per_s``; with ``--dtype both``,
``{"model", "dtypes": {"float32": {...}, "bfloat16": {...}}, "float32_over_bfloat16": {case: ratio}}``
(paired ratios; every case timed). With ``--models``: a JSON list, one record per model.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from disentanglement import testing
from disentanglement.config import ModelConfig, RunConfig, build_config
from disentanglement.cvae_base import CVAEBase, FrozenFeatures
from disentanglement.data import Batch, Example, collate
from disentanglement.features import FeatureCache, build_feature_cache
from disentanglement.flops import DecoderShape, step_flops
from disentanglement.lm import resolve_dtype
from disentanglement.losses import estimate_zfree_reference_scale, reconstruction_loss
from disentanglement.models import build_cvae, enable_activation_checkpointing
from disentanglement.regularizers import beta_at, kl_objective
from disentanglement.trainer import make_optimizer

CASES = ("a", "b", "c", "d", "e", "f", "m", "n")
STEP_CASES = ("a", "b", "c", "d", "f", "m", "n")
CHECKPOINTED = "g"  # as (c) with the decoder's layers checkpointed (--gradient-checkpointing)
PEFT = "t"  # peft prompt tuning on a copy of the decoder (--peft)
MEMORY_CASES = (*CASES, CHECKPOINTED, PEFT)  # what a --measure-memory subprocess can measure
SIZE_CASES = ("f", "a", "c", "e")  # the --models table's cases (plus (g) with --gradient-checkpointing)
DESCRIPTIONS = {
    "a": "prefix tuning: latent vector, uniform CE",
    "b": "CVAE, raw reconstruction only, cached",
    "c": "CVAE, 6 terms + weighting + KL, cached",
    "d": "as (c), frozen pass every step",
    "e": "one no-grad frozen pass alone",
    "f": "decoder alone: fwd + bwd to its inputs",
    "g": "as (c), decoder layers checkpointed",
    "m": "as (a), latent as per-layer K/V memory",
    "n": "as (c), latent as per-layer K/V memory",
    "t": "peft prompt tuning: labels, full logits",
}
TARGET_C_OVER_A = 1.10
TARGET_C_OVER_B = 1.03
MEMORY_STEPS = 2  # steps per memory measurement (the first step's allocations count: optimizer state too)
# Defaults of --repeats / --warmup per model: the embedded model's step takes seconds on 2 cores.
DEFAULT_REPEATS = {"tiny": 20, "embedded": 10, "config": 3}
DEFAULT_WARMUP = {"tiny": 3, "embedded": 2, "config": 1}
CONFIG_PREFIX = "config:"  # --model config:NAME: a decoder of testing.MODEL_SHAPES[NAME], random weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TINY_VOCAB = 1024
TINY_PROMPT_RANGE = (8, 24)  # synthetic prompt lengths, inclusive
TINY_RESPONSE_RANGE = (8, 40)  # synthetic response lengths, inclusive
SCALING_PROMPT = 16
SCALING_LENGTHS = (16, 32, 64, 128)  # response tokens, at TINY_VOCAB
SCALING_LENGTH_VOCAB = TINY_VOCAB
SCALING_VOCABS = (1024, 4096, 16384, 65536)  # at SCALING_VOCAB_LENGTH response tokens
SCALING_VOCAB_LENGTH = 32


# -- models and data ---------------------------------------------------------------------------------------
def model_kind(model: str) -> str:
    """``tiny``, ``embedded`` or ``config`` (``config:NAME``)."""
    return "config" if model.startswith(CONFIG_PREFIX) else model


def model_argument(text: str) -> str:
    """``--model``'s value: ``tiny``, ``embedded`` or ``config:NAME`` with ``NAME`` in ``testing.MODEL_SHAPES``."""
    if text in ("tiny", "embedded"):
        return text
    if text.startswith(CONFIG_PREFIX) and text.removeprefix(CONFIG_PREFIX) in testing.MODEL_SHAPES:
        return text
    known = ", ".join(CONFIG_PREFIX + name for name in testing.MODEL_SHAPES)
    raise argparse.ArgumentTypeError(f"unknown model {text!r}: expected tiny, embedded or one of {known}")


def tiny_llama(vocab_size: int, seed: int = 0) -> nn.Module:
    """The tests' tiny Llama (:func:`disentanglement.testing.tiny_llama`), with room for the scaling lengths."""
    return testing.tiny_llama(vocab_size, seed, max_position_embeddings=512)


def synthetic_examples(
    count: int, vocab_size: int, prompt_range: tuple[int, int], response_range: tuple[int, int], seed: int = 0
) -> list[Example]:
    """Random token ids (3 .. V-1, past the special ids) with a prompt/response split."""
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        p = rng.randint(*prompt_range)
        r = rng.randint(*response_range)
        ids = [rng.randrange(3, vocab_size) for _ in range(p + r)]
        examples.append(Example(ids[:p], ids[p:], None, f"synthetic:#{i}"))
    return examples


def embedded_examples(count: int) -> tuple[nn.Module, list[Example], int]:
    """The embedded SmolLM2-135M (float32 weights) and ``count`` chatterbot pairs (seeded shuffle), chat
    template, default caps."""
    from disentanglement.data import load_chatterbot, tokenize_pairs
    from disentanglement.lm import load_model_and_tokenizer

    decoder, tokenizer = load_model_and_tokenizer(ModelConfig(dtype="float32"))
    pairs = load_chatterbot()
    random.Random(0).shuffle(pairs)
    examples, _ = tokenize_pairs(pairs[:count], tokenizer, build_config().data)
    return decoder, examples, tokenizer.pad_token_id


def batches_of(examples: Sequence[Example], batch_size: int, pad_id: int, device: torch.device) -> list[Batch]:
    """Consecutive batches; ``indices`` are positions in ``examples`` (they index the feature cache)."""
    return [
        collate(examples[i : i + batch_size], pad_id, indices=range(i, i + batch_size)).to(device)
        for i in range(0, len(examples) - batch_size + 1, batch_size)
    ]


# -- the cases -----------------------------------------------------------------------------------------
def cvae_config(kind: str, c_base: float | None = None, placement: str = "prefix") -> RunConfig:
    """(b): raw reconstruction only; (c)/(d): all six terms, token weighting and a constant beta; the latent
    placed as ``placement`` (``memory`` for (m) and (n))."""
    if kind == "b":
        return build_config(
            {
                "preset": "raw",  # term 1 only, the mean view
                "beta": 0.0,
                "beta_schedule": "constant",
                "latent_placement": placement,
            }
        )
    return build_config(
        {
            "preset": "raw",  # the mean encoder view, as measured (the defaults before issue 23)
            "latent_placement": placement,
            "reconstruction_weight": 1.0,
            "sequence_reconstruction_weight": 1.0,
            "token_weighted_weight": 1.0,
            "normalized_concentration_corrected_token_weighted_weight": 1.0,
            "normalized_inverse_surprisal_token_weighted_weight": 1.0,
            "zfree_relative_weight": 1.0,
            "token_weight_alpha": 1.0,
            "zfree_reference_scale": c_base,
            "beta": 0.02,
            "beta_schedule": "constant",
        }
    )


def seeded_cvae(config: RunConfig, decoder: nn.Module, device: torch.device) -> CVAEBase:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_cvae(config, decoder).to(device)
    return model.train()


Step = Callable[[Batch], None]


def prefix_tuning_step(model: CVAEBase, config: RunConfig) -> Step:
    """(a): a trainable latent vector through the model's own ``decode``; uniform token-mean CE."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vector = nn.Parameter(torch.randn(model.latent_vector_dim, device=model.latent_projection.weight.device))
    params = [vector, *model.latent_projection.parameters()]
    if model.latent_memory is not None:  # (m): the memory's projection trains with the slots
        params += list(model.latent_memory.parameters())
    # The trainer's optimizer settings (AdamW; its foreach/fused choice too), over these parameters only.
    reference = make_optimizer(model, config)
    settings = {k: reference.defaults[k] for k in ("foreach", "fused") if k in reference.defaults}
    optimizer = type(reference)(params, lr=config.train.latent_lr, weight_decay=config.train.weight_decay, **settings)

    def step(batch: Batch) -> None:
        decoded = model.decode(batch, vector.unsqueeze(0).expand(len(batch), -1))
        loss = reconstruction_loss(decoded.token_nll(), decoded.target_mask[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def cvae_step(
    model: CVAEBase,
    config: RunConfig,
    cache: FeatureCache | None,
    prefetched: dict[int, FrozenFeatures] | None = None,
) -> Step:
    """(b)-(d): ``forward`` (cached features, or the frozen pass inside it), backward, AdamW, ``post_step``.

    With ``prefetched`` (breakdown (p)) the batch's features come ready: ``prefetched[id(batch)]``.
    """
    optimizer = make_optimizer(model, config)
    counter = [0]

    def step(batch: Batch) -> None:
        if prefetched is not None:
            features = prefetched[id(batch)]
        else:
            features = cache.features(batch, model.weighting_params) if cache is not None else None
        out = model(batch, features, step=counter[0])
        out.loss.backward()
        optimizer.step()
        model.post_step(counter[0])
        optimizer.zero_grad(set_to_none=True)
        counter[0] += 1

    return step


def decoder_step(decoder: nn.Module) -> Step:
    """(f): the decoder's own forward and backward, the yardstick of "grows no faster than the decoder".

    Its token embeddings of ``[x][y]`` as a leaf that requires grad (so that the backward runs through
    every layer to the input, as the frozen decoder's backward runs to the latent), the full ``[B, T, V]``
    logits, float32 cross-entropy over the response tokens; no latent, no optimizer (nothing of the
    decoder's trains: it is the frozen decoder of every case).
    """
    embeddings = decoder.get_input_embeddings()

    def step(batch: Batch) -> None:
        embeds = embeddings(batch.input_ids).detach().requires_grad_(True)  # [B, T, H]
        logits = decoder(inputs_embeds=embeds, attention_mask=batch.attention_mask, use_cache=False).logits
        targets = batch.input_ids[:, 1:].masked_fill(batch.target_mask[:, 1:] == 0, -100)  # [B, T-1]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        loss.backward()

    return step


def peft_step(decoder: nn.Module, config: RunConfig, model_b: CVAEBase) -> Step:
    """(t): peft prompt tuning with ``config.latent.latent_tokens`` virtual tokens on a copy of ``decoder``
    (peft wraps the model it is given; the other cases' decoder stays untouched): the standard forward with
    ``labels`` and full logits, AdamW at ``latent_lr`` (as ``benchmarks/peers/peers.py``'s peft system)."""
    from peft import PromptTuningConfig, TaskType, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft_config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=config.latent.latent_tokens)
        model = get_peft_model(copy.deepcopy(decoder), peft_config)
    # AdamW as peers.py's peft system, with the trainer's foreach/fused settings as the other cases
    reference = make_optimizer(model_b, config)
    settings = {k: reference.defaults[k] for k in ("foreach", "fused") if k in reference.defaults}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.train.latent_lr, **settings)

    def step(batch: Batch) -> None:
        labels = batch.input_ids.masked_fill(batch.target_mask == 0, -100)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.model = model  # for the tests
    return step


def checkpointed_step(step: Step, decoder: nn.Module) -> Step:
    """(g): ``step`` with the shared decoder's layers checkpointed (``models.enable_activation_checkpointing``)
    for its duration; the other cases run on the same decoder without."""

    def run(batch: Batch) -> None:
        enable_activation_checkpointing(decoder)
        try:
            step(batch)
        finally:
            decoder.activation_checkpointing_disable()

    return run


def latent_heads_step(model: CVAEBase, config: RunConfig, features: dict[int, FrozenFeatures]) -> Step:
    """Breakdown (h): the latent heads, KL and auxiliary losses with the uniform cross-entropy; no token
    weighting, no stack; the batch's features come ready (``features[id(batch)]``)."""
    optimizer = make_optimizer(model, config)
    counter = [0]

    def step(batch: Batch) -> None:
        sample = model.encode(features[id(batch)], counter[0])
        decoded = model.decode(batch, sample.vector)
        loss = reconstruction_loss(decoded.token_nll(), decoded.target_mask[:, 1:])
        beta = beta_at(counter[0], model.kl_cfg)
        kl_term, _ = kl_objective(sample.kl_per_unit, batch.response_lengths, model.kl_cfg, beta)
        loss = loss + kl_term + sum(sample.aux_losses.values())
        loss.backward()
        optimizer.step()
        model.post_step(counter[0])
        optimizer.zero_grad(set_to_none=True)
        counter[0] += 1

    return step


class OperatorCount(TorchDispatchMode):
    """Counts the ATen operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def operators_per_step(step: Step, batches: Sequence[Batch], count: int = 5) -> int:
    """The fewest ATen operators over ``count`` steps: the usual step (a dead-code restart in
    ``post_step``, or the optimizer's first step, dispatches more)."""
    counts = []
    for i in range(count):
        with OperatorCount() as counter:
            step(batches[i % len(batches)])
        counts.append(counter.count)
    return min(counts)


def breakdown(args: argparse.Namespace, dtype: torch.dtype) -> None:
    """(a) -> (h) -> (p) -> (c): what each part of the CVAE step adds over prefix tuning."""
    setup = build_setup(args, n_batches=max(1, min(args.repeats, 20)), cases=("a", "c"), dtype=dtype)
    model_c = seeded_cvae(setup.config_c, setup.decoder, setup.device)
    features = {id(b): setup.cache.features(b, model_c.weighting_params) for b in setup.batches}
    steps = {
        "a": setup.steps["a"],
        "h": with_autocast(latent_heads_step(model_c, setup.config_c, features), setup.device),
        "p": with_autocast(
            cvae_step(seeded_cvae(setup.config_c, setup.decoder, setup.device), setup.config_c, None, features),
            setup.device,
        ),
        "c": setup.steps["c"],
    }
    labels = {
        "a": "prefix tuning (as the main table)",
        "h": "+ latent heads, KL, their AdamW group",
        "p": "+ cached weights aligned, 6-term stack",
        "c": "+ feature lookup in the step = (c)",
    }
    batches = setup.batches
    times = time_round_robin(
        steps, lambda name, rep: batches[rep % len(batches)], args.repeats, args.warmup, setup.device
    )
    ms = {name: 1000 * median(values) for name, values in times.items()}
    ops = {name: operators_per_step(step, batches) for name, step in steps.items()}
    print(f"\nBreakdown, model {args.model}, decoder {dtype_name(dtype)}: each row adds one part to the one above")
    print(
        f"  {'step':<42}{'median ms':>10}{'q1-q3 ms':>18}{'/ (a)':>8}{'paired':>8}{'+ ms':>8}"
        f"{'ATen ops':>10}{'+ ops':>7}"
    )
    previous = None
    for name, label in labels.items():
        q1, q3 = quartiles(times[name])
        added = "" if previous is None else f"{ms[name] - ms[previous]:.2f}"
        added_ops = "" if previous is None else f"{ops[name] - ops[previous]:+d}"
        print(
            f"  ({name}) {label:<38}{ms[name]:>10.2f}{f'{1000 * q1:.2f}-{1000 * q3:.2f}':>18}"
            f"{ms[name] / ms['a']:>8.3f}{paired_ratio(times[name], times['a']):>8.3f}{added:>8}"
            f"{ops[name]:>10}{added_ops:>7}"
        )
        previous = name


def frozen_pass_step(model: CVAEBase) -> Step:
    """(e): one no-grad frozen pass."""

    def step(batch: Batch) -> None:
        model.frozen_pass(batch)

    return step


@dataclass
class Setup:
    model_name: str
    device: torch.device
    batches: list[Batch]
    steps: dict[str, Step]
    c_base: float
    mean_prompt: float
    mean_response: float
    mean_width: float  # mean padded z-free length T of the batches
    vocab_size: int
    hidden_size: int
    decoder: nn.Module
    cache: FeatureCache
    config_c: RunConfig
    dtype: torch.dtype


Loaded = tuple[nn.Module, list[Example], int]  # float32 decoder, examples, pad id


def load_decoder(args: argparse.Namespace, n_batches: int, dtype: torch.dtype = torch.float32) -> Loaded:
    """The decoder of ``args.model`` and ``batch_size * n_batches`` examples: float32 weights, except for
    ``config:NAME``, built in ``dtype`` directly on the benchmark's device (random weights, synthetic
    token ids of the tiny model's prompt and response lengths)."""
    count = args.batch_size * n_batches
    if model_kind(args.model) == "config":
        name = args.model.removeprefix(CONFIG_PREFIX)
        decoder = testing.random_llama(name, dtype=dtype, device=choose_device(args.device))
        vocab = testing.MODEL_SHAPES[name]["vocab_size"]
        return decoder, synthetic_examples(count, vocab, TINY_PROMPT_RANGE, TINY_RESPONSE_RANGE), 2
    if args.model == "tiny":
        examples = synthetic_examples(count, TINY_VOCAB, TINY_PROMPT_RANGE, TINY_RESPONSE_RANGE)
        return tiny_llama(TINY_VOCAB), examples, 2
    return embedded_examples(count)


def build_setup(
    args: argparse.Namespace,
    n_batches: int,
    cases: Sequence[str] = CASES,
    dtype: torch.dtype = torch.float32,
    loaded: Loaded | None = None,
) -> Setup:
    """The decoder in ``dtype`` (from float32 weights, ``loaded`` or loaded here), ``n_batches`` batches,
    the feature cache over them, and one step function per case."""
    device = choose_device(args.device)
    decoder, examples, pad_id = loaded if loaded is not None else load_decoder(args, n_batches, dtype)
    if loaded is not None and dtype != decoder.get_input_embeddings().weight.dtype:
        decoder = copy.deepcopy(decoder)  # the caller's decoder stays as it is
    # As the trainer: decoder weights in the configured dtype (plus bf16 autocast on CUDA); heads float32.
    decoder = decoder.to(device=device, dtype=dtype)
    batches = batches_of(examples, args.batch_size, pad_id, device)

    model_b = seeded_cvae(cvae_config("b"), decoder, device)
    cache = build_feature_cache(model_b, examples, pad_id, batch_size=args.batch_size, device=device, progress=False)
    c_base = estimate_zfree_reference_scale(cache.example_base_losses())
    config_b, config_c = cvae_config("b"), cvae_config("c", c_base)
    steps: dict[str, Step] = {}
    if "a" in cases:
        steps["a"] = prefix_tuning_step(seeded_cvae(config_b, decoder, device), config_b)
    if "b" in cases:
        steps["b"] = cvae_step(model_b, config_b, cache)
    if "c" in cases or "e" in cases:
        model_c = seeded_cvae(config_c, decoder, device)
        steps["c"] = cvae_step(model_c, config_c, cache)
        steps["e"] = frozen_pass_step(model_c)
    if "d" in cases:
        steps["d"] = cvae_step(seeded_cvae(config_c, decoder, device), config_c, None)
    if "f" in cases:
        steps["f"] = decoder_step(decoder)
    if CHECKPOINTED in cases:
        model_g = seeded_cvae(config_c, decoder, device)
        steps[CHECKPOINTED] = checkpointed_step(cvae_step(model_g, config_c, cache), decoder)
    if PEFT in cases:
        steps[PEFT] = peft_step(decoder, config_b, model_b)
    if "m" in cases:
        config_m = cvae_config("b", placement="memory")
        steps["m"] = prefix_tuning_step(seeded_cvae(config_m, decoder, device), config_m)
    if "n" in cases:
        config_n = cvae_config("c", c_base, placement="memory")
        steps["n"] = cvae_step(seeded_cvae(config_n, decoder, device), config_n, cache)
    return Setup(
        model_name=args.model,
        device=device,
        batches=batches,
        steps={case: with_autocast(steps[case], device) for case in cases},
        c_base=c_base,
        mean_prompt=statistics.fmean(len(e.prompt_ids) for e in examples),
        mean_response=statistics.fmean(len(e.response_ids) for e in examples),
        mean_width=statistics.fmean(b.input_ids.shape[1] for b in batches),
        vocab_size=decoder.get_output_embeddings().weight.shape[0],
        hidden_size=decoder.get_input_embeddings().weight.shape[1],
        decoder=decoder,
        cache=cache,
        config_c=config_c,
        dtype=dtype,
    )


# -- useful FLOPs, matmul rates, MFU and the profile ------------------------------------------------------
# Cases whose useful FLOPs flops.step_flops counts: (latent positions, backward, frozen pass in the step).
# (f) scores the response tokens usefully, though it computes full logits; (g) recomputes the forward (not useful).
FLOP_CASES = {
    "a": (True, True, False),
    "b": (True, True, False),
    "c": (True, True, False),
    "d": (True, True, True),
    "e": (False, False, False),
    "f": (False, True, False),
    "g": (True, True, False),
}


def useful_flops(setup: Setup, case: str) -> dict[str, float] | None:
    """Mean useful FLOPs per step of ``case`` over the setup's batches (``flops.step_flops``), by part."""
    if case not in FLOP_CASES or setup.config_c.latent.latent_placement == "memory":
        return None
    latent, backward, frozen = FLOP_CASES[case]
    shape = DecoderShape.from_config(setup.decoder.config)
    per_batch = [
        step_flops(
            shape,
            b.prompt_lengths.tolist(),
            b.response_lengths.tolist(),
            setup.config_c.latent.latent_tokens if latent else 0,
            backward=backward,
            frozen_pass=frozen,
        )
        for b in setup.batches
    ]
    return {key: statistics.fmean(f.get(key, 0) for f in per_batch) for key in per_batch[0]}


def matmul_rate(setup: Setup, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of ``torch.matmul`` in ``dtype`` at the step's own shapes (:func:`matmul_rate_at` with ``M`` =
    batch x mean padded positions, latent included, and the head over the batch's response positions)."""
    latent = setup.config_c.latent.latent_tokens
    rows = round(len(setup.batches[0]) * (setup.mean_width + latent))
    head_rows = round(len(setup.batches[0]) * setup.mean_response)
    shape = DecoderShape.from_config(setup.decoder.config)
    return matmul_rate_at(shape, rows, head_rows, dtype, setup.device, repeats)


def matmul_rate_at(
    shape: DecoderShape, rows: int, head_rows: int, dtype: torch.dtype, device: torch.device, repeats: int = 5
) -> float:
    """FLOP/s of ``torch.matmul`` in ``dtype``: every linear layer's forward ``[rows, in] x [in, out]`` and
    input-gradient ``[rows, out] x [out, in]``, and the LM head ``[head_rows, H] x [H, V]``, each timed (the
    fastest of ``repeats``) and weighted by how often a step runs it."""
    # (m, k, n, times per step)
    shapes = [(rows, i, o, shape.layers) for i, o in shape.linear_shapes()]
    shapes += [(rows, o, i, shape.layers) for i, o in shape.linear_shapes()]
    shapes += [(head_rows, shape.hidden, shape.vocab, 2)]
    total_flops = total_seconds = 0.0
    generator = torch.Generator(device=device).manual_seed(0)
    for m, k, n, count in shapes:
        a = torch.randn(m, k, generator=generator, device=device).to(dtype)
        b = torch.randn(k, n, generator=generator, device=device).to(dtype)
        torch.matmul(a, b)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            torch.matmul(a, b)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        total_flops += 2 * m * k * n * count
        total_seconds += best * count
    return total_flops / total_seconds


def mfu_table(setup: Setup, times: dict[str, list[float]], flop_case: str | None = None) -> dict:
    """Beside each case's median time: its useful GFLOP per step, the rate it reaches, and that rate over
    torch.matmul's bf16 and float32 rates at the step's shapes (an MFU). ``flop_case``: count every row's
    FLOPs as that case's (rows that are variants of one case)."""
    rates = {"bfloat16": matmul_rate(setup, torch.bfloat16), "float32": matmul_rate(setup, torch.float32)}
    print(
        f"matmul rate at the step's shapes (torch.matmul, {torch.get_num_threads()} threads): "
        f"bf16 {rates['bfloat16'] / 1e9:.1f} GFLOP/s, float32 {rates['float32'] / 1e9:.1f} GFLOP/s"
    )
    print(f"{'case':<5}{'median ms':>10}{'GFLOP':>9}{'GFLOP/s':>9}{'MFU bf16':>10}{'MFU f32':>9}   useful FLOPs")
    out = {}
    for case, values in times.items():
        flops = useful_flops(setup, flop_case or case)
        if flops is None:
            continue
        seconds = median(values)
        achieved = flops["total"] / seconds
        parts = ", ".join(
            f"{part} {100 * flops[part] / flops['total']:.0f}%"
            for part in ("forward", "backward", "frozen_pass")
            if flops.get(part)
        )
        head = sum(flops.get(f"{p}_head", 0) for p in ("forward", "backward", "frozen_pass"))
        attention = sum(flops.get(f"{p}_attention", 0) for p in ("forward", "backward", "frozen_pass"))
        print(
            f"({case})  {1000 * seconds:>10.2f}{flops['total'] / 1e9:>9.3f}{achieved / 1e9:>9.1f}"
            f"{100 * achieved / rates['bfloat16']:>9.1f}%{100 * achieved / rates['float32']:>8.1f}%   "
            f"{parts}; head {100 * head / flops['total']:.0f}%, attention {100 * attention / flops['total']:.0f}%"
        )
        out[case] = {
            "gflop": round(flops["total"] / 1e9, 4),
            "mfu_bf16": round(achieved / rates["bfloat16"], 4),
            "mfu_f32": round(achieved / rates["float32"], 4),
        }
    return {"matmul_gflops": {k: round(v / 1e9, 2) for k, v in rates.items()}, "cases": out}


PROFILE_GROUPS = ("decoder matmuls", "LM head", "attention", "optimizer", "other operators", "outside operators")


def profile_breakdown(setup: Setup, case: str = "c", steps: int = 3) -> dict[str, float]:
    """Where ``case``'s step time goes, from ``torch.profiler`` over ``steps`` steps (after one untimed):
    operators' own (self) CPU time grouped as matmuls of the decoder (and the small heads), anything with the
    vocabulary as a dimension (the LM head's chunks: matmul, log-softmax, gather), attention kernels, the
    optimizer (under ``Optimizer.step`` / ``zero_grad``), other operators; and the wall time outside any
    operator (Python, autograd bookkeeping). Milliseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    step, batches = setup.steps[case], setup.batches
    step(batches[0])
    vocab = setup.vocab_size
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step(batches[i % len(batches)])
        wall = time.perf_counter() - start
    groups = dict.fromkeys(PROFILE_GROUPS, 0.0)
    others: dict[str, list[float]] = {}  # the "other operators" by name: [seconds, calls]
    for event in prof.events():
        if event.self_cpu_time_total <= 0:
            continue
        parent, in_optimizer = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("Optimizer."):
                in_optimizer = True
                break
            parent = parent.cpu_parent
        if event.name.startswith("Optimizer."):
            continue  # its own self time is the Python around the foreach kernels: counted below as outside
        shapes = [d for shape in (event.input_shapes or []) for d in (shape or [])]
        name = event.name
        if in_optimizer:
            group = "optimizer"
        elif vocab in shapes:
            group = "LM head"
        elif "attention" in name or "scaled_dot_product" in name:
            group = "attention"
        elif name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"):
            group = "decoder matmuls"
        else:
            group = "other operators"
            other = others.setdefault(name, [0.0, 0])
            other[0] += event.self_cpu_time_total / 1e6
            other[1] += 1
        groups[group] += event.self_cpu_time_total / 1e6
    operators = sum(groups.values())
    groups["outside operators"] = max(0.0, wall - operators)
    total = wall / steps
    print(f"profile of ({case}) over {steps} steps ({1000 * total:.1f} ms per step, torch.profiler, self CPU time):")
    for name in PROFILE_GROUPS:
        ms = 1000 * groups[name] / steps
        print(f"  {name:<20}{ms:>10.1f} ms  {100 * groups[name] / wall:>5.1f}%")
    top = sorted(others.items(), key=lambda item: -item[1][0])[:8]
    print("  other operators by self time: " + ", ".join(
        f"{name.removeprefix('aten::')} {1000 * t / steps:.0f} ms ({n // steps} calls)" for name, (t, n) in top
    ))  # fmt: skip
    return {name: round(1000 * groups[name] / steps, 2) for name in PROFILE_GROUPS}


# -- timing --------------------------------------------------------------------------------------------
def choose_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def with_autocast(step: Step, device: torch.device) -> Step:
    """On CUDA, the step under bf16 autocast (the trainer's ``mixed_precision="bf16"``); unchanged on CPU."""
    if device.type != "cuda":
        return step

    def autocast_step(batch: Batch) -> None:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            step(batch)

    return autocast_step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(
    steps: dict[str, Step],
    batches_for: Callable[[str, int], Batch],
    repeats: int,
    warmup: int,
    device: torch.device,
) -> dict[str, list[float]]:
    """Seconds per step of each case; every repetition runs each case once, the first case rotating."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            batch = batches_for(name, rep)
            synchronize(device)
            start = time.perf_counter()
            steps[name](batch)
            synchronize(device)
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over repetitions of ``num[i] / den[i]`` (same batch, adjacent in time)."""
    return median([n / d for n, d in zip(num, den, strict=True)])


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = t0 + k x``: ``(t0, k, max |residual| / y)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    t0 = my - k * mx
    worst = max(abs(y - (t0 + k * x)) / y for x, y in zip(xs, ys, strict=True))
    return t0, k, worst


# -- peak memory ---------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release_freed_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


class RssSampler:
    """Fallback: the largest ``VmRSS`` seen by a thread polling every millisecond (a lower bound)."""

    def __init__(self) -> None:
        self.peak_kib = _status_kib("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))
            time.sleep(0.001)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))


def measure_memory_here(args: argparse.Namespace, case: str) -> dict:
    """In a fresh process: the same decoder and first batches, then the peak RSS growth over a few steps."""
    setup = build_setup(args, MEMORY_STEPS, cases=(case,), dtype=DTYPES[args.dtype])
    step = setup.steps[case]
    _release_freed_memory()
    baseline = _status_kib("VmRSS")
    if _reset_high_water_mark():
        method = "VmHWM after clear_refs"
        for batch in setup.batches:
            step(batch)
        peak = _status_kib("VmHWM")
    else:
        method = "VmRSS sampled every 1 ms"
        with RssSampler() as sampler:
            for batch in setup.batches:
                step(batch)
        peak = sampler.peak_kib
    return {"case": case, "peak_mib": (peak - baseline) / 1024, "baseline_mib": baseline / 1024, "method": method}


def measure_memory_subprocesses(
    args: argparse.Namespace, dtype: torch.dtype, cases: Sequence[str] = CASES
) -> tuple[dict[str, float | None], str]:
    """Peak MiB of each of ``cases``, each in a fresh subprocess of this script."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    peaks: dict[str, float | None] = {}
    method = ""
    for case in cases:
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--model",
            args.model,
            "--batch-size",
            str(args.batch_size),
            "--device",
            "cpu",
            "--dtype",
            dtype_name(dtype),
            "--measure-memory",
            case,
        ]
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = result.stdout.strip().splitlines()
        if result.returncode != 0 or not lines:
            print(f"  memory of ({case}) failed (exit {result.returncode}): {result.stderr.strip()[-500:]}")
            peaks[case] = None
            continue
        record = json.loads(lines[-1])
        peaks[case] = record["peak_mib"]
        method = f"{record['method']}; RSS after setup {record['baseline_mib']:.0f} MiB"
    return peaks, method


def measure_memory_cuda(setup: Setup) -> tuple[dict[str, float | None], str]:
    peaks: dict[str, float | None] = {}
    batches = setup.batches[:MEMORY_STEPS]
    for case, step in setup.steps.items():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        for batch in batches:
            step(batch)
        torch.cuda.synchronize()
        peaks[case] = (torch.cuda.max_memory_allocated() - baseline) / 2**20
    return peaks, "torch.cuda.max_memory_allocated - allocated before the steps"


# -- scaling -------------------------------------------------------------------------------------------
def scaling(args: argparse.Namespace, dtype: torch.dtype) -> None:
    """(c) and (a) against response length and vocabulary size on the tiny model (no padding)."""
    device = choose_device(args.device)
    n_batches = max(1, min(args.repeats, 4))
    points: list[tuple[str, int, int]] = [("length", r, SCALING_LENGTH_VOCAB) for r in SCALING_LENGTHS]
    points += [("vocab", SCALING_VOCAB_LENGTH, v) for v in SCALING_VOCABS]
    steps: dict[str, Step] = {}
    batches: dict[str, list[Batch]] = {}
    decoders: dict[int, nn.Module] = {}
    for kind, length, vocab in points:
        if vocab not in decoders:
            decoders[vocab] = tiny_llama(vocab).to(device=device, dtype=dtype)
        decoder = decoders[vocab]
        span = (SCALING_PROMPT, SCALING_PROMPT)
        examples = synthetic_examples(args.batch_size * n_batches, vocab, span, (length, length), seed=length)
        point_batches = batches_of(examples, args.batch_size, 2, device)
        model_c = seeded_cvae(cvae_config("b"), decoder, device)
        cache = build_feature_cache(model_c, examples, 2, batch_size=args.batch_size, device=device, progress=False)
        config_c = cvae_config("c", estimate_zfree_reference_scale(cache.example_base_losses()))
        config_a = cvae_config("b")
        for case, step in (
            ("c", cvae_step(seeded_cvae(config_c, decoder, device), config_c, cache)),
            ("a", prefix_tuning_step(seeded_cvae(config_a, decoder, device), config_a)),
        ):
            name = f"{kind}:{length}:{vocab}:{case}"
            steps[name] = with_autocast(step, device)
            batches[name] = point_batches
    times = time_round_robin(steps, lambda name, rep: batches[name][rep % n_batches], args.repeats, args.warmup, device)
    ms = {name: 1000 * median(values) for name, values in times.items()}

    B = args.batch_size
    print(
        f"\nScaling, tiny Llama (hidden 32, 2 layers, {dtype_name(dtype)}), case (c) and (a), B={B}, "
        f"prompt {SCALING_PROMPT} tokens"
    )
    print(f"response length at V={SCALING_LENGTH_VOCAB} (B*T = tokens per batch, z-free):")
    print(f"  {'resp':>5} {'B*T':>6} {'(c) ms':>9} {'us/token':>9} {'marginal us/token':>18} {'(a) ms':>9} {'c/a':>6}")
    xs, ys = [], []
    previous = None
    for length in SCALING_LENGTHS:
        c = ms[f"length:{length}:{SCALING_LENGTH_VOCAB}:c"]
        a = ms[f"length:{length}:{SCALING_LENGTH_VOCAB}:a"]
        tokens = B * (SCALING_PROMPT + length)
        marginal = "" if previous is None else f"{1000 * (c - previous[1]) / (tokens - previous[0]):.2f}"
        print(f"  {length:>5} {tokens:>6} {c:>9.2f} {1000 * c / tokens:>9.2f} {marginal:>18} {a:>9.2f} {c / a:>6.3f}")
        xs.append(tokens)
        ys.append(c)
        previous = (tokens, c)
    t0, k, worst = linear_fit(xs, ys)
    print(f"  fit (c): t = {t0:.2f} ms + {1000 * k:.3f} us x (B*T); largest residual {100 * worst:.1f}% of t")
    print(f"vocabulary size at response length {SCALING_VOCAB_LENGTH}:")
    print(f"  {'V':>6} {'(c) ms':>9} {'ms per 1k V':>12} {'marginal ms/1k V':>17} {'(a) ms':>9} {'c/a':>6}")
    xs, ys = [], []
    previous = None
    for vocab in SCALING_VOCABS:
        c = ms[f"vocab:{SCALING_VOCAB_LENGTH}:{vocab}:c"]
        a = ms[f"vocab:{SCALING_VOCAB_LENGTH}:{vocab}:a"]
        marginal = "" if previous is None else f"{1000 * (c - previous[1]) / (vocab - previous[0]):.3f}"
        print(f"  {vocab:>6} {c:>9.2f} {1000 * c / vocab:>12.3f} {marginal:>17} {a:>9.2f} {c / a:>6.3f}")
        xs.append(vocab)
        ys.append(c)
        previous = (vocab, c)
    t0, k, worst = linear_fit(xs, ys)
    print(f"  fit (c): t = {t0:.2f} ms + {1000 * k:.4f} ms x (V / 1000); largest residual {100 * worst:.1f}% of t")


# -- main ----------------------------------------------------------------------------------------------
def load_text() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} cores"


def check(label: str, value: float, bound: float) -> str:
    verdict = "PASS" if value <= bound else "FAIL"
    return f"  {label} = {value:.3f}  (target <= {bound:.3f})  {verdict}"


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]


def frozen_pass_throughput(setup: Setup, seconds: Sequence[float], warmup: int) -> float:
    """(e)'s real (unpadded) tokens per second, median over repetitions (repetition i ran on batch
    ``(warmup + i) mod len(batches)``)."""
    tokens = [int(b.attention_mask.sum()) for b in setup.batches]
    return median([tokens[(warmup + i) % len(tokens)] / value for i, value in enumerate(seconds)])


def peak_memory(args: argparse.Namespace, setup: Setup, cases: Sequence[str]) -> tuple[dict[str, float | None], str]:
    """Peak MiB of ``cases`` (CPU: a subprocess each; CUDA: here), or ``None``s with ``--skip-memory``."""
    if args.skip_memory:
        return dict.fromkeys(cases), "skipped"
    if setup.device.type == "cuda":
        return measure_memory_cuda(setup)
    return measure_memory_subprocesses(args, setup.dtype, cases)


def report(args: argparse.Namespace, setup: Setup, times: dict[str, list[float]]) -> dict:
    """One dtype's table (times per case from the shared round-robin), its targets and peak memory; its summary."""
    cases = list(times)  # CASES, and (g) with --gradient-checkpointing, (t) with --peft
    ms = {case: 1000 * median(values) for case, values in times.items()}
    ratio = {case: ms[case] / ms["a"] for case in cases}
    paired = {case: paired_ratio(times[case], times["a"]) for case in cases}
    throughput = frozen_pass_throughput(setup, times["e"], args.warmup)
    peaks, memory_method = peak_memory(args, setup, cases)

    print(f"\ndecoder {dtype_name(setup.dtype)}:")
    print(f"{'case':<5}{'':<42}{'median ms':>10}{'q1-q3 ms':>18}{'/ (a)':>8}{'paired':>8}{'peak MiB':>10}")
    for case in cases:
        q1, q3 = quartiles(times[case])
        peak = peaks.get(case)
        peak_text = "-" if peak is None else f"{peak:.1f}"
        print(
            f"({case})  {DESCRIPTIONS[case]:<42}{ms[case]:>10.2f}{f'{1000 * q1:.2f}-{1000 * q3:.2f}':>18}"
            f"{ratio[case]:>8.3f}{paired[case]:>8.3f}{peak_text:>10}"
        )
    print(f"peak memory: {memory_method}")
    print(f"frozen pass (e): {throughput:.0f} tokens/s (real tokens of the batch, median over repetitions)")
    mfu = mfu_table(setup, times)
    profiled = profile_breakdown(setup) if args.profile else None

    c_over_b = ms["c"] / ms["b"]
    print("targets (ratios of medians; paired medians in brackets):")
    print(check("(c)/(a)", ratio["c"], TARGET_C_OVER_A) + f"  [{paired['c']:.3f}]")
    print(check("(c)/(b)", c_over_b, TARGET_C_OVER_B) + f"  [{paired_ratio(times['c'], times['b']):.3f}]")
    print(check("(d)/(a)", ratio["d"], 1 + ratio["e"]) + f"  [{paired['d']:.3f}]  (bound = 1 + (e)/(a))")
    extra = (ms["d"] - ms["c"]) / ms["e"]
    print(f"  (d) - (c) = {ms['d'] - ms['c']:.2f} ms = {extra:.2f} x (e) ({ms['e']:.2f} ms, one no-grad frozen pass)")
    print("memory placement beside the prefix (ratios of medians; paired medians in brackets):")
    print(
        f"  (m)/(a) = {ratio['m']:.3f}  [{paired['m']:.3f}]   (n)/(c) = {ms['n'] / ms['c']:.3f}  [{paired_ratio(times['n'], times['c']):.3f}]"
    )
    c_over_f = ms["c"] / ms["f"]
    print(
        f"beside the decoder's own forward + backward (f): (c)/(f) = {c_over_f:.3f}  "
        f"[{paired_ratio(times['c'], times['f']):.3f}]   (a)/(f) = {ms['a'] / ms['f']:.3f}  "
        f"[{paired_ratio(times['a'], times['f']):.3f}]"
    )
    extra = {}
    if CHECKPOINTED in times:
        g_over_c = ms[CHECKPOINTED] / ms["c"]
        print(
            f"activation checkpointing: (g)/(c) = {g_over_c:.3f}  [{paired_ratio(times['g'], times['c']):.3f}]"
            + (
                ""
                if peaks.get("g") is None or peaks.get("c") is None
                else f", peak {peaks['c']:.1f} -> {peaks['g']:.1f} MiB"
            )
        )
        extra = {"g_over_c": round(g_over_c, 4)}
    if PEFT in times:
        paired_t = {case: paired_ratio(times[case], times[PEFT]) for case in ("b", "c", "d")}
        print(
            f"beside peft prompt tuning (t): (c)/(t) = {ms['c'] / ms[PEFT]:.3f}  [{paired_t['c']:.3f}]   "
            f"(b)/(t) = {ms['b'] / ms[PEFT]:.3f}  [{paired_t['b']:.3f}]   (cached features; <= 1: no slower)   "
            f"(d)/(t) = {ms['d'] / ms[PEFT]:.3f}  [{paired_t['d']:.3f}]   (frozen pass in the step)"
        )
        extra |= {f"{case}_over_t": round(ms[case] / ms[PEFT], 4) for case in ("b", "c", "d")}
        extra |= {f"{case}_over_t_paired": round(value, 4) for case, value in paired_t.items()}
    return {
        "model": args.model,
        "dtype": dtype_name(setup.dtype),
        "c_over_a": round(ratio["c"], 4),
        "c_over_b": round(c_over_b, 4),
        "d_over_a": round(ratio["d"], 4),
        "e_over_a": round(ratio["e"], 4),
        "m_over_a": round(ratio["m"], 4),
        "n_over_c": round(ms["n"] / ms["c"], 4),
        "c_over_f": round(c_over_f, 4),
        "a_over_f": round(ms["a"] / ms["f"], 4),
        **extra,
        "peak_mib": {case: None if peaks.get(case) is None else round(peaks[case], 1) for case in cases if case != "e"},
        "ms": {case: round(ms[case], 3) for case in cases},
        "frozen_pass_tokens_per_s": round(throughput, 1),
        "mfu": mfu,
        **({"profile_ms": profiled} if profiled is not None else {}),
    }


def model_sizes(args: argparse.Namespace, dtype: torch.dtype, repeats: int | None, warmup: int | None) -> list[dict]:
    """``--models``: per model, cases (f), (a), (c), (e) (and (g)) in one round-robin on its own decoder and
    batches, then one table against the decoder's size. Returns one record per model."""
    cases = (*SIZE_CASES, CHECKPOINTED) if args.gradient_checkpointing else SIZE_CASES
    rows = []
    started = time.perf_counter()
    for model in args.models:
        margs = copy.copy(args)
        margs.model = model
        margs.repeats = DEFAULT_REPEATS[model_kind(model)] if repeats is None else repeats
        margs.warmup = DEFAULT_WARMUP[model_kind(model)] if warmup is None else warmup
        n_batches = max(1, margs.repeats)
        setup = build_setup(margs, n_batches, cases, dtype=dtype, loaded=load_decoder(margs, n_batches, dtype))
        batches = setup.batches
        times = time_round_robin(
            setup.steps, lambda name, rep, b=batches: b[rep % len(b)], margs.repeats, margs.warmup, setup.device
        )
        ms = {case: 1000 * median(values) for case, values in times.items()}
        peaks, method = peak_memory(margs, setup, [case for case in cases if case != "e"])
        row = {
            "model": model,
            "parameters": testing.parameter_count(setup.decoder),
            "dtype": dtype_name(dtype),
            "ms": {case: round(value, 1) for case, value in ms.items()},
            "c_over_f": round(paired_ratio(times["c"], times["f"]), 4),
            "a_over_f": round(paired_ratio(times["a"], times["f"]), 4),
            "frozen_pass_tokens_per_s": round(frozen_pass_throughput(setup, times["e"], margs.warmup), 1),
            "train_tokens_per_s": round(
                statistics.fmean(int(b.attention_mask.sum()) for b in batches) / (ms["c"] / 1000), 1
            ),
            "peak_mib": {case: None if value is None else round(value, 1) for case, value in peaks.items()},
            "repeats": margs.repeats,
            "memory": method,
            "mean_tokens_per_batch": round(statistics.fmean(int(b.attention_mask.sum()) for b in batches), 1),
        }
        if CHECKPOINTED in times:
            row["g_over_c"] = round(paired_ratio(times["g"], times["c"]), 4)
        rows.append(row)
        print(f"{model}: {json.dumps(row)}", flush=True)
        del setup, times  # the decoder and the steps' closures over it, before the next model
        gc.collect()

    print(
        f"\nStep cost against decoder size: {dtype_name(dtype)} decoder (frozen), batch {args.batch_size}, "
        f"synthetic prompts {TINY_PROMPT_RANGE[0]}-{TINY_PROMPT_RANGE[1]} and responses "
        f"{TINY_RESPONSE_RANGE[0]}-{TINY_RESPONSE_RANGE[1]} tokens, {torch.get_num_threads()} threads, on "
        f"{setup_device_text(args)}; load average {load_text()}"
    )
    print("(f) the decoder's own forward + backward (full logits, to its input embeddings); (a) prefix tuning;")
    print("(c) the CVAE, six terms + KL, cached features; (e) one no-grad frozen pass; ratios: paired medians")
    header = (
        f"{'model':<22}{'params':>9}{'(f) ms':>9}{'(a) ms':>9}{'(c) ms':>9}{'(c)/(f)':>8}{'(a)/(f)':>8}"
        f"{'(e) tok/s':>10}{'peak MiB f / a / c':>22}"
    )
    if CHECKPOINTED in cases:
        header += f"{'(g) ms':>9}{'(g)/(c)':>8}{'peak (g)':>9}"
    print(header)

    def mib(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for row in rows:
        ms, peaks = row["ms"], row["peak_mib"]
        line = (
            f"{row['model']:<22}{row['parameters'] / 1e6:>8.1f}M{ms['f']:>9.1f}{ms['a']:>9.1f}{ms['c']:>9.1f}"
            f"{row['c_over_f']:>8.3f}{row['a_over_f']:>8.3f}{row['frozen_pass_tokens_per_s']:>10.0f}"
            f"{' / '.join(mib(peaks.get(c)) for c in ('f', 'a', 'c')):>22}"
        )
        if CHECKPOINTED in cases:
            line += f"{ms['g']:>9.1f}{row['g_over_c']:>8.3f}{mib(peaks.get('g')):>9}"
        print(line)
    print(f"(total {time.perf_counter() - started:.0f} s)")
    return rows


def setup_device_text(args: argparse.Namespace) -> str:
    device = choose_device(args.device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        type=model_argument,
        default="tiny",
        help="tiny, embedded, or config:NAME (a decoder of a real model's shape with random weights: "
        + ", ".join(CONFIG_PREFIX + name for name in testing.MODEL_SHAPES)
        + ")",
    )
    parser.add_argument(
        "--models",
        type=lambda text: [model_argument(name) for name in text.split(",") if name],
        default=None,
        help="comma-separated models: one table of step time, frozen-pass throughput and peak memory against "
        f"the decoder's size, cases {', '.join(SIZE_CASES)} (and g with --gradient-checkpointing); "
        "replaces the main table",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="also case (g): (c) with the decoder's layers checkpointed (ModelConfig.gradient_checkpointing)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repetitions, each running every case once (20 tiny, 10 embedded, 3 config:NAME)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed repetitions first (3 tiny, 2 embedded, 1 config:NAME)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "both"],
        default="auto",
        help="decoder weights (auto: as training chooses here; both: both dtypes interleaved, with paired ratios)",
    )
    parser.add_argument(
        "--peft", action="store_true", help="also case (t): peft prompt tuning (labels, full logits) on a copy"
    )
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="also the (a) -> (h) -> (p) -> (c) ladder")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also (c)'s time by part from torch.profiler: decoder matmuls, LM head, attention, optimizer, other",
    )
    parser.add_argument("--measure-memory", choices=MEMORY_CASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats, warmup = args.repeats, args.warmup
    args.repeats = DEFAULT_REPEATS[model_kind(args.model)] if repeats is None else repeats
    args.warmup = DEFAULT_WARMUP[model_kind(args.model)] if warmup is None else warmup
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = choose_device(args.device)
    if args.dtype == "both":
        dtypes = [torch.float32, torch.bfloat16]
    elif args.dtype == "auto":
        dtypes = [resolve_dtype(ModelConfig(dtype="auto"), device)]
    else:
        dtypes = [DTYPES[args.dtype]]

    if args.measure_memory:
        args.dtype = dtype_name(dtypes[0])
        print(json.dumps(measure_memory_here(args, args.measure_memory)))
        return
    if args.models:
        if len(dtypes) != 1:
            parser.error("--models times one dtype: auto, float32 or bfloat16")
        if args.peft:
            parser.error("--peft is a case of the main table, not of --models")
        print(json.dumps(model_sizes(args, dtypes[0], repeats, warmup)))
        return

    started = time.perf_counter()
    n_batches = max(1, args.repeats)
    cases = (*CASES, *([CHECKPOINTED] if args.gradient_checkpointing else []), *([PEFT] if args.peft else []))
    loaded = load_decoder(args, n_batches, dtypes[0] if len(dtypes) == 1 else torch.float32)
    setups = {dtype_name(d): build_setup(args, n_batches, cases, dtype=d, loaded=loaded) for d in dtypes}
    first = next(iter(setups.values()))
    print(
        f"model {args.model} (V={first.vocab_size}, H={first.hidden_size}) on {device}, decoder "
        f"{' and '.join(setups)}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"batch {args.batch_size}, {len(first.batches)} batches (mean prompt {first.mean_prompt:.1f}, response "
        f"{first.mean_response:.1f}, padded width {first.mean_width:.1f} tokens); warm-up {args.warmup}, "
        f"repeats {args.repeats}; c_base {', '.join(f'{n} {s.c_base:.3f}' for n, s in setups.items())}; "
        f"load average {load_text()}"
    )
    busy = os.getloadavg()[0]
    if device.type == "cpu" and torch.get_num_threads() > 1 and busy > (os.cpu_count() or 1) - 0.5:
        print(
            f"WARNING: the machine is busy (load {busy:.1f} on {os.cpu_count()} cores) and torch uses "
            f"{torch.get_num_threads()} threads: OpenMP threads waiting for a taken core can make steps many "
            "times slower and scatter them; compare with --threads 1"
        )
    # One round-robin over every case of every dtype, all on the same batch in a repetition.
    steps = {f"{case}:{name}": step for name, setup in setups.items() for case, step in setup.steps.items()}
    batches = first.batches
    times = time_round_robin(steps, lambda name, rep: batches[rep % len(batches)], args.repeats, args.warmup, device)
    summaries = {
        name: report(args, setup, {case: times[f"{case}:{name}"] for case in cases}) for name, setup in setups.items()
    }

    summary: dict = summaries[next(iter(setups))]
    if len(setups) == 2:
        print("\nfloat32 / bfloat16 decoder, same batches, interleaved (> 1: bf16 is faster):")
        print(f"{'case':<5}{'':<42}{'float32 ms':>11}{'bf16 ms':>10}{'ratio':>8}{'paired':>8}")
        speedup = {}
        for case in cases:
            f32, bf16 = times[f"{case}:float32"], times[f"{case}:bfloat16"]
            speedup[case] = paired_ratio(f32, bf16)
            print(
                f"({case})  {DESCRIPTIONS[case]:<42}{1000 * median(f32):>11.2f}{1000 * median(bf16):>10.2f}"
                f"{median(f32) / median(bf16):>8.3f}{speedup[case]:>8.3f}"
            )
        summary = {
            "model": args.model,
            "dtypes": summaries,
            "float32_over_bfloat16": {case: round(value, 4) for case, value in speedup.items()},
        }

    for dtype in dtypes:
        if args.breakdown:
            breakdown(args, dtype)
        if not args.skip_scaling:
            scaling(args, dtype)
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average {load_text()})")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
