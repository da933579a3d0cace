"""Two CPU processes (gloo) under ``accelerate launch`` train what one process trains with the global batch.

The launched processes run the ``disentangle`` command line (``tests/ddp_child.py`` watches them from
inside) on the tiny Llama saved as a Hugging Face directory (``--model DIR``), so nothing in memory has
to reach them. ``accelerate launch --cpu --num_processes 2`` starts ONE process in accelerate 1.x unless
MPI is set up, so the launch is ``--multi_gpu`` (torchrun) with ``--device cpu``: the trainer then asks
accelerate for the CPU, and the processes talk over gloo.

One launch of each kind, shared by the tests through module fixtures: an uninterrupted two-process run,
the same run killed after step 4 and resumed, and a two-process eval of the uninterrupted run's checkpoint;
beside them the one-process run with twice the batch, in this process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from disentanglement.commands import run_eval
from disentanglement.config import FIELDS, build_config, field_flag
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.trainer import train
from helpers import tiny_llama, tiny_tokenizer

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
PROCESSES, BATCH = 2, 2  # per process; the one-process run takes PROCESSES * BATCH
STEPS = 6
#: The run: a k-means codebook, refreshed at step 2 (the first half), codes restarted after 2 unused steps.
RUN = dict(
    preset="frozen",  # the decoder frozen and the straight-through uncentred (a centred run centres per process)
    dtype="float32",
    reconstruction_weight=1.0,  # the recipe the run was written against (the defaults before issue 23)
    token_weight_alpha=1.0,
    encoder_view="mean_last",
    chat_template=False,
    max_steps=STEPS,
    save_every=3,
    eval_every=3,
    eval_batches=2,
    warmup_steps=2,
    progress=False,
    validation_fraction=0.2,
    token_weighted_weight=0.5,
    normalized_concentration_corrected_token_weighted_weight=0.5,
    codebook_refresh_every=2,
    dead_code_steps=2,
    device="cpu",
)
#: float32 sums in another order: two half-batch means averaged (the loss, DDP's gradient average) instead
#: of one mean over the batch. Observed differences are about 1e-7 (see the report's figures).
RTOL, ATOL = 1e-5, 1e-6


def _flags(values: dict) -> list[str]:
    """Config fields as the command line's flags."""
    out = []
    for name, value in values.items():
        if name == "preset":
            out += ["--preset", value]
            continue
        flag = field_flag(FIELDS[name][1])
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(record_dir: Path, argv: list[str], timeout: float = 600, **env) -> subprocess.CompletedProcess:
    """``accelerate launch`` two CPU processes of ``ddp_child.py RECORD_DIR -- ARGV``."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(PROCESSES)]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(_free_port()), str(TESTS / "ddp_child.py"), str(record_dir), "--", *argv]
    child_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]), **env)
    child_env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes, also on a machine with GPUs
    return subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=timeout)


def records(record_dir: Path) -> list[dict]:
    return [torch.load(record_dir / f"rank{r}.pt", weights_only=False) for r in range(PROCESSES)]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@dataclass
class Workspace:
    root: Path
    values: dict  # the run's config fields, but output_dir and batch_size

    def args(self, output_dir: Path, **extra) -> list[str]:
        # Each run its own frozen-pass store (under the run), so that one run's pass is not another's.
        extra.setdefault("feature_cache_dir", str(output_dir / "feature_cache"))
        return ["train", *_flags(dict(self.values, output_dir=str(output_dir), batch_size=BATCH, **extra))]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("ddp")
    tokenizer = tiny_tokenizer(chat_template=False)
    tiny_llama(len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    pairs = make_hidden_factor_pairs([f"tell me about topic {i}" for i in range(40)], kind="clean", seed=0)
    data = root / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p.prompt, "response": p.response, "label": p.label}) + "\n" for p in pairs)
    )
    return Workspace(root, dict(RUN, model=str(root / "model"), data=str(data)))


@pytest.fixture(scope="module")
def two_processes(workspace):
    """The uninterrupted two-process run: ``(run_dir, per-rank records)``."""
    run_dir, record_dir = workspace.root / "two", workspace.root / "two-records"
    done = launch(record_dir, workspace.args(run_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir, records(record_dir)


@pytest.fixture(scope="module")
def one_process(workspace):
    """The same run in one process with the global batch (``PROCESSES x BATCH``)."""
    one = workspace.root / "one"
    config = build_config(
        dict(
            workspace.values,
            output_dir=str(one),
            batch_size=PROCESSES * BATCH,
            feature_cache_dir=str(one / "feature_cache"),
        )
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(config)
    finally:
        torch.set_num_threads(threads)


def test_two_processes_train_what_one_process_trains_with_the_global_batch(two_processes, one_process):
    run_dir, (rank0, _) = two_processes
    two, one = metrics(run_dir), metrics(one_process.output_dir)
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for a, b in zip(two, one, strict=True):
        assert set(a) == set(b)
        for key in ("loss", "reconstruction_loss", "codebook_loss", "commitment_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=RTOL, abs=ATOL), (a["step"], key)
        if "val_loss" in b:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=RTOL, abs=ATOL)
    expected = one_process.model.trainable_state_dict()
    assert rank0["weights"].keys() == expected.keys()
    for name, value in expected.items():
        # The decoder's input gradients summed over 2 rows a process against 4 in one: float32 rounding, up to
        # 1.5e-6 on a weight of the latent projection (of 0.09 at most) after 6 steps.
        atol = 5 * ATOL if name.startswith("latent_projection") else ATOL
        torch.testing.assert_close(rank0["weights"][name], value, rtol=RTOL, atol=atol, msg=name)
    # The sharded and gathered frozen pass is the one-process pass, bit for bit; so is c_base.
    entries = [
        {p.relative_to(d): load_file(str(p)) for p in (d / "feature_cache").rglob("*.safetensors")}
        for d in (run_dir, one_process.output_dir)
    ]
    assert entries[0].keys() == entries[1].keys() and len(entries[0]) == 40  # one entry per example
    for path, tensors in entries[1].items():
        assert tensors.keys() == entries[0][path].keys()
        assert all(torch.equal(entries[0][path][k], tensors[k]) for k in tensors), path
    stats = [json.loads((d / "data_stats.json").read_text()) for d in (run_dir, one_process.output_dir)]
    assert stats[0]["zfree_reference_scale"] == stats[1]["zfree_reference_scale"]


def test_every_process_holds_the_same_codebook(two_processes):
    _, (rank0, rank1) = two_processes
    assert rank0["start"] is not None and torch.equal(rank0["start"], rank1["start"]), "k-means start"
    assert rank0["refreshed"] == [2], "the k-means refresh ran once, on the main process"
    assert rank1["refreshed"] == []
    assert rank0["restarted"] and rank0["restarted"] == rank1["restarted"], "dead codes restarted in step"
    assert sorted(rank0["codebooks"]) == list(range(1, STEPS + 1))
    for step, codebook in rank0["codebooks"].items():
        assert torch.equal(codebook, rank1["codebooks"][step]), step
    for name, value in rank0["weights"].items():
        assert torch.equal(value, rank1["weights"][name]), name


def test_the_frozen_decoder_is_not_in_ddp_and_lora_trains_alike_on_every_process(workspace, two_processes):
    _, (rank0, _) = two_processes
    assert rank0["trainable"] and not [n for n in rank0["trainable"] if n.startswith("decoder.")]
    # LoRA with the continuous latent and accumulation: the adapters (and nothing else of the decoder)
    # go to DDP, and both processes end with the same weights (each draws its own latent noise).
    run_dir, record_dir = workspace.root / "lora", workspace.root / "lora-records"
    lora = dict(decoder_training="lora", latent="continuous", gradient_accumulation_steps=2, max_steps=3, save_every=3)
    done = launch(record_dir, workspace.args(run_dir, **lora))
    assert done.returncode == 0, done.stderr[-4000:]
    rank0, rank1 = records(record_dir)
    decoder = [n for n in rank0["trainable"] if n.startswith("decoder.")]
    assert decoder and all(".lora_" in n for n in decoder)
    assert any(".lora_" in n for n in rank0["weights"])
    for name, value in rank0["weights"].items():
        assert torch.equal(value, rank1["weights"][name]), name
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3] and rank1["writes"] == []


def test_only_the_main_process_writes(two_processes):
    run_dir, (_, rank1) = two_processes
    assert rank1["writes"] == []
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1)), "one metrics line per step"
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "checkpoints",
        "command.txt",  # the main process's record of the train command line (for export's model card)
        "config.yaml",
        "data_stats.json",
        "feature_cache",
        "metrics.jsonl",
        "verdict.json",  # the verdict train ends with, written by the main process
    ]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    # The store (feature_store): its eviction lock and one reference folder, written by the main process.
    store = sorted(p.name for p in (run_dir / "feature_cache").iterdir())
    assert len(store) == 2 and store[0] == ".lock", store


def test_killed_and_resumed_two_process_run_is_bit_identical(workspace, two_processes):
    straight_dir, (straight, _) = two_processes
    run_dir, record_dir = workspace.root / "killed", workspace.root / "killed-records"
    killed = launch(record_dir, workspace.args(run_dir), DDP_KILL_AT_STEP="4")
    assert killed.returncode != 0
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000003"]
    resumed = launch(record_dir, workspace.args(run_dir, resume="auto"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rank0, rank1 = records(record_dir)
    assert metrics(run_dir) == metrics(straight_dir)  # every logged number, bit for bit
    for name, value in straight["weights"].items():
        assert torch.equal(rank0["weights"][name], value), name
        assert torch.equal(rank1["weights"][name], value), name


def test_eval_across_two_processes_equals_one_process(workspace, two_processes):
    run_dir, _ = two_processes
    checkpoint = run_dir / "checkpoints" / "step-000006"
    shared = ["--data", workspace.values["data"], "--batch-size", "4", "--no-progress", "--device", "cpu"]
    done = launch(
        workspace.root / "eval-records",
        ["eval", str(checkpoint), "--output", str(workspace.root / "two.json"), *shared],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one, _, _ = run_eval(
            checkpoint,
            data=workspace.values["data"],
            batch_size=4,
            progress=False,
            device="cpu",
            output=str(workspace.root / "one.json"),
        )
    finally:
        torch.set_num_threads(threads)
    two = json.loads((workspace.root / "two.json").read_text())
    assert two == json.loads(json.dumps(one))
    assert two["examples"] == 40


def test_resuming_with_another_number_of_processes_is_refused(workspace, two_processes, tmp_path):
    import shutil

    from disentanglement.config import ConfigError

    run_dir, _ = two_processes
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    state = json.loads((copy / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["processes"] == PROCESSES
    config = build_config(dict(workspace.values, output_dir=str(copy), batch_size=BATCH, resume="auto"))
    with pytest.raises(ConfigError, match="trained with 2, .* --num_processes 2"):
        train(config)


def test_nonfinite_steps_stop_every_process_alike(workspace):
    # Every process skips the same steps (the loss's finiteness is agreed on), so none waits for the
    # others in a collective: both stop with the divergence error, well within the timeout.
    run_dir = workspace.root / "diverged"
    blow_up = dict(encoder_lr=1e30, latent_lr=1e30, max_grad_norm=1e30, warmup_steps=0, max_nonfinite_steps=2)
    done = launch(workspace.root / "diverged-records", workspace.args(run_dir, **blow_up), timeout=180)
    assert done.returncode != 0
    assert done.stderr.count("consecutive non-finite") >= PROCESSES, done.stderr[-4000:]
