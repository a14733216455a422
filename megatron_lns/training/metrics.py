"""Metrics to the console, ``metrics.jsonl``, TensorBoard and (optionally) W&B.

Only global rank 0 writes; every rank holds the same numbers (losses are reduced
and broadcast by the train step).
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
    ) -> None:
        self.active = dist.get_rank() == 0
        self.run_name = run_name
        self.writer = None
        self.wandb_run = None
        self.jsonl = None
        if not self.active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = (run_dir / "metrics.jsonl").open("a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
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
            print(f"[{self.run_name}] step {step:6d}  " + "  ".join(parts), flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5) and math.isfinite(value):
        return f"{value:.3e}"
    return f"{value:.4f}"
