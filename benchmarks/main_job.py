"""The main job, timed by phase: ``disentangle train --config configs/default.yaml``, in this process.

    python benchmarks/main_job.py                      # twice: empty caches, then the same caches warm
    python benchmarks/main_job.py --caches empty       # once, model and feature caches empty
    python benchmarks/main_job.py --caches user        # once, with the user's own caches as they are
    python benchmarks/main_job.py --threads 2 --max-steps 3 --max-examples 200   # a quick check

``empty`` uses fresh temporary model and feature cache folders (the embedded GGUF is dequantised again
and the frozen pass runs over every example); ``warm`` runs the job again on the folders the ``empty``
run filled (``both``, the default, does the two in a row: the second run of the same job on the same
data, in a new process as a user's second run is; ``--same-process`` runs it in this one, which measured
7 % slower steps and 33 % slower validation than a new process: an artefact of the first run's memory, not
of the caches); ``user`` leaves the folders to the config and the environment (``~/.cache/disentanglement``).
``--cache-dir DIR`` keeps the cache folders in ``DIR`` (``--caches empty`` fills it, ``--caches warm`` reads
it). Each run goes to its own temporary output folder, deleted afterwards (``--keep`` keeps them).

After the table of seconds, the **floor**: each phase's useful FLOPs (``flops.job_flops``: the frozen pass over
every distinct example, the steps' forward and input-gradient backward, validation, and the verdict's decodes under
every code; with the default's LoRA adapters also theirs, forward and backward) and the seconds they would take at 100 % of ``torch.matmul``'s rate on this CPU at the step's
shapes, beside the seconds measured: the shortest the job could be on this machine without less work.

It times the trainer's own functions, wrapped in place (nothing in the package changes):

| phase | what |
| --- | --- |
| model load | ``trainer._decoder_and_tokenizer``: the decoder and tokenizer; with an empty model cache the GGUF's dequantisation and the safetensors write |
| data | ``trainer.load_pairs`` + ``trainer.prepare_data``: reading and tokenising the pairs, the split |
| weights hash | ``trainer.feature_fingerprint``: the reference's weights hashed (once per loaded model) and the examples |
| frozen pass | ``trainer.run_frozen_pass``: the feature cache read, and the pass over the examples it lacks |
| steps | ``trainer._optimizer_step``: mean, median, first and total |
| validation | ``trainer._validate`` (``eval_every``; ``eval_batches`` batches each) |
| checkpoints | ``trainer._save`` (``save_every`` and the last step) |
| verdict | ``verdict.train_verdict``: what ``disentangle train`` prints after training, ``eval``'s report on the validation split |
| other | the rest of ``train``: the CVAE's construction, c_base, the optimizer, accelerate, the run's files |

and prints one table per run (seconds), then a JSON line per run. Also the frozen pass's padding:
tokens of the sorted, batched examples that are padding, and the LM-head positions it scores beyond the
response tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from step_cost import matmul_rate_at  # noqa: E402

from disentanglement import feature_store, trainer  # noqa: E402
from disentanglement.config import build_config, read_config_file  # noqa: E402
from disentanglement.features import first_copies, frozen_pass_batches, shared_prefix_positions  # noqa: E402
from disentanglement.flops import LLAMA_PROJECTIONS, DecoderShape, Lora, job_flops  # noqa: E402
from disentanglement.options import EvalOptions  # noqa: E402
from disentanglement.verdict import train_verdict  # noqa: E402

PHASES = (
    ("model load", "_decoder_and_tokenizer"),
    ("data", "load_pairs"),
    ("data", "prepare_data"),
    ("weights hash", "feature_fingerprint"),
    ("frozen pass", "run_frozen_pass"),
    ("steps", "_optimizer_step"),
    ("validation", "_validate"),
    ("checkpoints", "_save"),
)
ORDER = (
    "model load",
    "data",
    "weights hash",
    "frozen pass",
    "steps",
    "validation",
    "checkpoints",
    "verdict",
    "other",
    "total",
)


class Timers:
    """Wraps the trainer's functions; records each call's seconds per phase."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.saved: list[tuple[str, object]] = []

    def __enter__(self) -> Timers:
        for phase, name in PHASES:
            original = getattr(trainer, name)
            self.saved.append((name, original))

            def timed(*args, _original=original, _phase=phase, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.calls[_phase].append(time.perf_counter() - start)

            setattr(trainer, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in reversed(self.saved):
            setattr(trainer, name, original)


def padding(examples, batch_size: int) -> dict[str, int]:
    """Tokens and padding of the frozen pass's batches (``features.frozen_pass_batches``: each distinct example
    once, sorted by length)."""
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in examples]
    prompts = [len(e.prompt_ids) for e in examples]
    batches = frozen_pass_batches(examples, batch_size)
    passed = [i for batch in batches for i in batch]
    padded = head = 0
    for batch in batches:
        width = max(lengths[i] for i in batch)
        padded += width * len(batch)
        head += len(batch) * (width - min(prompts[i] for i in batch))  # positions from min(prompt) - 1 on
    return {
        "passed": len(passed),
        "tokens": sum(lengths[i] for i in passed),
        "padded_tokens": padded - sum(lengths[i] for i in passed),
        "response_tokens": sum(len(examples[i].response_ids) for i in passed),
        "head_positions": head,
    }


def job_config(args, output_dir: Path, model_cache: str | None = None, feature_cache: str | None = None):
    """The job's config (``args.config``) with this benchmark's output folder, caches and limits."""
    values = read_config_file(args.config)
    flat = {k: v for section in values.values() for k, v in section.items()} if _nested(values) else dict(values)
    flat.update(output_dir=str(output_dir), progress=False, device=args.device)
    if model_cache is not None:
        flat["model_cache_dir"] = model_cache
    if feature_cache is not None:
        flat["feature_cache_dir"] = feature_cache
    if args.max_steps is not None:
        flat["max_steps"] = args.max_steps
    if args.max_examples is not None:
        flat["max_examples"] = args.max_examples
    return build_config(flat)


def floor_only(args) -> None:
    """The job's floor without running it: its data read and tokenised, the useful FLOPs of each phase it would
    run (the steps it is configured for, its validations, its verdict) at this CPU's matmul rate."""
    config = job_config(args, Path(tempfile.gettempdir()) / "main_job-floor-unused")
    device = trainer.choose_device(config.train.device, "TrainConfig.device")
    decoder, tokenizer = trainer._decoder_and_tokenizer(config, None, device)
    data = trainer.prepare_data(config, tokenizer, None)
    tcfg = config.train
    validations = sum(trainer._due(tcfg.eval_every, step, tcfg.max_steps) for step in range(1, tcfg.max_steps + 1))
    flops = useful_flops(
        decoder,
        tcfg.max_steps,
        config,
        {"train": data.train, "validation": data.validation},
        validations,
        str(device),
        tokenizer.pad_token_id,
    )
    if flops is None:
        raise SystemExit(
            "flops.py does not count this job's work (memory placement, no feature cache, trained decoder)"
        )
    rate = floor_rate(flops)
    print(
        f"floor of {args.config}: {len(data.train)} training and {len(data.validation)} validation pairs, "
        f"{tcfg.max_steps} steps of {tcfg.batch_size}, {validations} validations; torch.matmul's {flops['dtype']} "
        f"rate at the step's shapes, {torch.get_num_threads()} threads: {rate / 1e9:.0f} GFLOP/s"
    )
    print("| phase | useful TFLOP | seconds at 100 % of that rate |")
    print("| --- | ---: | ---: |")
    for name, key in (*FLOOR_PHASES, ("**all four**", "total")):
        print(f"| {name} | {flops[key] / 1e12:.1f} | {flops[key] / rate:.0f} |")
    print(
        json.dumps(
            {
                "floor_seconds": round(flops["total"] / rate, 1),
                "matmul_gflops": round(rate / 1e9, 1),
                **{k: v for k, v in flops.items() if k in ("frozen_pass", "steps", "validation", "verdict", "total")},
            }
        )
    )


def run_once(args, label: str, model_cache: str | None, feature_cache: str | None) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"main_job-{label}-"))
    config = job_config(args, out / "run", model_cache, feature_cache)
    examples_seen = {}
    original_prepare = trainer.prepare_data

    def prepare(*a, **k):
        data = original_prepare(*a, **k)
        examples_seen["train"], examples_seen["validation"] = data.train, data.validation
        return data

    trainer.prepare_data = prepare
    try:
        with Timers() as timers:
            start = time.perf_counter()
            result = trainer.train(config)
            # What `disentangle train` does next: the verdict on the validation split.
            verdict_start = time.perf_counter()
            train_verdict(result, config)
            timers.calls["verdict"].append(time.perf_counter() - verdict_start)
            total = time.perf_counter() - start
    finally:
        trainer.prepare_data = original_prepare
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    every = examples_seen.get("train", []) + examples_seen.get("validation", [])
    seconds = {phase: sum(timers.calls.get(phase, [])) for phase in ORDER[:-2]}
    seconds["other"] = total - sum(seconds.values())
    seconds["total"] = total
    steps = timers.calls.get("steps", [])
    store = feature_store.last_stats
    return {
        "run": label,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "steps": len(steps),
        "step_mean_s": round(statistics.fmean(steps), 4) if steps else None,
        "step_median_s": round(statistics.median(steps), 4) if steps else None,
        "step_first_s": round(steps[0], 4) if steps else None,
        "validations": len(timers.calls.get("validation", [])),
        "checkpoints": len(timers.calls.get("checkpoints", [])),
        "feature_cache": {"hits": store.hits, "computed": store.computed} if config.train.feature_cache else None,
        "examples": len(every),
        "padding": padding(every, max(config.train.batch_size, 16)),
        "final_step": result.final_step,
        "useful_flops": useful_flops(
            result.model.decoder,
            result.final_step,
            config,
            examples_seen,
            len(timers.calls.get("validation", [])),
            str(result.model.decoder.device),
            result.pad_token_id,
        ),
        "output": str(out) if args.keep else None,
    }


