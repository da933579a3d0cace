"""Training loop on accelerate's ``Accelerator``: AdamW, warm-up + cosine, accumulation, clipping,
per-step JSONL metrics, periodic validation and atomic, resumable checkpoints.

Run directory layout::

    OUTPUT_DIR/
      config.yaml              resolved config of the run
      metrics.jsonl            one JSON object per optimizer step (+ validation records)
      data_stats.json          data counts, truncation counts and c_base
      checkpoints/step-000050/ a complete checkpoint (written as .tmp-step-000050, then renamed)
        model.safetensors      trainable weights and latent-model buffers
        optimizer.pt scheduler.pt rng.pt
        trainer_state.json     step, data position, c_base, non-finite count
        config.yaml
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from .config import RunConfig, load_run_config, write_run_config
from .cvae_base import CVAEBase
from .data import Example, collate, limit_examples, load_pairs, split_train_validation, tokenize_pairs
from .features import FeatureCache, batch_features, load_or_build_feature_cache
from .losses import estimate_zfree_reference_scale
from .models import build_cvae

logger = logging.getLogger(__name__)
CHECKPOINT_PREFIX = "step-"


class TrainingDiverged(RuntimeError):
    """Raised after too many consecutive non-finite losses or gradients."""


@dataclass
class DataOrder:
    """Deterministic epoch-wise shuffling whose position is saved with each checkpoint."""

    size: int
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), self.size - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}


@dataclass
class PreparedData:
    train: list[Example]
    validation: list[Example]
    stats: dict[str, Any]


def prepare_data(config: RunConfig, tokenizer, pairs=None) -> PreparedData:
    """Load (or take) pairs, cap by ``max_examples``, tokenize and split, all deterministic by seed."""
    pairs = load_pairs(config.data) if pairs is None else pairs
    pairs = limit_examples(pairs, config.data.max_examples, config.train.seed)
    examples, stats = tokenize_pairs(pairs, tokenizer, config.data)
    train, validation = split_train_validation(examples, config.data.validation_fraction, config.train.seed)
    stats = dict(stats, train_examples=len(train), validation_examples=len(validation))
    return PreparedData(train, validation, stats)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (temporary directories of interrupted saves are ignored)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    complete = [
        p for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and (p / "trainer_state.json").is_file()
    ]
    return max(complete, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]), default=None)


def rng_state() -> dict[str, Any]:
    # The global generators are what the model's sampling uses, so they are what must be restored.
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    output_dir: Path, step: int, model: CVAEBase, optimizer, scheduler, trainer_state: dict, config: RunConfig
) -> Path:
    """Write a checkpoint to a temporary directory, then rename it: a crash mid-save keeps the last one."""
    root = output_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{step:06d}"
    tmp = root / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.contiguous().cpu() for k, v in model.trainable_state_dict().items()}, tmp / "model.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    write_run_config(config, tmp / "config.yaml")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))  # written last
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    root = output_dir / "checkpoints"
    complete = sorted(
        (p for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX)),
        key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]),
    )
    for old in complete[:-keep]:
        shutil.rmtree(old)


# Checkpoints written before 2026-11-29 normalised the heads' features with an affine LayerNorm.
_OLD_HEAD_NORMS = {"encoder_norm": "encoder.0", "prior_norm": "prior_head.0"}


def _fold_old_head_norms(state: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Fold an old checkpoint's LayerNorm affine ``(g, beta)`` into the Linear that follows it, exactly:
    ``W (g * x + beta) + b = (W diag g) x + (W beta + b)``."""
    folded = []
    for norm, head in _OLD_HEAD_NORMS.items():
        gain, shift = state.pop(f"{norm}.weight", None), state.pop(f"{norm}.bias", None)
        if gain is None or shift is None or f"{head}.weight" not in state:
            continue  # no affine, or no head behind it (a fixed prior)
        weight = state[f"{head}.weight"]
        state[f"{head}.bias"] = state[f"{head}.bias"] + weight @ shift
        state[f"{head}.weight"] = weight * gain
        folded.append(norm)
    if folded:
        logger.warning(
            "checkpoint %s: written before the heads' LayerNorm lost its parameters; folded %s into the "
            "next Linear (exact). The heads' GELU is now the tanh form: activations differ by < 1e-3.",
            checkpoint,
            folded,
        )


