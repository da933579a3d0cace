"""The run's logs while it trains: ``metrics.jsonl`` (one JSON object per optimizer step, flushed), its
truncation on resume, TensorBoard (optional) and the progress bar."""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm.auto import tqdm

from .checkpoints import replace_file_durably
from .config import TrainConfig
from .safe_io import ensure_dir, open_append

logger = logging.getLogger(__name__)

#: The per-step log of a run directory.
METRICS_FILE = "metrics.jsonl"


@dataclass
class MetricsLog:
    """``metrics.jsonl`` (one line per step, flushed), TensorBoard (optional) and the progress bar."""

    path: Path
    file: IO[str]
    writer: Any  # a SummaryWriter, or None
    bar: Any

    def write(self, record: dict[str, float]) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as exc:
            raise OSError(exc.errno, f"could not write {self.path} ({exc.strerror or exc})") from exc
        if self.writer is not None:
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(key, value, record["step"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", rec=f"{record['reconstruction_loss']:.3f}")

    def sync(self) -> None:
        """Make the records written so far durable (before a checkpoint: the metrics up to it are as durable)."""
        os.fsync(self.file.fileno())


class NoLog:
    """The logs of a process other than the main one: it writes nothing."""

    def write(self, record: dict[str, float]) -> None:
        pass

    def sync(self) -> None:
        pass


@contextmanager
def open_metrics_log(output_dir: Path, tcfg: TrainConfig, step: int, main: bool = True):
    """Open the run's logs, appending after ``step``; closes them however training ends (none but the main process's)."""
    if not main:
        yield NoLog()
        return
    path = output_dir / METRICS_FILE
    writer = _tensorboard_writer(output_dir) if tcfg.tensorboard else None
    bar = tqdm(total=tcfg.max_steps, initial=step, desc="train", disable=not tcfg.progress, unit="step")
    try:
        with open_append(path) as file:  # never through a link planted at the path
            yield MetricsLog(path, file, writer, bar)
    finally:
        bar.close()
        if writer is not None:
            writer.close()


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps <= ``step`` (a resumed run recomputes the rest; 0 keeps none).

    A partial last line (a crash while it was written) is dropped with a warning; an unreadable line
    elsewhere is an error naming the file and line; steps missing before ``step`` are warned about.
    """
    if not path.exists():
        return
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    kept, steps = [], []
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            record_step = record["step"]
            if not isinstance(record_step, int) or isinstance(record_step, bool):
                raise TypeError(f"'step' is {record_step!r}, not an integer")
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            if lineno == len(lines) and not data.endswith(b"\n"):
                logger.warning("%s:%d: dropped a partial last line (a crash while it was written)", path, lineno)
                continue
            raise ValueError(
                f"{path}:{lineno}: not a metrics record ({exc}); remove or repair that line to resume"
            ) from exc
        if record_step <= step:
            kept.append(raw.decode("utf-8"))
            steps.append(record_step)
    missing = sorted(set(range(1, step + 1)) - set(steps))
    if missing:
        logger.warning(
            "%s: no records of steps %s (lost before the checkpoint); the log has a gap there", path, missing
        )
    replace_file_durably(path, "".join(line + "\n" for line in kept).encode())


def _tensorboard_writer(output_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # pragma: no cover - depends on the optional package
        raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
    return SummaryWriter(str(ensure_dir(output_dir / "tensorboard", output_dir)))