def warm_run_in_new_process(args, caches: Path) -> dict:
    """The second run as a user makes it: a new process on the caches the first filled. Its log passes through;
    its run comes back as JSON in a file."""
    command = [sys.executable, __file__, "--config", args.config, "--caches", "warm", "--cache-dir", str(caches)]
    for flag, value in (
        ("--threads", args.threads),
        ("--max-steps", args.max_steps),
        ("--max-examples", args.max_examples),
    ):
        if value is not None:
            command += [flag, str(value)]
    command += ["--device", args.device] + (["--keep"] if args.keep else [])
    with tempfile.TemporaryDirectory(prefix="main_job-warm-") as folder:
        handoff = Path(folder) / "run.json"
        result = subprocess.run([*command, "--json", str(handoff)], check=False)
        if result.returncode != 0 or not handoff.is_file():
            raise SystemExit(
                f"the warm run (a new process) failed with exit status {result.returncode}: {' '.join(command)}"
            )
        run = json.loads(handoff.read_text())[0]
    run["run"] = "warm caches (2nd run, new process)"
    return run


def verdict_decodes(config) -> int:
    """Decoder passes per validation example of the verdict (``eval``'s scoring, ``CVAEBase.reusing_decodes``):
    every code combination of an exact prior mixture (the posterior's and the bound's codes are among them);
    else the mixture's samples, the posterior's decode and, except for the nearest code (whose bound is exact: its
    posterior decode), the bound's samples."""
    scoring = EvalOptions().scoring()
    if config.latent.latent == "discrete":
        combinations = config.latent.codebook_size**config.latent.num_slots
        if combinations <= scoring.exact_limit:
            return combinations
        if config.latent.assignment == "nearest":
            return scoring.prior_samples + 1
    return scoring.prior_samples + 1 + scoring.iw_samples


