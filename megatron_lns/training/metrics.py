"""Metrics to the console, ``metrics.jsonl``, TensorBoard and (optionally) W&B.

Only global rank 0 writes; every rank holds the same numbers (losses are reduced
and broadcast by the train step). A resumed run first drops what an interrupted run
logged after its checkpoint (rows of ``metrics.jsonl`` past the resume step, and
TensorBoard events through ``purge_step``), so replayed steps are not logged twice.

A full disk (or any failed write) does not stop the run: these are records of it, and
its state is in the checkpoints, whose next save stops the run cleanly if the disk is
still full. Each writer warns once: ``metrics.jsonl`` keeps only whole rows (a failed
row is cut off again) and says which steps it lacks once it can write again; TensorBoard
is closed for the rest of the run; a console line that cannot be written is dropped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_lns.base.disk import WriteError, disk_full_error, write_text_atomically


def warn(message: str) -> None:
    """A warning on stderr; dropped where stderr cannot be written either (its file is
    on the full disk): there is nowhere left to say it."""
    with contextlib.suppress(OSError):
        print(f"warning: {message}", file=sys.stderr, flush=True)


def say(line: str) -> None:
    """A console line; one that the log's full disk refuses is dropped, not an error."""
    with contextlib.suppress(OSError):
        print(line, flush=True)


def _reason(path: Path, err: OSError) -> str:
    return str(disk_full_error(path, err)) if err.errno else f"cannot write {path}: {err}"


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard writes from a thread of its own, which prints its error's traceback
    before re-raising it at the next ``add_scalar``: leave the report to that call (one
    warning). Other threads' errors go to the hook as before."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        writer_thread = type(args.thread).__name__ == "_AsyncWriterThread"
        if not (writer_thread and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


class MetricRows:
    """``metrics.jsonl``, appended a whole row at a time (one ``write`` on an
    ``O_APPEND`` descriptor): a row the disk takes only part of is cut off again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, row: str) -> None:
        data = (row + "\n").encode()
        end = os.fstat(self.fd).st_size
        try:
            if os.write(self.fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)
            raise

    def close(self) -> None:
        os.close(self.fd)


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        wandb: bool,
        wandb_kwargs: dict[str, Any] | None = None,
        run_name: str = "",
        resume_step: int = 0,
        console_label: str | None = None,
    ) -> None:
        self.active = dist.get_rank() == 0
        self.run_name = run_name
        self.console_label = console_label or run_name
        self.writer = None
        self.wandb_run = None
        self.jsonl: MetricRows | None = None
        self.dropped_up_to: int | None = None  # the last step of the rows dropped at resume
        self.unwritten: list[int] = []  # steps whose rows the disk refused, since the last
        if not self.active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
        try:
            # How far an interrupted attempt got past its checkpoint (goodput's lost work).
            self.dropped_up_to = _drop_rows_after(metrics, resume_step)
            self.jsonl = MetricRows(metrics)
        except (OSError, WriteError) as err:
            # Rows of replayed steps cannot be dropped: appending would log them twice.
            reason = _reason(metrics, err) if isinstance(err, OSError) else str(err)
            warn(f"{reason}; this run logs no rows to it (the console keeps the metrics)")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_writer_thread()
            try:
                self.writer = SummaryWriter(
                    log_dir=str(run_dir / "tensorboard"), purge_step=resume_step + 1
                )
            except OSError as err:
                self._tensorboard_failed(err)
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                print("W&B logging requested but wandb is not installed; skipping it", flush=True)
            else:
                self.wandb_run = wandb_lib.init(**{"name": run_name, **(wandb_kwargs or {})})

    def log(
        self, step: int, metrics: dict[str, float], console: bool = True, note: str = ""
    ) -> None:
        """Log ``metrics`` of ``step`` everywhere (the console too unless ``console`` is
        false); ``note`` ends the console line only (the time left to max_steps)."""
        if not self.active:
            return
        if self.jsonl is not None:
            self._append_row(step, json.dumps({"step": step, "time": time.time(), **metrics}))
        if self.writer is not None:
            try:
                for key, value in metrics.items():
                    self.writer.add_scalar(key, value, step)
            except OSError as err:
                self._tensorboard_failed(err)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if console:
            parts = [f"{k} {_fmt(v)}" for k, v in metrics.items()] + ([note] if note else [])
            say(f"[{self.console_label}] step {step:6d}  " + "  ".join(parts))

    def _append_row(self, step: int, row: str) -> None:
        """Append a row; warn at the first the disk refuses, and when rows go in again,
        which steps ``metrics.jsonl`` lacks (their losses are in the console log)."""
        try:
            self.jsonl.append(row)
        except OSError as err:
            if not self.unwritten:
                warn(f"{_reason(self.jsonl.path, err)}; training goes on without its rows")
            if not self.unwritten or self.unwritten[-1] != step:
                self.unwritten.append(step)
            return
        self._name_the_gap()

    def _name_the_gap(self) -> None:
        if self.unwritten:
            first, last = self.unwritten[0], self.unwritten[-1]
            warn(f"{self.jsonl.path} lacks the rows of steps {first} to {last} (disk full)")
            self.unwritten = []

    def _tensorboard_failed(self, err: OSError) -> None:
        """TensorBoard is a view of the metrics: off for the rest of the run."""
        warn(f"TensorBoard events: {err}; no more events this run")
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
        self.writer = None

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()  # its last events: the disk may refuse them too
            except OSError as err:
                self._tensorboard_failed(err)
        if self.jsonl is not None:
            self._name_the_gap()
            self.jsonl.close()
            self.jsonl = None
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _drop_rows_after(path: Path, step: int) -> int | None:
    """Keep only the rows of ``path`` up to ``step`` (a torn last line goes too); the
    last step of the rows dropped (None: none)."""
    if not path.is_file():
        return None
    kept, dropped = [], None
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line)["step"]
            if row_step <= step:
                kept.append(line)
            else:
                dropped = max(dropped or row_step, row_step)
        except (ValueError, KeyError, TypeError):
            continue
    write_text_atomically(path, "".join(line + "\n" for line in kept))
    return dropped


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5) and math.isfinite(value):
        return f"{value:.3e}"
    return f"{value:.4f}"


class Throughput:
    """Tokens per second over training steps only (not validation or checkpoint saves)."""

    def __init__(self) -> None:
        self.window_tokens, self.window_time = 0, 0.0
        self.total_tokens, self.total_time = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.window_tokens += tokens
        self.window_time += seconds

    def close_window(self) -> float:
        rate = self.window_tokens / self.window_time if self.window_time else 0.0
        self.total_tokens += self.window_tokens
        self.total_time += self.window_time
        self.window_tokens, self.window_time = 0, 0.0
        return rate

    @property
    def overall(self) -> float:
        return self.total_tokens / self.total_time if self.total_time else 0.0
