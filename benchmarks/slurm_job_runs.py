"""Submitting the 2-node tiny job to a SLURM cluster and watching it, for the SLURM
benchmarks (``slurm_recovery.py``, ``slurm_repeat.py``).

The job is the one of ``tests/cluster/test_slurm_multinode.py``: the tiny CPU demo model,
2 nodes x 2 tasks (TP=2 within a node, DP=2 across them), every loss logged. The cluster is
the one ``SLURM_CONF`` names (``slurm/test-cluster/cluster.sh start DIR --nodes 3``).
Not named ``slurm_jobs``: tests that import benchmarks put this folder on ``sys.path``,
where that name would hide the tests' own ``tests/slurm_jobs.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from tiny_model import TINY_WIDTH

from megatron_lns.runtime.launcher_env import LAUNCHER_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
TWO_NODE_JOB = [
    "model.num_layers=4",
    *TINY_WIDTH,
    "model.data.splits_string=90,10,0",
    "model.optim.sched.warmup_steps=2",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
    "exp_manager.create_tensorboard_logger=false",
    "trainer.num_nodes=2",
    "trainer.devices=2",
    "model.tensor_model_parallel_size=2",
    "cluster.time_limit='15'",
    "cluster.preemption_signal_lead_s=60",
]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@dataclass(frozen=True)
class Job:
    id: str
    run_dir: Path
    log: Path  # the job log (sbatch --output), appended to by every restart

    def run_log(self, restart: int) -> Path:
        return self.log.with_name(f"{self.log.stem}-restart{restart}.log")

    def state(self) -> dict[str, str]:
        for _ in range(10):  # a busy slurmctld occasionally drops a client connection
            result = subprocess.run(
                ["scontrol", "-o", "show", "job", self.id], capture_output=True, text=True
            )
            if result.returncode == 0:
                return dict(f.split("=", 1) for f in result.stdout.split() if "=" in f)
            time.sleep(1)
        raise SystemExit(f"scontrol show job {self.id} keeps failing: {result.stderr.strip()}")

    def loss_steps(self) -> list[int]:
        """The steps whose loss the job has logged so far, in order (repeats included)."""
        metrics = self.run_dir / "metrics.jsonl"
        if not metrics.is_file():
            return []
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return [row["step"] for row in rows if "loss" in row]

    def cancel(self) -> None:
        subprocess.run(["scancel", self.id], capture_output=True)


def submit(exp_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> Job:
    """``megatron-lns submit`` of the 2-node job into ``exp_dir``."""
    # A launcher's variables inherited from this shell would contradict SLURM's.
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    environment.update(env or {})
    command = [sys.executable, "-m", "megatron_lns.cli", "submit", str(CONFIG), *TWO_NODE_JOB]
    command += [f"exp_manager.exp_dir={exp_dir}", *overrides]
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    lines = result.stdout.splitlines()
    if result.returncode != 0 or not lines or not lines[0].startswith("submitted job "):
        raise SystemExit(f"submit failed: {result.stderr.strip() or result.stdout.strip()}")
    job_id = lines[0].split()[2].rstrip(":")
    return Job(job_id, exp_dir / "lns", Path(lines[1].removeprefix("job log: ")))


def wait_for(condition, what: str, job: Job, timeout_s: float, poll_s: float = 0.1):
    """Poll ``condition()`` until it returns something true; the job is cancelled and the
    benchmark ends naming ``what`` when it has not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(poll_s)
    job.cancel()
    raise SystemExit(f"job {job.id}: no {what} within {timeout_s:.0f} s ({job.state()})")


def require_idle_nodes(count: int) -> None:
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(
            "no SLURM cluster answers (set SLURM_CONF; slurm/test-cluster/cluster.sh start DIR "
            f"--nodes 3): {result.stderr.strip()}"
        )
    idle = {line.split()[0] for line in result.stdout.splitlines() if " idle" in line}
    if len(idle) < count:
        raise SystemExit(f"the SLURM cluster has {len(idle)} idle node(s), not {count}")


def exit_on_term() -> None:
    """A TERM ends the benchmark through its ``finally`` blocks, which cancel its jobs."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