def useful_flops(
    decoder, steps: int, config, examples: dict, validations: int, device: str, pad_token_id: int
) -> dict[str, float] | None:
    """The run's useful FLOPs by phase (``flops.job_flops``), with the shapes it needs for the matmul rate; None
    where ``flops.py`` does not count the run's work (the memory placement, the frozen pass inside each step,
    the whole decoder trained, LoRA adapters on other than a Llama's projections, the divergence's extra
    decodes)."""
    lora = lora_adapters(config.model, decoder.config)
    uncounted = (
        config.latent.latent_placement == "memory"
        or not config.train.feature_cache
        or config.model.decoder_training == "full"
        or (config.model.decoder_training == "lora" and lora is None)
        or config.divergence.divergence_weight
    )
    if uncounted or "train" not in examples:
        return None
    shape = DecoderShape.from_config(decoder.config)
    train = [(len(e.prompt_ids), len(e.response_ids)) for e in examples["train"]]
    validation = [(len(e.prompt_ids), len(e.response_ids)) for e in examples["validation"]]
    passed = examples["train"] + examples["validation"]  # the frozen pass: each distinct example once
    out = job_flops(
        shape,
        train,
        validation,
        config.latent.latent_tokens,
        steps=steps,
        batch_size=config.train.batch_size * config.train.gradient_accumulation_steps,
        validated=validation[: config.train.eval_batches * config.train.batch_size],  # validation.validate's
        validations=validations,
        verdict_decodes=verdict_decodes(config) if validation else 0,
        shared_prefix_positions=shared_prefix_positions(passed, pad_token_id, max(config.train.batch_size, 16)),
        frozen=[(len(passed[i].prompt_ids), len(passed[i].response_ids)) for i in set(first_copies(passed))],
        lora=lora if config.model.decoder_training == "lora" else None,
    )
    mean_length = statistics.fmean(p + r for p, r in train) + config.latent.latent_tokens
    out["matmul_rows"] = round(config.train.batch_size * mean_length)
    out["head_rows"] = round(config.train.batch_size * statistics.fmean(r for _, r in train))
    out["dtype"] = str(next(decoder.parameters()).dtype).removeprefix("torch.")
    out["device"] = device
    out["shape"] = dataclasses.asdict(shape)
    return out