def load_trainable_weights(model: CVAEBase, checkpoint: Path) -> None:
    """Load a checkpoint's trainable weights and buffers; every tensor must match by name and shape."""
    state = load_file(str(checkpoint / "model.safetensors"))
    expected = model.trainable_state_dict()
    if not any(f"{norm}.weight" in expected for norm in _OLD_HEAD_NORMS):
        _fold_old_head_norms(state, checkpoint)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {checkpoint}: missing tensors {missing}, unexpected tensors {unexpected}")
    model.load_state_dict(state, strict=False)


def make_optimizer(model: CVAEBase, config: RunConfig) -> torch.optim.Optimizer:
    lrs = {"encoder": config.train.encoder_lr, "latent": config.train.latent_lr, "decoder": config.train.decoder_lr}
    groups = [
        {"params": params, "lr": lrs[name], "name": name} for name, params in model.parameter_groups().items() if params
    ]
    # The fused kernel is one call per step instead of one per tensor (measurably cheaper for small heads).
    return torch.optim.AdamW(groups, weight_decay=config.train.weight_decay, fused=True)


def choose_device(preference: str) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


@dataclass
class TrainResult:
    output_dir: Path
    final_step: int
    checkpoint: Path | None
    zfree_reference_scale: float
    last_metrics: dict[str, float]
    model: CVAEBase
    data: PreparedData
    cache: FeatureCache | None  # the frozen pass over train + validation (None when neither needed it)


def _mean_records(records: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in records for k in r}
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in sorted(keys)}


@torch.no_grad()
def validate(
    model: CVAEBase,
    examples: Sequence[Example],
    cache: FeatureCache | None,
    pad_id: int,
    config: RunConfig,
    step: int,
    device: torch.device,
) -> dict[str, float]:
    """Mean of every logged scalar over the first ``eval_batches`` validation batches (posterior mean/argmax)."""
    if not examples:
        return {}
    was_training = model.training
    model.eval()
    records = []
    size = config.train.batch_size
    try:
        for start in range(0, min(len(examples), size * config.train.eval_batches), size):
            indices = list(range(start, min(start + size, len(examples))))
            batch = collate([examples[i] for i in indices], pad_id, indices=indices).to(device)
            records.append(model(batch, features=batch_features(model, batch, cache), step=step).scalars())
    finally:
        model.train(was_training)
    return {f"val_{k}": v for k, v in _mean_records(records).items()}


