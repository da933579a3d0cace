"""What ``tests/test_ddp.py`` launches under ``accelerate launch``: the ``disentangle`` command line,
watched from inside each process.

    python -m accelerate.commands.launch --cpu --num_processes 2 tests/ddp_child.py RECORD_DIR -- train ...

Each process runs ``cli.main`` on the arguments after ``--`` and writes ``RECORD_DIR/rank<r>.pt``: the
parameters that require gradients when the model goes to DDP (the ones in its gradient buckets), the
codebook after its k-means start and after every step, the steps whose codebook a k-means refresh
or a dead-code restart changed, the final trainable weights, and every file a process other than the
main one opened for writing, renamed or created. ``DDP_KILL_AT_STEP=K``: the main process SIGKILLs
itself after step ``K`` (its log line written, its checkpoint, if due, saved).
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
from pathlib import Path

import torch

from disentanglement import cli, trainer
from disentanglement.shared_discrete_cvae import SharedDiscreteCVAE

RANK = int(os.environ.get("RANK", "0"))
record: dict = {
    "model": None,
    "start": None,
    "codebooks": {},
    "refreshed": [],
    "restarted": [],
    "writes": [],
    "weights": None,
}


def _watch_writes():
    """Record every write-like file operation (builtins.open / os.open for writing, renames, mkdir);
    returns what undoes it."""
    real_open, real_os_open = builtins.open, os.open
    real_replace, real_rename, real_mkdir = os.replace, os.rename, os.mkdir

    def note(what, path):
        record["writes"].append(f"{what} {path}")

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
            note("open", file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            note("os.open", path)
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open, os.open = open_, os_open
    os.replace = lambda a, b, *args, **kw: (note("replace", b), real_replace(a, b, *args, **kw))[1]
    os.rename = lambda a, b, *args, **kw: (note("rename", b), real_rename(a, b, *args, **kw))[1]
    os.mkdir = lambda p, *args, **kw: (note("mkdir", p), real_mkdir(p, *args, **kw))[1]

    def undo():
        builtins.open, os.open, os.replace, os.rename, os.mkdir = (
            real_open,
            real_os_open,
            real_replace,
            real_rename,
            real_mkdir,
        )

    return undo


def _watch_model() -> None:
    real_build, real_make_optimizer, real_refresh, real_post_step = (
        trainer.build_cvae,
        trainer.make_optimizer,
        SharedDiscreteCVAE.refresh_from_data,
        SharedDiscreteCVAE.post_step,
    )

    def build_cvae(config, decoder):
        record["model"] = real_build(config, decoder)
        return record["model"]

    def make_optimizer(model, config):  # called right after the codebook's (broadcast) k-means start, before prepare
        record["trainable"] = sorted(name for name, p in model.named_parameters() if p.requires_grad)
        if isinstance(model, SharedDiscreteCVAE):
            record["start"] = model.codebook.detach().clone()
        return real_make_optimizer(model, config)

    def refresh(self, features, seed):
        before = self.codebook.detach().clone()
        real_refresh(self, features, seed)
        if not torch.equal(before, self.codebook):
            record["refreshed"].append(seed)

    def post_step(self, step):
        before = self.codebook.detach().clone()
        real_post_step(self, step)
        if not torch.equal(before, self.codebook):
            record["restarted"].append(step + 1)

    trainer.build_cvae, trainer.make_optimizer = build_cvae, make_optimizer
    SharedDiscreteCVAE.refresh_from_data, SharedDiscreteCVAE.post_step = refresh, post_step


def main() -> int:
    record_dir, argv = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1 :]
    kill_at = int(os.environ.get("DDP_KILL_AT_STEP", "0"))
    real_train = trainer.train

    def train(config, *args, **kwargs):
        def watch(step, metrics):
            if isinstance(record["model"], SharedDiscreteCVAE):
                record["codebooks"][step] = record["model"].codebook.detach().clone()
            if kill_at and step == kill_at and RANK == 0:
                os.kill(os.getpid(), signal.SIGKILL)

        out = real_train(config, *args, callbacks=[watch], **kwargs)
        record["weights"] = {k: v.clone() for k, v in out.model.trainable_state_dict().items()}
        return out

    trainer.train = train
    _watch_model()
    undo = _watch_writes() if RANK > 0 else (lambda: None)
    code = cli.main(argv)
    undo()
    record.pop("model", None)
    record_dir.mkdir(parents=True, exist_ok=True)
    torch.save(record, record_dir / f"rank{RANK}.pt")
    return code


if __name__ == "__main__":
    sys.exit(main())
