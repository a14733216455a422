"""A run with a stop, a crash and a resume, and what ``megatron-lns status`` says of it.

The tiny CPU demo model trained to 60 steps (a checkpoint every 20) in three attempts,
each a fresh ``megatron-lns train`` process into the same run directory:

1. stopped by ``trainer.exit_interval=30`` (a clean stop: checkpoint at step 30 saved);
2. killed with SIGKILL once it has logged step 52 (a crash: the steps past the
   checkpoint of step 40 are trained again by the next attempt, lost work; its records
   reach step 50, its last log line);
3. resumed from step 40 to the end.

It prints the output of ``megatron-lns status RUN_DIR`` (the example in docs/resuming.md)
and writes its ``--json`` with ``--output``. Two to three minutes on two cores.

    .venv/bin/python benchmarks/goodput_example.py [--out DIR] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "tiny_cpu_demo",
    "trainer.max_steps=60",
    "trainer.log_every_n_steps=10",
    "trainer.val_check_interval=20",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=20",
    "exp_manager.create_tensorboard_logger=false",
]
KILL_AFTER_STEP = 52


def train(exp_dir: Path, *extra: str, kill_after: int | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    command = [sys.executable, "-m", "megatron_lns.cli", "train", *RUN, *extra]
    command.append(f"exp_manager.exp_dir={exp_dir}")
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    if kill_after is None:
        if process.wait() != 0:
            raise SystemExit(f"training failed with status {process.returncode}")
        return
    metrics = exp_dir / "lns" / "metrics.jsonl"
    while process.poll() is None:
        rows = metrics.read_text().splitlines() if metrics.is_file() else []
        if any(json.loads(row).get("step", 0) >= kill_after for row in rows if row.strip()):
            process.send_signal(signal.SIGKILL)
            process.wait()
            return
        time.sleep(0.2)
    raise SystemExit(f"the run ended (status {process.returncode}) before step {kill_after}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="experiment directory (default: a temporary one)")
    parser.add_argument("--output", type=Path, help="write status --json here")
    args = parser.parse_args()
    exp_dir = args.out or Path(tempfile.mkdtemp(prefix="goodput-example-"))
    train(exp_dir, "trainer.exit_interval=30")
    train(exp_dir, kill_after=KILL_AFTER_STEP)
    train(exp_dir)
    status = [sys.executable, "-m", "megatron_lns.cli", "status", str(exp_dir / "lns")]
    print(subprocess.run(status, cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    if args.output:
        report = subprocess.run(
            [*status, "--json"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        args.output.write_text(report)


if __name__ == "__main__":
    main()
