"""Session-scoped trained checkpoints on the synthetic hidden-factor data (shared by the eval,
generate and inspect tests).

A tiny 2-layer Llama (``helpers.tiny_llama``) trained in full (``decoder_training="full"``; its
frozen copy is the z-free reference) on ``make_hidden_factor_pairs(kind="clean")``: 200 short
distinct prompts, 4 hidden factors, each answered by its fixed phrase. The discrete recipe is the
project's nearest-code recipe with a smaller commitment weight and a faster dead-code restart,
which on this tiny random model recovers the factor exactly (NMI 1.0 on the validation split for
ten seeds out of ten) in about 7 s on one CPU thread.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from disentanglement.config import RunConfig, build_config
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.trainer import load_trained, train
from helpers import tiny_llama, tiny_tokenizer

# Under pytest-xdist (`pytest -n 2`; the README's command runs one process) each worker runs one thread, and so do
# the processes it starts:
# two workers of two threads each on two cores slow each other several-fold.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# The tests' frozen-pass store (feature_store): a folder of this session's, never the user's cache.
_FEATURE_STORE = tempfile.mkdtemp(prefix="disentanglement-feature-cache-")
os.environ["DISENTANGLEMENT_FEATURE_CACHE"] = _FEATURE_STORE
atexit.register(shutil.rmtree, _FEATURE_STORE, True)


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny tokenizer (``helpers.tiny_tokenizer``), one per test module; a module overrides it for other settings."""
    return tiny_tokenizer()


NUM_FACTORS = 4
WORDS = ("red", "blue", "cat", "dog", "sun", "moon", "tree", "fish", "car", "box", "hat", "cup", "key", "map", "pen")


def hidden_factor_prompts(count: int = 200, seed: int = 0) -> list[str]:
    """``count`` short distinct prompts that say nothing about the hidden factor."""
    rng = random.Random(seed)
    return sorted({f"{rng.choice(WORDS)} {rng.choice(WORDS)} {i}" for i in range(count)})


def model_and_tokenizer():
    """A fresh copy of the tiny decoder the fixtures train, and its tokenizer (no chat template)."""
    tokenizer = tiny_tokenizer(chat_template=False)
    return tiny_llama(len(tokenizer)), tokenizer


@dataclass
class TrainedRun:
    run_dir: Path
    checkpoint: Path
    data_path: Path
    config: RunConfig
    seconds: float

    def load(self):
        """``(model, tokenizer, config, trainer_state)`` of the checkpoint, on a fresh tiny decoder."""
        return load_trained(self.checkpoint, model_and_tokenizer())


def _train(root: Path, latent: str, steps: int, **overrides) -> TrainedRun:
    root.mkdir(parents=True, exist_ok=True)
    data_path = root / "hidden_factor.jsonl"
    pairs = make_hidden_factor_pairs(hidden_factor_prompts(), num_factors=NUM_FACTORS, kind="clean", seed=0)
    data_path.write_text(
        "".join(json.dumps({"prompt": p.prompt, "response": p.response, "label": p.label}) + "\n" for p in pairs)
    )
    values = dict(
        preset="raw",  # the recipe these runs were written against (the defaults before issue 23)
        latent=latent,
        data=str(data_path),
        chat_template=False,
        max_prompt_tokens=32,
        max_response_tokens=48,
        validation_fraction=0.2,
        decoder_training="full",
        latent_tokens=4,
        codebook_size=NUM_FACTORS,
        code_dim=16,
        latent_dim=4,
        encoder_hidden=64,
        commitment_weight=0.05,
        dead_code_steps=3,
        output_dir=str(root / "run"),
        max_steps=steps,
        batch_size=16,
        encoder_lr=3e-3,
        latent_lr=3e-2,
        decoder_lr=3e-3,
        warmup_steps=10,
        save_every=steps,
        eval_every=steps // 4,
        eval_batches=2,
        seed=0,
        device="cpu",
        progress=False,
    )
    values.update(overrides)
    config = build_config(values)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and as fast as 2 threads for a model this small
    try:
        result = train(config, model_and_tokenizer())
    finally:
        torch.set_num_threads(threads)
    assert result.checkpoint is not None
    return TrainedRun(result.output_dir, result.checkpoint, data_path, config, time.perf_counter() - start)


@pytest.fixture(scope="session")
def discrete_run(tmp_path_factory) -> TrainedRun:
    return _train(tmp_path_factory.mktemp("discrete"), "discrete", 400)


@pytest.fixture(scope="session")
def continuous_run(tmp_path_factory) -> TrainedRun:
    return _train(tmp_path_factory.mktemp("continuous"), "continuous", 150, beta=0.001, encoder_lr=1e-2)


@pytest.fixture
def injected_loader(monkeypatch):
    """``trainer.load_trained`` on a fresh tiny decoder, as the command line would load a real one."""
    from disentanglement import trainer

    original = trainer.load_trained
    monkeypatch.setattr(
        trainer,
        "load_trained",
        lambda checkpoint, _=None, **kwargs: original(checkpoint, model_and_tokenizer(), **kwargs),
    )
