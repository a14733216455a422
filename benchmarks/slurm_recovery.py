"""Time from a rank's crash to training again, restarted in-job, against the requeue path.

Needs a SLURM cluster with 2 idle nodes (``SLURM_CONF``; the multi-node test cluster:
``slurm/test-cluster/cluster.sh start DIR --nodes 3``). One 2-node job of the tiny CPU demo
(``benchmarks/slurm_job_runs.py``), a checkpoint every 4 steps, serves both measurements:

1. **in-job**: rank 3 SIGKILLs itself in step 6 (``MEGATRON_LNS_INJECT_FAULT``); srun ends
   the step, the batch script runs it again in the same allocation and every rank resumes
   from the checkpoint of step 4. Measured from the rank's ``fault injection`` line in the
   run log to the first step the restarted ranks log, split at the batch script's note
   that it restarts srun.
2. **requeue**: once the job has logged step 12, ``scontrol requeue JOB`` (what SLURM does
   on its own after a node failure or a preemption). Measured from the requeue to the first
   step the requeued run logs, split into the time until SLURM runs the job again (its
   requeue hold, ``Reason=BeginTime``) and the start-up from there. ``--release-hold``
   starts the requeued job at once instead (``scontrol update StartTime=now+2``, as the
   tests do; needs an operator), which leaves the requeue path's own cost.

Both restart the same ranks from a checkpoint; the difference is the queue. Polls every
0.1 s; prints one line per figure, and the figures as JSON with ``--output FILE``. About
4 to 5 minutes on the 2-core test cluster (1 to 2 without the hold).

    SLURM_CONF=DIR/slurm.conf .venv/bin/python benchmarks/slurm_recovery.py [--release-hold]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_job_runs import Job, exit_on_term, require_idle_nodes, submit, wait_for

CRASH_STEP = 6
REQUEUE_AFTER_STEP = 12
MAX_STEPS = 40
START_S = 300  # a 2-node start-up takes 30-60 s on the 2-core test cluster
HOLD_S = 400  # SLURM's requeue hold is about 2 min 20 s there


def step_logged_after(log: Path, offset: int):
    """A wait_for condition: a training step's line in the run log ``log`` past ``offset``
    (not the metrics: a rank that did not wait for the failed one may log its step)."""

    def logged():
        if not log.is_file():
            return None
        with log.open("rb") as text:
            text.seek(offset)
            return b"[lns] step " in text.read() and time.monotonic()

    return logged


def in_job_recovery(job: Job) -> dict[str, float]:
    run_log = job.run_log(0)

    def crashed():
        if run_log.is_file() and "fault injection: crash" in run_log.read_text():
            return time.monotonic()
        return None

    def restarting():
        return "restarting in-job" in job.log.read_text() and time.monotonic()

    crash = wait_for(crashed, "crash", job, START_S)
    restart = wait_for(restarting, "in-job restart", job, START_S)
    # Every rank of the failed attempt has ended (srun returned): what follows is the next's.
    after = step_logged_after(run_log, run_log.stat().st_size)
    training = wait_for(after, "training after the crash", job, START_S)
    if job.state()["Restarts"] != "0":
        job.cancel()
        raise SystemExit(f"job {job.id} was requeued:\n{job.log.read_text()}")
    return {
        "crash_to_training_s": round(training - crash, 1),
        "crash_to_restart_s": round(restart - crash, 1),
        "restart_to_training_s": round(training - restart, 1),
    }


def requeue_recovery(job: Job, release_hold: bool) -> dict[str, float]:
    wait_for(lambda: max(job.loss_steps(), default=0) >= REQUEUE_AFTER_STEP, "step", job, START_S)
    requeued = time.monotonic()
    subprocess.run(["scontrol", "requeue", job.id], check=True)
    pending = wait_for(
        lambda: job.state()["JobState"] == "PENDING" and time.monotonic(), "pending", job, 60
    )
    if release_hold:
        subprocess.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now+2"], check=True)
    running = wait_for(
        lambda: job.state()["JobState"] == "RUNNING" and job.state()["Restarts"] == "1"
        and time.monotonic(),
        "start after the requeue",
        job,
        HOLD_S,
        poll_s=0.5,
    )  # fmt: skip
    after = step_logged_after(job.run_log(1), 0)
    training = wait_for(after, "training after the requeue", job, START_S)
    return {
        "requeue_to_training_s": round(training - requeued, 1),
        "requeue_to_running_s": round(running - requeued, 1),
        "requeue_to_pending_s": round(pending - requeued, 1),
        "running_to_training_s": round(training - running, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--release-hold", action="store_true")
    parser.add_argument("--output", type=Path, help="write the figures as JSON")
    parser.add_argument("--exp-dir", type=Path, help="default: a new temporary directory")
    args = parser.parse_args()
    exit_on_term()
    require_idle_nodes(2)
    exp_dir = args.exp_dir or Path(tempfile.mkdtemp(prefix="slurm_recovery-"))
    job = submit(
        exp_dir,
        f"trainer.max_steps={MAX_STEPS}",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=4",
        env={"MEGATRON_LNS_INJECT_FAULT": f"kind=crash,rank=3,step={CRASH_STEP}"},
    )
    print(f"job {job.id}: run directory {job.run_dir}", flush=True)
    try:
        figures = in_job_recovery(job)
        print(
            f"in-job restart: crash to training again {figures['crash_to_training_s']} s "
            f"(until the batch script restarts srun {figures['crash_to_restart_s']} s, then "
            f"{figures['restart_to_training_s']} s)",
            flush=True,
        )
        requeue = requeue_recovery(job, args.release_hold)
        figures.update(requeue)
        hold = "released at once" if args.release_hold else "SLURM's own hold"
        print(
            f"requeue ({hold}): requeue to training again {requeue['requeue_to_training_s']} s "
            f"(until running again {requeue['requeue_to_running_s']} s, then "
            f"{requeue['running_to_training_s']} s)",
            flush=True,
        )
    finally:
        job.cancel()
    figures["release_hold"] = args.release_hold
    if args.output:
        args.output.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
