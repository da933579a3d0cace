"""Crash sweep: SIGKILL a tiny training run at many points, resume it, and check it is bit-identical
to an uninterrupted run; then fill a real (tmpfs) disk and make a run directory read-only.

    .venv/bin/python scripts/crash_sweep.py [--only NAME ...]

Not a test (about 4 minutes, and the disk cases need root to mount tmpfs); the CI tests cover four kill
points and simulated disk errors (tests/test_checkpoints.py). Prints one line per case and a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import test_checkpoints as t  # noqa: E402  (the tests' tiny run: 40 pairs, tiny Llama, 4 per batch)
from disentanglement import checkpoints, cli  # noqa: E402

SETTINGS = {
    "discrete": dict(max_steps=9, codebook_refresh_every=2),
    "continuous": dict(max_steps=9, latent="continuous"),
}


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _install(point: str) -> None:
    """In the child: arrange a SIGKILL at ``point``."""
    import disentanglement.features as features
    import disentanglement.trainer as trainer
    from disentanglement.shared_discrete_cvae import SharedDiscreteCVAE

    saving6 = lambda path: ".tmp-step-000006" in str(path)  # noqa: E731
    if point.startswith("write "):
        name, real = point.split(" ", 1)[1], checkpoints.write_durably

        def write(path, data):
            if saving6(path) and path.name == name:
                path.write_bytes(data[: len(data) // 2])  # half of it reaches the disk
                kill()
            return real(path, data)

        checkpoints.write_durably = write
    elif point in ("before rename", "after rename"):
        real_sync = checkpoints.fsync_dir

        def sync(path):
            real_sync(path)
            if point == "before rename" and saving6(path):
                kill()
            if point == "after rename" and path.name == "checkpoints" and (path / "step-000006").exists():
                kill()

        checkpoints.fsync_dir = sync
    elif point == "in prune":
        real_prune = trainer.prune_checkpoints
        trainer.prune_checkpoints = lambda d, k, protect=None: (
            kill() if protect.name == "step-000006" else real_prune(d, k, protect)
        )
    elif point == "before save":
        real_save = trainer.save_checkpoint
        trainer.save_checkpoint = lambda d, step, *a: kill() if step == 6 else real_save(d, step, *a)
    elif point == "in validation":
        real_validate = trainer.validate
        trainer.validate = lambda *a: kill() if a[5] == 6 else real_validate(*a)
    elif point == "in frozen pass":
        features.build_feature_cache = lambda *a, **k: kill()
    elif point == "writing feature cache":
        features.save_feature_cache = lambda *a, **k: kill()
    elif point == "in k-means refresh":
        real_init = SharedDiscreteCVAE.initialize_from_data
        SharedDiscreteCVAE.initialize_from_data = lambda self, f, seed, refresh=False: (
            kill() if refresh and seed == 4 else real_init(self, f, seed, refresh)
        )
    elif point.startswith("after step "):
        n = int(point.rsplit(" ", 1)[1])
        from disentanglement.continuous_cvae import ContinuousCVAE

        for family in (SharedDiscreteCVAE, ContinuousCVAE):
            real_post = family.post_step
            family.post_step = lambda self, step, real=real_post: kill() if step + 1 == n else real(self, step)
    elif point == "in resume":  # the first run stops after step 4; the resumed one dies after truncating metrics
        real_truncate = trainer.truncate_metrics

        def truncate(path, step):
            real_truncate(path, step)
            if step > 0:
                kill()

        trainer.truncate_metrics = truncate
    else:
        raise ValueError(point)


def child(output_dir: str, point: str, settings: str) -> None:
    _install(point)
    t.run(output_dir, resume="auto" if point == "in resume" else None, **SETTINGS[settings])


POINTS = [
    *(("discrete", f"write {name}") for name in ("model.safetensors", "optimizer.pt", "scheduler.json")),
    *(("discrete", f"write {name}") for name in ("rng.safetensors", "config.yaml", "trainer_state.json")),
    ("discrete", "before rename"),
    ("discrete", "after rename"),
    ("discrete", "in prune"),
    ("discrete", "before save"),
    ("discrete", "in validation"),
    ("discrete", "in frozen pass"),
    ("discrete", "writing feature cache"),
    ("discrete", "in k-means refresh"),
    ("discrete", "after step 1"),
    ("discrete", "after step 5"),
    ("discrete", "after step 8"),
    ("discrete", "in resume"),
    ("continuous", "write model.safetensors"),
    ("continuous", "after step 5"),
]


def same(a: Path, b: Path, model_a, model_b) -> bool:
    try:
        t.assert_same_run(a, b, model_a, model_b)
    except AssertionError:
        return False
    return True


def sweep(root: Path, only: list[str]) -> tuple[int, int]:
    straight = {name: t.run(root / f"straight-{name}", **s) for name, s in SETTINGS.items()}
    tried = identical = 0
    for settings, point in POINTS:
        if only and point not in only:
            continue
        out = root / f"{settings}-{point.replace(' ', '_')}"
        code = f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import crash_sweep as c; c.child(*sys.argv[1:])"
        if point == "in resume":  # a first run stops after step 4; the child resumes it and dies mid-resume
            with contextlib.suppress(t.Stop):
                t.run(out, callbacks=[t.stop_at(4)], **SETTINGS[settings])
        cmd = [sys.executable, "-c", code, str(out), point, settings]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        killed = result.returncode == -signal.SIGKILL
        latest = checkpoints.latest_checkpoint(out)
        try:
            resumed = t.run(out, resume="auto", **SETTINGS[settings])
            ok = same(root / f"straight-{settings}", out, straight[settings].model, resumed.model)
            leftovers = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
            status = "bit-identical" if ok and not leftovers else f"DIFFERS {leftovers}"
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the sweep goes on
            ok, status = False, f"RESUME FAILED: {type(exc).__name__}: {exc}"
        tried += 1
        identical += ok
        killed_text = "killed" if killed else f"NOT KILLED (exit {result.returncode}: {result.stderr[-300:]})"
        latest_name = latest.name if latest else "none"
        print(f"{settings:10s} {point:28s} {killed_text:7s} resumed from {latest_name:12s} -> {status}", flush=True)
    return tried, identical


def disk_cases(root: Path) -> list[str]:
    """Real ENOSPC and EROFS on a tmpfs mount (needs root)."""
    import disentanglement.lm as lm

    lines = []
    mount = root / "small"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1000k", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        return ["disk cases skipped: cannot mount tmpfs here (not root?)"]
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt, "response": p.response}) + "\n" for p in t.pairs()))
    lm.load_model_and_tokenizer = lambda cfg, device="cpu": (t.tiny_llama(len(t.tiny_tokenizer())), t.tiny_tokenizer())
    common = ["train", "--data", str(data), "--no-chat-template", "--no-progress", "--batch-size", "4"]
    try:
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main([*common, "--output-dir", str(mount / "run"), "--max-steps", "40", "--save-every", "1"])
        left = sorted(p.name for p in (mount / "run" / "checkpoints").iterdir())
        lines.append(
            f"disk full (tmpfs 1000k): exit {code}; stderr {err.getvalue().strip().splitlines()[-1]!r}; checkpoints left {left}"
        )
        good = checkpoints.latest_checkpoint(mount / "run")
        if good is not None:
            checkpoints.read_checkpoint(good, for_resume=True)
            lines.append(f"  the newest complete checkpoint {good.name} reads back completely")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(
                [
                    *common,
                    "--output-dir",
                    str(mount / "run"),
                    "--resume",
                    "auto",
                    "--max-steps",
                    "40",
                    "--save-every",
                    "1",
                ]
            )
        lines.append(f"read-only run directory: exit {code}; stderr {err.getvalue().strip().splitlines()[-1]!r}")
    finally:
        subprocess.run(["umount", str(mount)])
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="kill points to run (default: all)")
    parser.add_argument("--no-disk", action="store_true", help="skip the tmpfs disk-full and read-only cases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="crash-sweep-"))
    try:
        tried, identical = sweep(root, args.only)
        print(f"kill points: {tried} tried, {identical} resumed bit-identical")
        if not args.no_disk:
            for line in disk_cases(root):
                print(line)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if tried == identical else 1


if __name__ == "__main__":
    sys.exit(main())
