"""Metrics to the console, ``metrics.jsonl``, TensorBoard and (optionally) W&B.

Only global rank 0 writes; every rank holds the same numbers (losses are reduced
and broadcast by the train step). A resumed run first drops what an interrupted run
logged after its checkpoint (rows of ``metrics.jsonl`` past the resume step, and
TensorBoard events through ``purge_step``), so replayed steps are not logged twice.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist


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
        self.jsonl = None
        if not self.active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
        _drop_rows_after(metrics, resume_step)
        self.jsonl = metrics.open("a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(
                log_dir=str(run_dir / "tensorboard"), purge_step=resume_step + 1
            )
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                print("W&B logging requested but wandb is not installed; skipping it", flush=True)
            else:
                self.wandb_run = wandb_lib.init(**{"name": run_name, **(wandb_kwargs or {})})

    def log(self, step: int, metrics: dict[str, float], console: bool = True) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if console:
            parts = [f"{k} {_fmt(v)}" for k, v in metrics.items()]
            print(f"[{self.console_label}] step {step:6d}  " + "  ".join(parts), flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _drop_rows_after(path: Path, step: int) -> None:
    """Keep only the rows of ``path`` up to ``step`` (a torn last line goes too)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5) and math.isfinite(value):
        return f"{value:.3e}"
    return f"{value:.4f}"
