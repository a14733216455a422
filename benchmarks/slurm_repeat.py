"""The 2-node job N times: every one must end COMPLETED with nothing failing at exit.

Issue 35: once in a CI run, the 2-node job of ``tests/cluster/test_slurm_multinode.py``
logged all its steps and then a rank died at exit with "terminate called without an active
exception" (a process group still alive when the interpreter tore down), and the job ended
FAILED. ``run_job`` now destroys the process groups of externally launched ranks
(tests/test_launcher_env.py); this repeats the job to show the failure is gone. A job
passes when it ends COMPLETED with ``finished at step 10`` in its job log, no rank failing
after the trainer finished (the batch script notes that case but ends the job COMPLETED),
no in-job restart, and no ``terminate called`` in any of its logs.

Needs a SLURM cluster with 2 idle nodes (``SLURM_CONF``; the multi-node test cluster:
``slurm/test-cluster/cluster.sh start DIR --nodes 3``). The jobs are submitted at once and
run one after another (each takes 2 of the 3 nodes); about 40 s each on the 2-core test
cluster. Exits 1 if any job did not pass.

    SLURM_CONF=DIR/slurm.conf .venv/bin/python benchmarks/slurm_repeat.py --runs 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_job_runs import TERMINAL, Job, exit_on_term, require_idle_nodes, submit, wait_for

MAX_STEPS = 10
JOB_S = 300  # one job's limit, after the ones before it


def verdict(job: Job, state: dict[str, str]) -> str:
    """Why the job did not pass, or "" when it did."""
    logs = {path.name: path.read_text() for path in job.log.parent.glob("*.log")}
    job_log = logs.get(job.log.name, "")
    if state["JobState"] != "COMPLETED":
        return f"{state['JobState']}: {job_log.strip().splitlines()[-1:] or 'no job log'}"
    if f"finished at step {MAX_STEPS}\n" not in job_log:
        return f"no 'finished at step {MAX_STEPS}' alone: {job_log.strip().splitlines()[-1:]}"
    if "restarting in-job" in job_log:
        return "restarted in-job"
    bad = [name for name, text in logs.items() if "terminate called" in text]
    return f"'terminate called' in {', '.join(bad)}" if bad else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--output", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    exit_on_term()
    require_idle_nodes(2)
    base = Path(tempfile.mkdtemp(prefix="slurm_repeat-"))
    started = time.monotonic()
    jobs = [submit(base / f"run{i}", f"trainer.max_steps={MAX_STEPS}") for i in range(args.runs)]
    print(f"{args.runs} jobs submitted into {base}", flush=True)
    results = []
    try:
        for number, job in enumerate(jobs, 1):
            state = wait_for(
                lambda job=job: (s := job.state())["JobState"] in TERMINAL and s,
                "end",
                job,
                started + JOB_S * number - time.monotonic(),  # they run one after another
                poll_s=1.0,
            )
            why = verdict(job, state)
            results.append({"job": job.id, "state": state["JobState"], "failure": why})
            print(f"job {job.id}: {state['JobState']}{' - ' + why if why else ''}", flush=True)
    finally:
        for job in jobs:
            job.cancel()
    passed = sum(not result["failure"] for result in results)
    elapsed = time.monotonic() - started
    print(
        f"{passed} of {args.runs} jobs passed in {elapsed:.0f} s ({elapsed / args.runs:.0f} s each)"
    )
    if args.output:
        summary = {"runs": args.runs, "passed": passed, "seconds": round(elapsed), "jobs": results}
        args.output.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