def lora_adapters(model_config, decoder_config) -> Lora | None:
    """The run's LoRA adapters as ``flops.Lora`` (``lora_target_modules``, or peft's default for the model type),
    or None where they are not all Llama projections, which ``flops.py`` counts."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    modules = model_config.lora_target_modules
    if modules is None:
        modules = PEFT_DEFAULTS.get(getattr(decoder_config, "model_type", None))
    if not modules or not set(modules) <= set(LLAMA_PROJECTIONS):
        return None
    return Lora(rank=model_config.lora_r, modules=tuple(modules))


def floor_rate(flops: dict) -> float:
    """torch.matmul's FLOP/s at the shapes, dtype and device :func:`useful_flops` recorded for the run."""
    shape, dtype = DecoderShape(**flops["shape"]), getattr(torch, flops["dtype"])
    return matmul_rate_at(shape, flops["matmul_rows"], flops["head_rows"], dtype, torch.device(flops["device"]))


FLOOR_PHASES = (
    ("frozen pass", "frozen_pass"),
    ("steps", "steps"),
    ("validation", "validation"),
    ("verdict", "verdict"),
)


def print_floor(runs: list[dict], args) -> None:
    """Each run's useful FLOPs by phase, the seconds they take at this CPU's torch.matmul rate (the floor: 100 %
    of the rate) and the share of that rate each phase reached."""
    first = next((r["useful_flops"] for r in runs if r.get("useful_flops")), None)
    if first is None:
        return
    rate = floor_rate(first)
    print(
        f"\nuseful FLOPs (flops.job_flops) at torch.matmul's {first['dtype']} rate at the step's shapes, "
        f"{torch.get_num_threads()} threads: {rate / 1e9:.0f} GFLOP/s"
    )
    print("| phase | " + " | ".join(f"{r['run']}: TFLOP, floor s, measured s, of the rate" for r in runs) + " |")
    print("| --- |" + " ---: |" * len(runs))
    totals = [[0.0, 0.0] for _ in runs]
    for name, key in FLOOR_PHASES:
        cells = []
        for i, r in enumerate(runs):
            flops = r["useful_flops"][key]
            if name == "frozen pass":  # only the examples the feature cache lacked were computed
                cache = r["feature_cache"]
                flops *= cache["computed"] / max(1, cache["computed"] + cache["hits"])
            measured = r["seconds"][name]
            totals[i][0] += flops
            totals[i][1] += measured
            share = f"{100 * flops / rate / measured:.0f} %" if flops and measured else "-"
            cells.append(f"{flops / 1e12:.1f}, {flops / rate:.0f}, {measured:.0f}, {share}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{f / 1e12:.1f}, **{f / rate:.0f}**, {m:.0f}, {100 * f / rate / m:.0f} %" for f, m in totals]
    print("| **these phases** | " + " | ".join(cells) + " |")
    for r, (flops, _) in zip(runs, totals, strict=True):
        r["floor_seconds"] = round(flops / rate, 1)
        r["matmul_gflops"] = round(rate / 1e9, 1)


def _nested(values: dict) -> bool:
    return any(isinstance(v, dict) for v in values.values())


