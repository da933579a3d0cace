"""Prefix against per-layer key/value memory: how fast and how well the latent learns a hidden factor.

    python benchmarks/placement.py [--model embedded|tiny] [--steps 200] [--every 25] [--output-dir DIR]

For each ``latent_placement`` (``prefix``, ``memory``; ``--placements`` to choose) one discrete run
(K = 4 codes, one slot) on the hidden-factor pairs of the learning tests (``tests/test_learning.py``:
the chatterbot prompts, each answered by one of four phrases that the prompt does not reveal), with a
checkpoint every ``--every`` steps. Then, on the held-out validation split: the label NMI of the argmax
code at every checkpoint (so the steps it takes to learn: the first checkpoint with NMI >= 0.9), and at
the last one the latent gain (prior-mixture minus posterior NLL, nats per token), the posterior NLL
against the z-free one, and the baselines (k-means of the frozen encoder and prior features).
``embedded``: the frozen SmolLM2-135M (the learning tests' settings, ``dtype: auto``); ``tiny``: the
tests' tiny Llama trained in full (the fixtures' recipe; seconds, for checking the script).
The last line is one JSON object keyed by placement.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from disentanglement.checkpoints import checkpoint_step, complete_checkpoints, load_trainable_weights
from disentanglement.config import ModelConfig, build_config
from disentanglement.data import load_chatterbot
from disentanglement.evaluation import evaluate, label_recovery
from disentanglement.lm import load_model_and_tokenizer
from disentanglement.testing import make_hidden_factor_pairs, tiny_llama, tiny_tokenizer
from disentanglement.trainer import train

EMBEDDED = dict(  # tests/test_learning.py's LEARNING_SETTINGS
    preset="raw",  # the recipe measured in docs/results.md (the defaults before issue 23)
    max_examples=600,
    validation_fraction=0.34,
    chat_template=False,
    batch_size=8,
)
TINY = dict(  # tests/conftest.py's recipe
    preset="raw",
    chat_template=False,
    max_prompt_tokens=32,
    max_response_tokens=48,
    validation_fraction=0.2,
    decoder_training="full",
    latent_tokens=4,
    code_dim=16,
    encoder_hidden=64,
    commitment_weight=0.05,
    dead_code_steps=3,
    batch_size=16,
    encoder_lr=3e-3,
    latent_lr=3e-2,
    decoder_lr=3e-3,
    warmup_steps=10,
)


def model_and_tokenizer(kind: str):
    if kind == "embedded":
        return load_model_and_tokenizer(ModelConfig())
    tokenizer = tiny_tokenizer(chat_template=False)
    return tiny_llama(len(tokenizer)), tokenizer


def run(kind: str, placement: str, steps: int, every: int, out: Path, seed: int) -> dict:
    torch.manual_seed(seed)
    decoder, tokenizer = model_and_tokenizer(kind)
    prompts = [pair.prompt for pair in load_chatterbot()]
    pairs = make_hidden_factor_pairs(prompts, num_factors=4, kind="clean", seed=0)
    settings = dict(EMBEDDED if kind == "embedded" else TINY)
    settings.update(
        latent="discrete",
        codebook_size=4,
        latent_placement=placement,
        max_steps=steps,
        save_every=every,
        keep_checkpoints=steps // every + 1,
        eval_every=0,
        seed=seed,
        progress=False,
        output_dir=str(out / placement),
    )
    config = build_config(settings)
    start = time.perf_counter()
    result = train(config, (decoder, tokenizer), pairs)
    seconds = time.perf_counter() - start
    model, pad = result.model, tokenizer.pad_token_id
    validation = result.data.validation
    cache = result.cache.subset(len(result.data.train), len(result.cache))
    curve = {}
    for checkpoint in complete_checkpoints(result.output_dir):
        load_trainable_weights(model, checkpoint)
        curve[checkpoint_step(checkpoint)] = round(label_recovery(model, validation, cache, pad, seed=seed)["nmi"], 4)
    learned = next((step for step, nmi in sorted(curve.items()) if nmi >= 0.9), None)
    report = evaluate(model, validation, cache, pad, seed=seed, progress=False)  # the last checkpoint's weights
    label = report["factors"]["label"]
    return {
        "placement": placement,
        "train_seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / steps, 3),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "nmi_by_step": curve,
        "steps_to_nmi_0.9": learned,
        "nmi": round(label["latent"]["nmi"], 4),
        "encoder_kmeans_nmi": round(label["encoder_kmeans"]["nmi"], 4),
        "prior_kmeans_nmi": round(label["prior_kmeans"]["nmi"], 4),
        "latent_gain_nats_per_token": round(report["latent_gain_nats_per_token"], 4),
        "posterior_nll_nats_per_token": round(report["posterior_nll_nats_per_token"], 4),
        "zfree_nll_nats_per_token": round(report["zfree_nll_nats_per_token"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    parser.add_argument("--placements", default="prefix,memory")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/placement")
    args = parser.parse_args()
    out = Path(args.output_dir)
    results = {}
    for placement in args.placements.split(","):
        results[placement] = run(args.model, placement, args.steps, args.every, out, args.seed)
        r = results[placement]
        print(
            f"{placement:7s} NMI {r['nmi']:.3f} (encoder k-means {r['encoder_kmeans_nmi']:.3f}, prior k-means "
            f"{r['prior_kmeans_nmi']:.3f}); NMI >= 0.9 from step {r['steps_to_nmi_0.9']}; latent gain "
            f"{r['latent_gain_nats_per_token']:.3f} nats/token; posterior NLL {r['posterior_nll_nats_per_token']:.3f} "
            f"vs z-free {r['zfree_nll_nats_per_token']:.3f}; {r['seconds_per_step']:.2f} s/step, "
            f"{r['trainable_parameters']:,} trainable parameters; NMI by step {r['nmi_by_step']}",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
