"""Submitting tiny training jobs to a real SLURM cluster and watching them, for the tests
under tests/cluster/ that need one (``slurm/test-cluster/cluster.sh start DIR [--nodes N]``
and ``SLURM_CONF=DIR/slurm.conf``; ``.ci/run`` starts one).

Without a reachable cluster those tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import DEMO_CONFIG as DEMO
from helpers import ROOT, TINY_MODEL_OVERRIDES

from megatron_lns.cli import main
from megatron_lns.runtime.launcher_env import LAUNCHER_VARIABLES

MAX_STEPS = 10
# The tiny model, 10 steps, TP=2 over the two tasks of a node, one checkpoint at the end.
JOB = [
    *TINY_MODEL_OVERRIDES,
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=100",
    "exp_manager.create_tensorboard_logger=false",
    "trainer.devices=2",
    "model.tensor_model_parallel_size=2",
    "cluster.time_limit='10'",
    "cluster.preemption_signal_lead_s=60",
]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
WAIT_S = 240


def idle_nodes() -> list[str] | str:
    """The names of the idle nodes with 2 CPUs, or why the cluster cannot be asked."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    if not os.environ.get("SLURM_CONF") and not Path("/etc/slurm/slurm.conf").is_file():
        return "SLURM_CONF is not set"
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t %c"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if result.returncode != 0:
        return "sinfo failed: " + " ".join(result.stderr.split())
    nodes = {tuple(line.split()) for line in result.stdout.splitlines() if line.strip()}
    return sorted(
        name
        for name, state, cpus in nodes
        if state.rstrip("*") in ("idle", "mix") and int(cpus) >= 2
    )


# How long a node may stay busy after the previous test's job: SLURM completes a job's
# nodes (epilog, KillWait) a few seconds after the job itself has ended.
IDLE_WAIT_S = 90


def require_cluster(nodes: int) -> None:
    """Skip (fail under CI=true) unless a cluster with ``nodes`` idle 2-CPU nodes answers
    (within IDLE_WAIT_S: the nodes of a job that has just ended are still completing)."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        found = idle_nodes()
        if isinstance(found, str):
            reason = f"no SLURM cluster reachable ({found})"
            break
        if len(found) >= nodes:
            return
        reason = f"the SLURM cluster has {len(found)} idle 2-CPU node(s), not {nodes}"
        if time.monotonic() > deadline:
            reason += f" after {IDLE_WAIT_S} s"
            break
        time.sleep(2)
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(
        f"{reason}; start one with `slurm/test-cluster/cluster.sh start DIR --nodes 3` "
        "and export SLURM_CONF=DIR/slurm.conf"
    )


@contextlib.contextmanager
def submitting(cache_dir: Path):
    """The environment sbatch passes on to jobs (its --export=ALL default); yields the
    list of submitted job ids, and cancels them at the end."""
    submitted: list[str] = []
    with pytest.MonkeyPatch.context() as env:
        for name in LAUNCHER_VARIABLES:
            env.delenv(name, raising=False)
        env.setenv("PYTHONPATH", str(ROOT), prepend=os.pathsep)
        env.setenv("MEGATRON_LNS_CACHE", str(cache_dir))
        env.chdir(ROOT)
        try:
            yield submitted
        finally:
            for job_id in submitted:
                subprocess.run(["scancel", job_id], capture_output=True)


@dataclass(frozen=True)
class Job:
    id: str
    run_dir: Path
    log: Path  # the job log (SLURM's --output), appended to by every restart

    def run_log(self, restart: int) -> Path:
        return self.log.with_name(f"{self.log.stem}-restart{restart}.log")


def submit(submitted: list[str], exp_dir: Path, *overrides: str) -> Job:
    """`megatron-lns submit` (in this process: the same code, without another start-up)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    args = ["submit", str(DEMO), *JOB, f"exp_manager.exp_dir={exp_dir}", *overrides]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(args)
    assert code == 0, stderr.getvalue()
    lines = stdout.getvalue().splitlines()
    assert lines[0].startswith("submitted job "), stdout.getvalue()
    job_id = lines[0].split()[2].rstrip(":")
    submitted.append(job_id)
    run_dir = exp_dir / "lns"
    log = Path(lines[1].removeprefix("job log: "))
    assert lines[1].startswith("job log: ") and log.parent == run_dir / "logs", lines
    assert log.name.endswith(f"-{job_id}.log"), log
    return Job(job_id, run_dir, log)


def job_state(job_id: str) -> dict[str, str]:
    # A busy slurmctld occasionally drops a client connection: ask again.
    for _ in range(10):
        result = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True
        )
        if result.returncode == 0:
            return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)
        time.sleep(1)
    raise AssertionError(f"scontrol show job {job_id} keeps failing: {result.stderr}")


def logs(run_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(run_dir.glob("logs/*.log")))


def wait_until(
    job: Job, done, what: str, wait_s: float = WAIT_S, poll_s: float = 1.0
) -> dict[str, str]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        state = job_state(job.id)
        if done(state):
            return state
        time.sleep(poll_s)
    subprocess.run(["scancel", job.id], capture_output=True)
    pytest.fail(
        f"job {job.id}: no {what} after {wait_s}s ({job_state(job.id)})\n{logs(job.run_dir)}"
    )


def wait_for_end(job: Job) -> dict[str, str]:
    return wait_until(job, lambda state: state["JobState"] in TERMINAL, "end")


def trained_steps(job: Job, steps: int):
    """A `wait_until` condition: the job has logged ``steps`` losses (or ended)."""

    def done(state: dict[str, str]) -> bool:
        metrics = job.run_dir / "metrics.jsonl"
        return state["JobState"] in TERMINAL or (
            metrics.is_file() and metrics.read_text().count('"loss"') >= steps
        )

    return done


def start_requeued_soon(job: Job) -> None:
    """SLURM holds a requeued job back ~2 minutes (BeginTime); as root, start it sooner.

    Only once the job is PENDING: a job requeued for a failed node first completes on
    its other nodes (up to KillWait), and SLURM sets BeginTime again when it is then
    requeued. Not in the same second as the requeue: slurmd compares a new launch
    credential with the previous run's revocation by the second and kills a start within
    it ("Job credential revoked"; seen once in CI as a FAILED job with no restart1 log)."""
    settled = ("PENDING", "RUNNING", *TERMINAL)  # not COMPLETING, REQUEUED, ...
    wait_until(job, lambda state: state["JobState"] in settled, "pending after requeue", 60)
    subprocess.run(
        ["scontrol", "update", f"JobId={job.id}", "StartTime=now+2"], capture_output=True
    )


def losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]
