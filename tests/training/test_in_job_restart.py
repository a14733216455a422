"""In-job restart of a local 2-rank run (runtime/restarts.py) through ``megatron-lns train``:
a killed rank costs a restart from the newest checkpoint, not the run, and the loss curve
stays the uninterrupted run's; a failure that recurs stops the run with its cause."""

import os
import re
import subprocess
import sys

import pytest
from helpers import DEMO_CONFIG as DEMO
from helpers import ROOT, TWO_RANK_RUN_OVERRIDES, fresh_launch_env, logged_losses

from megatron_lns.training.run_report import run_report

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.usefixtures("private_corpus_cache")]


def _train(exp_dir, *overrides, fault=""):
    env = fresh_launch_env(MEGATRON_LNS_CACHE=os.environ["MEGATRON_LNS_CACHE"])
    env.pop("MEGATRON_LNS_ATTEMPT", None)
    if fault:
        env["MEGATRON_LNS_INJECT_FAULT"] = fault
    command = [sys.executable, "-m", "megatron_lns.cli", "train", str(DEMO), *TWO_RANK_RUN_OVERRIDES,
               f"exp_manager.exp_dir={exp_dir}", *overrides]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_killed_rank_restarts_in_job_and_the_run_trains_on_bitwise(
    tmp_path, straight_two_rank_run
):
    # Rank 1 dies in step 4 (its forward-backward done); the newest checkpoint is step 2's.
    run = _train(tmp_path / "killed", fault="kind=crash,rank=1,step=4")
    assert run.returncode == 0, run.stderr
    (restart,) = [line for line in run.stderr.splitlines() if line.startswith("in-job restart")]
    # Rank 0's failed collective may end it before the launcher sees rank 1's death.
    assert re.match(
        r"in-job restart 1 of 3: rank (1 was killed by SIGKILL|0 raised an error .*) at ", restart
    ), restart
    assert restart.endswith("; every rank restarts (attempt 1) from the checkpoint of step 2")
    assert "resumed from" in run.stdout
    run_dir = tmp_path / "killed" / "lns"
    # Steps 3 and 4 trained again from step 2's checkpoint, as the uninterrupted run did
    # them, and logged once.
    assert logged_losses(run_dir) == logged_losses(straight_two_rank_run)

    report = run_report(run_dir)
    failed, restarted = report.goodput.attempts
    assert (failed.in_job_restart, restarted.in_job_restart) == (0, 1)
    assert (restarted.first_step, restarted.last_step, restarted.how) == (2, 6, "finished")
    assert failed.lost_steps >= 1  # step 3 at least (rank 0 may have finished step 4)
    rows = report.goodput.rows
    assert rows["lost work"] > 0 and min(rows.values()) >= 0
    # The time between the attempts is the run's (an in-job restart), not left out as a
    # rerun's would be (its size, tens of ms, is below the records' precision here).
    gap = restarted.start - failed.last_at
    assert report.goodput.wall_s == pytest.approx(failed.wall_s + restarted.wall_s + gap, abs=0.05)
    assert report.in_job_restarts == 1 and report.state == "finished"
    status = subprocess.run(
        [sys.executable, "-m", "megatron_lns.cli", "status", str(run_dir)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "; restarts: 1 (1 in-job); " in status.stdout
    assert "step(s) trained again after failures" in status.stdout


def test_a_failure_that_recurs_after_each_restart_stops_the_run_with_its_cause(tmp_path):
    recurring = "kind=crash,rank=1,step=1;kind=crash,rank=1,step=1,attempt=1"
    run = _train(
        tmp_path, "exp_manager.fault_tolerance.max_restarts_without_progress=1", fault=recurring
    )
    assert run.returncode == 1
    restarts = [line for line in run.stderr.splitlines() if line.startswith("in-job restart")]
    assert len(restarts) == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: rank 1 was killed by SIGKILL; the last 1 in-job restart(s) committed no "
        "checkpoint (exp_manager.fault_tolerance.max_restarts_without_progress=1): the failure "
        "recurs; stopping"
    ]
    assert "Traceback" not in run.stderr
    attempts = run_report(tmp_path / "lns").goodput.attempts
    assert [a.in_job_restart for a in attempts] == [0, 1]