def print_table(runs: list[dict], args) -> None:
    print()
    print(
        f"main job: {args.config}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, device {args.device}"
        + (f", --max-steps {args.max_steps}" if args.max_steps is not None else "")
        + (f", --max-examples {args.max_examples}" if args.max_examples is not None else "")
    )
    header = "| phase | " + " | ".join(r["run"] for r in runs) + " |"
    print(header)
    print("| --- |" + " ---: |" * len(runs))
    for phase in ORDER:
        cells = []
        for r in runs:
            s = r["seconds"][phase]
            if phase == "steps":
                cells.append(f"{s:.1f} ({r['steps']} x {r['step_mean_s']:.3f} mean, {r['step_median_s']:.3f} median)")
            elif phase == "validation":
                cells.append(f"{s:.1f} ({r['validations']} x)")
            elif phase == "checkpoints":
                cells.append(f"{s:.1f} ({r['checkpoints']} x)")
            elif phase == "frozen pass" and r["feature_cache"] is not None:
                fc = r["feature_cache"]
                cells.append(f"{s:.1f} ({fc['computed']} computed, {fc['hits']} from the cache)")
            else:
                cells.append(f"{s:.1f}")
        name = f"**{phase}**" if phase == "total" else phase
        print(f"| {name} | " + " | ".join(cells) + " |")
    pad = runs[0]["padding"]
    print(
        f"frozen pass packing ({pad['passed']} distinct of {runs[0]['examples']} examples, sorted by length, "
        "batches of 16): "
        f"{pad['padded_tokens']} padding tokens of {pad['tokens'] + pad['padded_tokens']} "
        f"({100 * pad['padded_tokens'] / max(1, pad['tokens'] + pad['padded_tokens']):.2f}%); LM head at "
        f"{pad['head_positions']} positions for {pad['response_tokens']} response tokens"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--caches", choices=("both", "empty", "warm", "user"), default="both")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="the model and feature cache folders' parent (kept): empty for --caches empty, filled for warm",
    )
    parser.add_argument(
        "--floor-only",
        action="store_true",
        help="do not run the job: print its useful FLOPs by phase and the seconds they take at this CPU's matmul rate",
    )
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)  # the warm child's handoff
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="with --caches both, run the warm run in this process after the empty one (default: each run in a "
        "process of its own, as a user's second run is)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--max-steps", type=int, default=None, help="instead of the config's (a quick check)")
    parser.add_argument("--max-examples", type=int, default=None, help="use only this many pairs (a quick check)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders and the empty-cache folders")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.floor_only:
        floor_only(args)
        return 0
    if args.cache_dir is not None and args.caches == "user":
        parser.error("--cache-dir cannot be used with --caches user (the config's and the environment's caches)")
    if args.same_process and args.caches != "both":
        parser.error("--same-process needs --caches both (it runs the warm run after the empty one in this process)")
    folders = None if args.cache_dir is None else (args.cache_dir / "models", args.cache_dir / "features")
    if folders and args.caches in ("empty", "both") and any(f.is_dir() and any(f.iterdir()) for f in folders):
        parser.error(f"--caches {args.caches} needs an empty --cache-dir, and {args.cache_dir} holds caches")
    if args.caches == "warm" and not (folders and all(f.is_dir() and any(f.iterdir()) for f in folders)):
        parser.error("--caches warm needs a --cache-dir that an earlier --caches empty run filled")
    runs = []
    if args.caches == "user":
        runs.append(run_once(args, "user caches", None, None))
    elif args.caches in ("empty", "warm") and folders:
        runs.append(run_once(args, f"{args.caches} caches", *map(str, folders)))
    else:
        caches = args.cache_dir or Path(tempfile.mkdtemp(prefix="main_job-caches-"))
        try:
            model_cache, feature_cache = str(caches / "models"), str(caches / "features")
            runs.append(run_once(args, "empty caches", model_cache, feature_cache))
            if args.caches == "both" and args.same_process:
                runs.append(run_once(args, "warm caches (2nd run, same process)", model_cache, feature_cache))
            elif args.caches == "both":
                runs.append(warm_run_in_new_process(args, caches))
        finally:
            if not args.keep and args.cache_dir is None:
                shutil.rmtree(caches, ignore_errors=True)
    if args.json is not None:  # the warm child: hand the run back, leave the tables to the parent
        args.json.write_text(json.dumps(runs))
        return 0
    print_table(runs, args)
    print_floor(runs, args)
    for r in runs:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
