"""Side by side with the peers: LangVAE, peft prompt tuning and this tool's CVAEs on one decoder and one data set.

    bash benchmarks/peers/run.sh [--rows 200] [--steps 40] [--batch-size 8] [--seed 0] [--out runs/peers]

``run.sh`` makes LangVAE's own virtual environment (``benchmarks/peers/.venv-langvae``), then calls
``peers.py all``, which, in the project's venv:

1. writes the ``two-factor`` hidden-factor set (``disentangle data synth two-factor``; factors ``A``, ``B``)
   and saves the embedded SmolLM2-135M-Instruct (float32) as a Hugging Face directory that every
   system loads (its ``config.json`` and ``tokenizer_config.json`` carry the keys that transformers
   4.48, LangVAE's pin, reads as well);
2. runs each system in a fresh subprocess pinned as the parent is (one after the other, never two at
   once), with the same batch size and number of steps:

   * ``langvae``: LangVAE's sentence VAE (``langvae_side.py``, in LangVAE's venv);
   * ``peft``: peft prompt tuning (``PromptTuningConfig``, as many virtual tokens as our
     ``latent_tokens``), the standard forward with ``labels`` and full logits, on exactly the
     batches our trainer draws (same tokenisation, split and :class:`DataOrder`);
   * ``ours-discrete``, ``ours-continuous``: :func:`disentanglement.trainer.train` (what
     ``disentangle train`` runs) on ``benchmarks/thesis/base.yaml`` with the main job's
     reconstruction recipe, then ``disentangle eval``'s own scoring (``factor_agreements``, the
     posterior pass) on all rows of the file;
3. prints the Markdown table and, as its last line, one JSON object
   ``{"step_ms", "tokens_per_s", "peak_mib", "nmi", "nll", "unavailable", ...}``, each keyed by system.

Measured per step (a step: forward, backward, optimizer step; the first ``--warmup`` steps are not
counted): median wall time, scored (response) tokens per second over the counted steps, and peak
memory as the process's resident-set high-water mark (``VmHWM`` of ``/proc/self/status``, reset through
``/proc/self/clear_refs`` after the warm-up steps), so it includes the decoder's weights. Per run:
NMI of the latent with each factor (sklearn ``normalized_mutual_info_score``; discrete: the argmax
code; continuous: k-means on the posterior means, as many clusters as values) and the per-token NLL
of the responses reached (under the posterior latent for the VAEs, under the learned prompt for peft).

``peers.py seeds DIR...`` puts the latents of several such calls (one per ``--seed``) side by side:
per system, each factor's NMI, its k-means baseline and the NLL, seed by seed.

The table-building code (:func:`markdown_table`, :func:`final_json`, :func:`seeds_table`) imports nothing
beyond the standard library, so ``tests/test_peers.py`` runs it in the main venv.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BASE_YAML = ROOT / "benchmarks" / "thesis" / "base.yaml"
SYSTEMS = ("ours-continuous", "ours-discrete", "peft", "langvae")  # the slowest last
RESULT_KEYS = ("step_ms", "tokens_per_s", "peak_mib", "nmi", "nll")

# ------------------------------------------------------------------------------------- measuring


def peak_rss_mib() -> float:
    """The process's resident-set high-water mark (``VmHWM``), MiB."""
    match = re.search(r"VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
    return int(match.group(1)) / 1024 if match else float("nan")


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current resident set (Linux: write 5 to ``/proc/self/clear_refs``)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


class StepClock:
    """Times steps by the instants at which they end; the peak RSS is reset after the warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ends: list[float] = []
        self.tokens: list[int] = []
        self.peak_mib = float("nan")

    def start(self) -> None:
        self.ends.append(time.perf_counter())

    def step_done(self, tokens: int) -> None:
        self.ends.append(time.perf_counter())
        self.tokens.append(tokens)
        if len(self.tokens) == self.warmup:
            reset_peak_rss()

    def finish(self) -> None:
        self.peak_mib = peak_rss_mib()

    def summary(self) -> dict[str, Any]:
        """Median step time, tokens per second and peak RSS over the steps after the warm-up.

        Without :meth:`start` the first step has no start instant and the intervals begin at step 2."""
        intervals = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        first = len(self.tokens) - len(intervals) + 1  # the step (1-based) that the first interval ends
        pairs = [
            (s, t)
            for k, (s, t) in enumerate(zip(intervals, self.tokens[first - 1 :], strict=True), first)
            if k > self.warmup
        ]
        if not pairs:
            raise ValueError("no step was timed after the warm-up")
        seconds, tokens = [s for s, _ in pairs], [t for _, t in pairs]
        return {
            "step_ms": 1000 * statistics.median(seconds),
            "tokens_per_s": sum(tokens) / sum(seconds),
            "peak_mib": self.peak_mib,
            "timed_steps": len(seconds),
            "tokens_per_step": sum(tokens) / len(tokens),
        }


def kmeans_nmi(features: Any, labels: Sequence[dict[str, str]], seed: int = 0) -> dict[str, float]:
    """NMI with each factor of k-means (as many clusters as the factor has values) on ``features``."""
    import numpy as np
    from sklearn.cluster import KMeans
    from sklearn.metrics import normalized_mutual_info_score

    features = np.asarray(features, dtype=np.float64)
    out = {}
    for name in sorted(labels[0]):
        values = [row[name] for row in labels]
        k = len(set(values))
        clusters = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(features)
        out[name] = float(normalized_mutual_info_score(values, clusters))
    return out


# ------------------------------------------------------------------------------------- the table


def _fmt(value: Any, digits: int) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and value != value:
        return "n/a"
    return f"{value:,.{digits}f}"


def factor_names(results: dict[str, dict]) -> list[str]:
    names: set[str] = set()
    for result in results.values():
        names.update((result.get("nmi") or {}).keys())
    return sorted(names)


def markdown_table(results: dict[str, dict]) -> str:
    """The per-system measurements as a Markdown table (one row per system, in the given order).

    ``results[system]`` holds ``step_ms``, ``tokens_per_s``, ``peak_mib``, ``nmi`` (``{factor: NMI}``,
    or None for a system without a latent) and ``nll``, or ``unavailable`` (the reason) and nothing else;
    where some system has ``baselines_nmi`` (``{factor: {"encoder_kmeans": NMI}}``: k-means of the frozen
    features its encoder reads, no training), a "k-means" column per factor sits beside its NMI column.
    Its clusters: as many as the factor has values for LangVAE and our continuous latent, as many as the
    codes the latent uses for our discrete one (``metrics.factor_agreement``; the same when no code is dead)."""
    factors = factor_names(results)
    with_baselines = any(result.get("baselines_nmi") for result in results.values())
    header = ["system", "step ms (median)", "tokens/s", "peak RSS MiB"]
    for f in factors:
        header += [f"NMI {f}"] + ([f"{f}: k-means of its features"] if with_baselines else [])
    header.append("NLL nats/token")
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |"]
    for system, result in results.items():
        if result.get("unavailable"):
            reason = str(result["unavailable"]).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {system} | unavailable: {reason} |" + " |" * (len(header) - 2))
            continue
        nmi = result.get("nmi")
        cells = [
            system,
            _fmt(result.get("step_ms"), 0),
            _fmt(result.get("tokens_per_s"), 0),
            _fmt(result.get("peak_mib"), 0),
        ]
        baselines = result.get("baselines_nmi") or {}
        for f in factors:
            cells.append("no latent" if nmi is None else _fmt(nmi.get(f), 3))
            if with_baselines:
                cells.append(_fmt(baselines.get(f, {}).get("encoder_kmeans"), 3))
        cells.append(_fmt(result.get("nll"), 3))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seeds_table(runs: Sequence[dict[str, Any]]) -> str:
    """The latents of several ``all`` calls side by side: one row per system with a latent, and in each
    cell the values of every run, in the given order (``runs``: their ``results.json``), separated by " / "."""
    seeds = [run["settings"]["seed"] for run in runs]
    for run in runs[1:]:  # seeds of one experiment: everything else the same
        differ = sorted(k for k in run["settings"] if k != "seed" and run["settings"][k] != runs[0]["settings"].get(k))
        if differ:
            raise ValueError(f"seeds_table: runs differ in {', '.join(differ)}, not only in the seed")
    systems = [
        s
        for s in dict.fromkeys(k for run in runs for k in run["details"])
        if any((run["details"].get(s) or {}).get("nmi") for run in runs)  # a latent somewhere (not peft)
    ]
    factors = factor_names({f"{i}-{s}": r for i, run in enumerate(runs) for s, r in run["details"].items()})

    def cell(system: str, value) -> str:
        out = []
        for run in runs:
            result = run["details"].get(system) or {"unavailable": "not run"}
            out.append("–" if result.get("unavailable") else _fmt(value(result), 3))
        return " / ".join(out)

    header = ["system"]
    for f in factors:
        header += [f"NMI {f}", f"{f}: k-means of its features"]
    header.append("NLL nats/token")
    lines = [
        f"seeds {' / '.join(map(str, seeds))}",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(["---"] * len(header)) + " |",
    ]
    for system in systems:
        cells = [system]
        for f in factors:
            cells.append(cell(system, lambda r, f=f: (r.get("nmi") or {}).get(f)))
            cells.append(cell(system, lambda r, f=f: (r.get("baselines_nmi") or {}).get(f, {}).get("encoder_kmeans")))
        cells.append(cell(system, lambda r: r.get("nll")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def final_json(results: dict[str, dict], extra: dict[str, Any] | None = None) -> str:
    """The last line: ``{"step_ms": {system: ...}, "tokens_per_s", "peak_mib", "nmi", "nll", "unavailable"}``
    (an unavailable system is None under every measurement and its reason under ``unavailable``)."""
    out: dict[str, Any] = {key: {} for key in RESULT_KEYS}
    out["unavailable"] = {}
    for system, result in results.items():
        reason = result.get("unavailable")
        for key in RESULT_KEYS:
            value = None if reason else result.get(key)
            if isinstance(value, float):
                value = round(value, 4)
            elif isinstance(value, dict):
                value = {k: round(v, 4) if isinstance(v, float) else v for k, v in value.items()}
            out[key][system] = value
        if reason:
            out["unavailable"][system] = str(reason)
    out.update(extra or {})
    return json.dumps(out, sort_keys=False)


def goals(results: dict[str, dict]) -> dict[str, Any]:
    """The issue's two goals: our full CVAE step (discrete and continuous) no slower than peft's, and
    each of our latents' NMI (per factor, and its best factor) at least LangVAE's."""
    out: dict[str, Any] = {}
    peft, langvae = results.get("peft", {}), results.get("langvae", {})
    for ours in ("ours-discrete", "ours-continuous"):
        mine = results.get(ours, {})
        if mine.get("unavailable") or not mine:
            continue
        if peft and not peft.get("unavailable"):
            ratio = mine["step_ms"] / peft["step_ms"]
            out[f"{ours}_step_over_peft"] = round(ratio, 3)
            out[f"{ours}_step_no_slower_than_peft"] = ratio <= 1.0
        if langvae and not langvae.get("unavailable") and langvae.get("nmi") and mine.get("nmi"):
            out[f"{ours}_nmi_at_least_langvae"] = {
                f: mine["nmi"].get(f, 0.0) >= langvae["nmi"][f] for f in sorted(langvae["nmi"])
            } | {"best": max(mine["nmi"].values()) >= max(langvae["nmi"].values())}
    return out


# ------------------------------------------------------------------------------------- set-up


def our_config(out: Path, data: Path, model_dir: Path, latent: str, steps: int, batch_size: int, seed: int):
    """``benchmarks/thesis/base.yaml`` with the main job's reconstruction recipe, for this benchmark's run."""
    from disentanglement.config import resolve_config

    overrides = dict(
        model=str(model_dir),
        data=str(data),
        latent=latent,
        max_response_tokens=32,
        # the peers' comparison recipe (preset term3, over the thesis base's frozen decoder): term 3 only at alpha 2,
        # token-weighted encoder view
        reconstruction_weight=0.0,
        token_weighted_weight=1.0,
        normalized_concentration_corrected_token_weighted_weight=0.0,
        token_weight_alpha=2.0,
        encoder_view="token_weighted",
        max_steps=steps,
        batch_size=batch_size,
        beta_warmup_steps=min(30, steps // 2),
        save_every=steps,  # one checkpoint, after the last step (the median step time does not see it)
        eval_every=0,
        seed=seed,
        progress=False,
        overwrite=True,
        output_dir=str(out / "runs" / f"ours-{latent}"),
    )
    return resolve_config(BASE_YAML, overrides)


def prepare(out: Path, rows: int, seed: int) -> tuple[Path, Path]:
    """The data file and the Hugging Face directory of the embedded decoder (made once)."""
    import torch

    from disentanglement.config import ModelConfig
    from disentanglement.lm import load_model_and_tokenizer
    from disentanglement.synthetic import write_synthetic

    out.mkdir(parents=True, exist_ok=True)
    data = out / f"two-factor-{rows}-{seed}.jsonl"
    write_synthetic("two-factor", data, rows=rows, seed=seed)
    model_dir = out / "smollm2-135m-instruct"
    if not (model_dir / "model.safetensors").exists():
        model, tokenizer = load_model_and_tokenizer(ModelConfig(), dtype=torch.float32)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        legacy_model_dir(model_dir, tokenizer)
    return data, model_dir


def legacy_model_dir(model_dir: Path, tokenizer: Any) -> None:
    """Add the keys that transformers 4.x reads to a directory saved by transformers 5 (which writes
    ``rope_parameters`` and ``dtype`` instead of ``rope_theta`` and ``torch_dtype``, and names its own
    tokenizer class): without ``rope_theta`` 4.48 would silently use the default 10,000, not SmolLM2's 100,000."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    tok_path = model_dir / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    if getattr(tokenizer, "chat_template", None):
        tok.setdefault("chat_template", tokenizer.chat_template)
    tok_path.write_text(json.dumps(tok, indent=2) + "\n")


def write_plan(out: Path, data: Path, model_dir: Path, steps: int, batch_size: int, seed: int) -> Path:
    """``plan.json``: the data file's row of every example of every step of our trainer (its tokenisation,
    split and :class:`DataOrder`), and of every example evaluated (train, then validation), for LangVAE."""
    from transformers import AutoTokenizer

    from disentanglement.data import DataOrder, load_pairs
    from disentanglement.trainer import prepare_data

    config = our_config(out, data, model_dir, "discrete", steps, batch_size, seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prepared = prepare_data(config, tokenizer, load_pairs(config.data))

    def row(example) -> int:  # a JSONL pair's source is "PATH:LINE", lines counted from 1
        return int(example.source.rsplit(":", 1)[1]) - 1

    order = DataOrder(len(prepared.train), config.train.seed)
    plan = {
        "steps": [[row(prepared.train[i]) for i in order.next_indices(batch_size)] for _ in range(steps)],
        "eval_rows": [row(e) for e in prepared.train + prepared.validation],
        "train_rows": len(prepared.train),
    }
    path = out / "plan.json"
    path.write_text(json.dumps(plan) + "\n")
    return path


# ------------------------------------------------------------------------------------- the systems


def run_ours(args: argparse.Namespace, latent: str) -> dict[str, Any]:
    """Our CVAE through the trainer (steps timed by its per-step callback), then the evaluation on every row."""
    import torch
    from transformers import AutoTokenizer

    from disentanglement.data import DataOrder
    from disentanglement.trainer import train

    torch.set_num_threads(args.threads)
    config = our_config(args.out, args.data, args.model_dir, latent, args.steps, args.batch_size, args.seed)
    clock = StepClock(args.warmup)  # no start instant: the set-up (model, data, frozen pass) runs before step 1

    def on_step(step: int, record: dict) -> None:
        clock.step_done(0)  # tokens filled in below, from the same data order
        if step == args.steps:
            clock.finish()

    start = time.perf_counter()
    result = train(config, callbacks=[on_step])
    train_seconds = time.perf_counter() - start
    order = DataOrder(len(result.data.train), config.train.seed)
    clock.tokens = [
        sum(len(result.data.train[i].response_ids) for i in order.next_indices(args.batch_size))
        for _ in range(args.steps)
    ]
    examples = result.data.train + result.data.validation
    pad = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True).pad_token_id
    factors, nll, zfree_nll = our_scores(result.model, examples, result.cache, pad, args.seed)
    return {
        **clock.summary(),
        "nmi": {name: float(f["latent"]["nmi"]) for name, f in sorted(factors.items())},
        "nll": nll,
        "zfree_nll": zfree_nll,
        "baselines_nmi": {
            name: {"encoder_kmeans": float(f["encoder_kmeans"]["nmi"]), "prior_kmeans": float(f["prior_kmeans"]["nmi"])}
            for name, f in sorted(factors.items())
        },
        "eval_examples": len(examples),
        "train_examples": len(result.data.train),
        "train_seconds_with_setup": round(train_seconds, 1),
        "trainable_parameters": sum(p.numel() for p in result.model.parameters() if p.requires_grad),
    }


def run_peft(args: argparse.Namespace) -> dict[str, Any]:
    """peft prompt tuning on our trainer's batches: standard forward with labels (full logits), AdamW."""
    import torch
    from peft import PromptTuningConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from disentanglement.data import DataOrder, collate, load_pairs
    from disentanglement.trainer import prepare_data

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = our_config(args.out, args.data, args.model_dir, "discrete", args.steps, args.batch_size, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, local_files_only=True)
    data = prepare_data(config, tokenizer, load_pairs(config.data))
    peft_config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=config.latent.latent_tokens)
    model = get_peft_model(base, peft_config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.train.latent_lr)
    order = DataOrder(len(data.train), config.train.seed)
    pad = tokenizer.pad_token_id

    def labelled(examples):
        batch = collate(examples, pad)
        labels = batch.input_ids.masked_fill(batch.target_mask == 0, -100)
        return batch, labels

    clock = StepClock(args.warmup)
    clock.start()
    for _ in range(args.steps):
        batch, labels = labelled([data.train[i] for i in order.next_indices(args.batch_size)])
        optimizer.zero_grad(set_to_none=True)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
        out.loss.backward()
        optimizer.step()
        clock.step_done(int(batch.target_mask.sum()))
    clock.finish()

    model.eval()
    examples = data.train + data.validation
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            batch, labels = labelled(examples[i : i + 16])
            n = int(batch.target_mask.sum())
            loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
            total, count = total + float(loss) * n, count + n
    return {
        **clock.summary(),
        "nmi": None,
        "nll": total / count,
        "eval_examples": len(examples),
        "train_examples": len(data.train),
        "num_virtual_tokens": config.latent.latent_tokens,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


# ------------------------------------------------------------------------------------- orchestration


def our_scores(model: Any, examples: Sequence[Any], cache: Any, pad: int, seed: int) -> tuple[dict, float, float]:
    """What ``disentangle eval`` reports of NMI and NLL, by its own functions, without its prior-mixture and
    importance-sampling passes (each a decoder pass per latent, too slow for this benchmark on one busy core):
    ``factors`` (:func:`evaluation.factor_agreements`: argmax code, or k-means on the posterior means with as
    many clusters as values, beside k-means baselines), and the mean per-token NLL under the posterior latent
    (its ``posterior_nll_nats_per_token``) and of the z-free reference (``zfree_nll_nats_per_token``)."""
    import torch

    from disentanglement.data import collate
    from disentanglement.evaluation import batch_weighting, example_factor_values, factor_agreements, posterior_latents

    model.eval()
    posterior_sum = zfree_sum = count = 0.0
    with torch.no_grad():
        latents = posterior_latents(model, examples, cache, pad)
        factors = factor_agreements(model, latents, example_factor_values(examples), cache, seed=seed)
        for start in range(0, len(examples), 16):
            indices = list(range(start, min(start + 16, len(examples))))
            batch = collate([examples[i] for i in indices], pad, indices=indices)
            features = cache.features(batch)
            summary = model.posterior_summary(features)
            posterior, target = model.conditioned_token_nll(batch, summary.vector)
            weighting = batch_weighting(model, batch, features, posterior.float())
            posterior_sum += float((posterior.float() * target).sum())
            zfree_sum += float((weighting.aligned_base_token_nll.float() * target).sum())
            count += float(target.sum())
    return factors, posterior_sum / count, zfree_sum / count


def _subprocess_result(command: list[str], result_path: Path, log_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one system; its result file, or ``{"unavailable": reason}`` with the last error line."""
    result_path.unlink(missing_ok=True)
    start = time.perf_counter()
    with log_path.open("w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    seconds = time.perf_counter() - start
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        lines = [line for line in log_path.read_text().splitlines() if line.strip()]
        errors = [line for line in lines if re.match(r"^[A-Za-z_.]+(Error|Exception)\b", line)]
        result = {"unavailable": f"exit {rc}: {(errors or lines or ['no output'])[-1][:300]} (log: {log_path})"}
    result.setdefault("process_seconds", round(seconds, 1))
    return result


def record_settings(result_path: Path, result: dict[str, Any], settings: dict[str, Any]) -> None:
    """Write ``result`` back to its file with the settings it was measured with (what ``--reuse`` checks)."""
    result_path.write_text(json.dumps(dict(result, settings=settings)) + "\n")


def reused_result(result_path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """An earlier call's result file for ``--reuse``, refused unless it was measured with the same settings."""
    result = json.loads(result_path.read_text())
    earlier = result.get("settings") or {}
    if earlier != settings:
        differ = sorted(k for k in settings.keys() | earlier.keys() if earlier.get(k) != settings.get(k))
        raise SystemExit(
            f"{result_path}: --reuse needs a result measured with the same settings; "
            + (f"it differs in {', '.join(differ)} (file {earlier}, now {settings})" if earlier else "it records none")
        )
    return dict(result, reused=True)


def run_all(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    settings = {
        "rows": args.rows,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "seed": args.seed,
        "threads": args.threads,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    data, model_dir = prepare(args.out, args.rows, args.seed)
    write_plan(args.out, data, model_dir, args.steps, args.batch_size, args.seed)
    common = [
        "--data",
        str(data),
        "--model-dir",
        str(model_dir),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
        "--threads",
        str(args.threads),
        "--out",
        str(args.out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    langvae_python = Path(args.langvae_python)
    systems = args.systems.split(",")
    # every file to reuse is checked before anything runs (a mismatch must not surface an hour in)
    reused = {
        system: reused_result(args.out / f"result-{system}.json", settings)
        for system in systems
        if system in args.reuse.split(",") and (args.out / f"result-{system}.json").exists()
    }
    results: dict[str, dict] = {}
    for system in systems:
        result_path = args.out / f"result-{system}.json"
        log_path = args.out / f"log-{system}.txt"
        if system in reused:  # a result of an earlier call, same settings
            results[system] = reused[system]
            continue
        if system == "langvae":
            if not langvae_python.exists():
                results[system] = {"unavailable": f"no LangVAE environment ({langvae_python}); run run.sh"}
                continue
            command = [str(langvae_python), str(HERE / "langvae_side.py"), *common, "--result", str(result_path)]
        else:
            command = [sys.executable, str(Path(__file__).resolve()), system, *common, "--result", str(result_path)]
        print(f"[peers] {system} ...", file=sys.stderr, flush=True)
        results[system] = _subprocess_result(command, result_path, log_path, env)
        if result_path.exists():
            record_settings(result_path, results[system], settings)
        print(f"[peers] {system}: {json.dumps(results[system])}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    extra = {
        "goals": goals(results),
        "settings": settings,
        "details": results,
        "wall_s": round(wall, 1),
    }
    (args.out / "results.json").write_text(json.dumps(extra, indent=2) + "\n")
    print(markdown_table(results))
    print(f"goals: {json.dumps(extra['goals'])}; wall {wall:.0f} s")
    print(final_json(results, extra))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["all", "seeds", "peft", "ours-discrete", "ours-continuous"])
    parser.add_argument("dirs", nargs="*", type=Path, help="seeds: the --out folders of earlier `all` calls")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peers")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="which to run, in this order")
    parser.add_argument("--reuse", default="", help="systems whose result file of an earlier call is taken as is")
    parser.add_argument("--langvae-python", default=str(HERE / ".venv-langvae" / "bin" / "python"))
    parser.add_argument("--data", type=Path)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--result", type=Path)
    args = parser.parse_args(argv)
    if args.dirs and args.what != "seeds":
        parser.error(f"{args.what} takes no folders ({', '.join(map(str, args.dirs))}); use --out")
    if args.what == "all":
        run_all(args)
        return
    if args.what == "seeds":
        missing = [str(d / "results.json") for d in args.dirs if not (d / "results.json").is_file()]
        if missing or not args.dirs:
            parser.error(f"seeds needs the --out folders of finished `all` calls; no results.json in {missing}")
        try:
            print(seeds_table([json.loads((d / "results.json").read_text()) for d in args.dirs]))
        except ValueError as error:
            parser.error(str(error))
        return
    result = run_peft(args) if args.what == "peft" else run_ours(args, args.what.split("-")[1])
    args.result.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