def train(
    config: RunConfig,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    pairs: Sequence | None = None,
    callbacks: Sequence[Callable[[int, dict], None]] = (),
) -> TrainResult:
    """Train a CVAE as configured. ``model_and_tokenizer`` and ``pairs`` replace loading (tests)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    tcfg = config.train
    output_dir = Path(tcfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    device = choose_device(tcfg.device)
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision="bf16" if device.type == "cuda" else "no")
    device = accelerator.device
    set_seed(tcfg.seed)

    resume_from = None
    if tcfg.resume == "auto":
        resume_from = latest_checkpoint(output_dir)
    elif tcfg.resume:
        resume_from = Path(tcfg.resume)
        if not (resume_from / "trainer_state.json").is_file():
            raise FileNotFoundError(f"--resume {tcfg.resume}: not a complete checkpoint directory")
    resume_state = json.loads((resume_from / "trainer_state.json").read_text()) if resume_from else None

    pairs = load_pairs(config.data) if pairs is None else pairs  # data errors surface before the model loads
    if model_and_tokenizer is None:
        from .lm import load_model_and_tokenizer

        decoder, tokenizer = load_model_and_tokenizer(config.model, device="cpu")
    else:
        decoder, tokenizer = model_and_tokenizer
    pad_id = tokenizer.pad_token_id
    data = prepare_data(config, tokenizer, pairs)
    if not data.train:
        raise ValueError("no training examples after loading and splitting the data")
    logger.info("data: %s", data.stats)

    model = build_cvae(config, decoder).to(device)
    all_examples = data.train + data.validation
    n_train = len(data.train)
    cache: FeatureCache | None = None
    needs_c_base = resume_state is None and config.reconstruction.zfree_reference_scale is None
    if tcfg.feature_cache or needs_c_base:
        cache_dir = (tcfg.feature_cache_dir or output_dir / "feature_cache") if tcfg.feature_cache else None
        cache = load_or_build_feature_cache(
            model,
            all_examples,
            pad_id,
            cache_dir,
            batch_size=max(tcfg.batch_size, 16),
            device=device,
            progress=tcfg.progress,
        )
    train_cache = cache.subset(0, n_train) if cache is not None else None
    # Without the cache option, steps and validation run the frozen pass themselves (cache is then
    # only the one-off pass that estimates c_base).
    step_cache = train_cache if tcfg.feature_cache else None
    val_cache = cache.subset(n_train, len(all_examples)) if cache is not None and tcfg.feature_cache else None

    if resume_state is not None:
        c_base = float(resume_state["zfree_reference_scale"])
        given = config.reconstruction.zfree_reference_scale
        if given is not None and abs(given - c_base) > 1e-12:
            logger.warning(
                "resuming with the checkpoint's zfree_reference_scale %.6f, not the configured %.6f", c_base, given
            )
    elif config.reconstruction.zfree_reference_scale is not None:
        c_base = config.reconstruction.zfree_reference_scale
    else:
        c_base = estimate_zfree_reference_scale(train_cache.example_base_losses())
        logger.info(
            "estimated zfree_reference_scale c_base = %.4f nats/token over %d examples", c_base, len(data.train)
        )
    model.zfree_reference_scale = c_base
    write_run_config(config, output_dir / "config.yaml")
    (output_dir / "data_stats.json").write_text(json.dumps(dict(data.stats, zfree_reference_scale=c_base), indent=2))

    init_sample = list(range(min(n_train, 4096)))
    init_features = (
        train_cache.features(collate([data.train[i] for i in init_sample], pad_id, indices=init_sample).to(device))
        if train_cache is not None
        else None
    )
    if resume_from is None and init_features is not None:
        model.initialize_from_data(init_features, tcfg.seed)
    elif init_features is None and config.latent.latent == "discrete" and config.latent.codebook_init == "kmeans":
        logger.warning(
            "no frozen-pass cache (feature_cache off, c_base given): the codebook starts at random, "
            "without k-means initialisation or refreshes"
        )
    refresh_every = config.latent.codebook_refresh_every if config.latent.codebook_init == "kmeans" else 0
    optimizer = make_optimizer(model, config)
    scheduler = get_cosine_schedule_with_warmup(optimizer, tcfg.warmup_steps, tcfg.max_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    core: CVAEBase = accelerator.unwrap_model(model)
    order = DataOrder(len(data.train), tcfg.seed)
    step = 0
    nonfinite = 0
    if resume_from is not None:
        load_trainable_weights(core, resume_from)
        try:
            optimizer.load_state_dict(torch.load(resume_from / "optimizer.pt", weights_only=False))
        except ValueError as error:  # other parameters: e.g. a checkpoint of an older version of the heads
            raise ValueError(
                f"{resume_from / 'optimizer.pt'}: the optimizer state does not fit this model's trainable "
                f"parameters ({error}). The checkpoint can be evaluated but not resumed; start a new run."
            ) from error
        scheduler.load_state_dict(torch.load(resume_from / "scheduler.pt", weights_only=False))
        set_rng_state(torch.load(resume_from / "rng.pt", weights_only=False))
        step = int(resume_state["step"])
        order = DataOrder(len(data.train), tcfg.seed, **resume_state["data_order"])
        nonfinite = int(resume_state.get("nonfinite_steps", 0))
        logger.info("resumed from %s at step %d", resume_from, step)

    metrics_path = output_dir / "metrics.jsonl"
    _truncate_metrics(metrics_path, step)
    writer = _tensorboard_writer(output_dir) if tcfg.tensorboard else None
    checkpoint = resume_from
    last: dict[str, float] = {}
    model.train()
    bar = tqdm(total=tcfg.max_steps, initial=step, desc="train", disable=not tcfg.progress, unit="step")
    with metrics_path.open("a") as metrics_file:
        while step < tcfg.max_steps:
            optimizer.zero_grad(set_to_none=True)
            records = []
            finite = True
            for _ in range(tcfg.gradient_accumulation_steps):
                indices = order.next_indices(tcfg.batch_size)
                batch = collate([data.train[i] for i in indices], pad_id, indices=indices).to(device)
                features = batch_features(core, batch, step_cache)  # float32 frozen pass, as in the cache
                with accelerator.autocast():
                    out = model(batch, features=features, step=step)
                if not torch.isfinite(out.loss):
                    finite = False
                    bad = {k: v for k, v in out.scalars().items() if not math.isfinite(v)}
                    logger.warning(
                        "step %d: non-finite loss; non-finite terms %s; examples %s",
                        step,
                        bad,
                        [data.train[i].source for i in indices],
                    )
                    break
                accelerator.backward(out.loss / tcfg.gradient_accumulation_steps)
                records.append(out.scalars())
            grad_norm = float("nan")
            if finite:
                grad_norm = float(accelerator.clip_grad_norm_(core.parameters(), tcfg.max_grad_norm))
                finite = math.isfinite(grad_norm)
            if not finite:
                nonfinite += 1
                optimizer.zero_grad(set_to_none=True)
                if nonfinite >= tcfg.max_nonfinite_steps:
                    raise TrainingDiverged(
                        f"stopped at step {step}: {nonfinite} consecutive non-finite losses or gradients "
                        f"(last record: {records[-1] if records else 'loss itself non-finite'}). Lower the learning "
                        "rates, check the data, or resume from the last checkpoint with --resume auto."
                    )
                continue
            nonfinite = 0
            optimizer.step()
            scheduler.step()
            core.post_step(step)  # with the index of the step just taken, as its forward saw it
            step += 1
            if (
                refresh_every
                and init_features is not None
                and step % refresh_every == 0
                and step <= tcfg.max_steps // 2
            ):
                core.initialize_from_data(init_features, tcfg.seed + step, refresh=True)
            record = _mean_records(records)
            record.update(step=step, grad_norm=grad_norm)
            for group in optimizer.param_groups:
                record[f"lr_{group['name']}"] = group["lr"]
            if tcfg.eval_every and step % tcfg.eval_every == 0 or step == tcfg.max_steps:
                record.update(validate(core, data.validation, val_cache, pad_id, config, step, device))
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if writer is not None:
                for key, value in record.items():
                    if key != "step":
                        writer.add_scalar(key, value, step)
            last = record
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", rec=f"{record['reconstruction_loss']:.3f}")
            if step % tcfg.save_every == 0 or step == tcfg.max_steps:
                trainer_state = {
                    "step": step,
                    "data_order": order.state(),
                    "zfree_reference_scale": c_base,
                    "nonfinite_steps": nonfinite,
                    "latent": config.latent.latent,
                }
                checkpoint = save_checkpoint(output_dir, step, core, optimizer, scheduler, trainer_state, config)
                prune_checkpoints(output_dir, tcfg.keep_checkpoints)
            for callback in callbacks:
                callback(step, record)
    bar.close()
    if writer is not None:
        writer.close()
    return TrainResult(output_dir, step, checkpoint, c_base, last, core, data, cache)


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records written after the checkpoint's step (they will be recomputed)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _tensorboard_writer(output_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # pragma: no cover - depends on the optional package
        raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
    return SummaryWriter(str(output_dir / "tensorboard"))


def load_trained(checkpoint: str | Path, model_and_tokenizer: tuple[Any, Any] | None = None):
    """Rebuild a trained CVAE from a checkpoint directory: ``(model, tokenizer, config, trainer_state)``."""
    checkpoint = Path(checkpoint)
    if (checkpoint / "checkpoints").is_dir():
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise FileNotFoundError(f"{checkpoint} holds no complete checkpoint")
        checkpoint = found
    if not (checkpoint / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint directory (no trainer_state.json)")
    config = load_run_config(checkpoint / "config.yaml")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if model_and_tokenizer is None:
        from .lm import load_model_and_tokenizer

        decoder, tokenizer = load_model_and_tokenizer(config.model, device="cpu")
    else:
        decoder, tokenizer = model_and_tokenizer
    model = build_cvae(config, decoder)
    load_trainable_weights(model, checkpoint)
    model.zfree_reference_scale = float(state["zfree_reference_scale"])
    model.eval()
    return model, tokenizer, config, state
