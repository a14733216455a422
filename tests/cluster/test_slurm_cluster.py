"""``megatron-lns submit`` on a real SLURM: a job runs to max_steps; a job warned as
SLURM warns before a time limit or preemption saves, requeues itself, resumes and
ends with exactly the uninterrupted loss curve; a job failing at run time ends FAILED
without a requeue.

Needs a running cluster with ``SLURM_CONF`` exported (``.ci/run`` starts one with
``slurm/test-cluster/cluster.sh``). Without one the tests skip, except under CI=true,
where they fail.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from slurm_jobs import (
    MAX_STEPS,
    logs,
    losses,
    require_cluster,
    start_requeued_soon,
    submit,
    submitting,
    trained_steps,
    wait_for_end,
    wait_until,
)

from megatron_lns.data.preprocess import preprocess, read_documents
from megatron_lns.training.attempt_recorder import ATTEMPT_EVENTS
from megatron_lns.training.checkpoint import latest_complete_checkpoint
from megatron_lns.training.run_report import run_report

pytestmark = [pytest.mark.slow, pytest.mark.long]  # one at a time: tests/conftest.py


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Submitting jobs: the environment sbatch passes on to them; cancels leftovers."""
    require_cluster(nodes=1)
    with submitting(tmp_path_factory.getbasetemp() / "corpus_cache") as submitted:
        yield submitted


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    job = submit(slurm, tmp_path_factory.mktemp("uninterrupted"))
    return job, wait_for_end(job)


def test_submitted_job_runs_to_max_steps(uninterrupted):
    job, state = uninterrupted
    run_dir = job.run_dir
    assert state["JobState"] == "COMPLETED", logs(run_dir)
    assert state["ExitCode"] == "0:0" and state["Restarts"] == "0"
    job_log = job.log.read_text()
    assert f"finished at step {MAX_STEPS}" in job_log
    run_log = job.run_log(0).read_text()
    assert f"step {MAX_STEPS:6d}  loss" in run_log
    assert (run_dir / "run_status").read_text() == f"finished {MAX_STEPS}\n"
    assert latest_complete_checkpoint(run_dir / "checkpoints").name == f"iter_{MAX_STEPS:07d}"
    assert [step for step, _ in losses(run_dir)] == list(range(1, MAX_STEPS + 1))
    assert len(list((run_dir / "slurm").glob("*/job.sbatch"))) == 1


def test_preempted_job_requeues_and_continues_the_loss_curve_exactly(
    slurm, uninterrupted, tmp_path
):
    job = submit(slurm, tmp_path)
    run_dir = job.run_dir
    assert wait_until(job, trained_steps(job, 3), "step 3")["JobState"] == "RUNNING"
    # What SLURM does cluster.preemption_signal_lead_s before the time limit, to the
    # batch shell, its children and every task.
    subprocess.run(["scancel", "--signal=USR1", "--full", job.id], check=True)
    wait_until(job, lambda state: state["Restarts"] == "1", "requeue")
    start_requeued_soon(job)
    state = wait_for_end(job)

    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", logs(run_dir)
    job_log = job.log.read_text()
    assert "requeueing (1 of at most 5)" in job_log, job_log
    assert f"finished at step {MAX_STEPS}" in job_log
    stopped_at = int(job_log.split("restart 0: stopped at step ")[1].split(";")[0])
    assert 3 <= stopped_at < MAX_STEPS
    second_run = job.run_log(1).read_text()
    assert f"(step {stopped_at})" in second_run and "resumed from" in second_run
    # Every step exactly once, with the uninterrupted job's losses (bitwise on CPU).
    assert losses(run_dir) == losses(uninterrupted[0].run_dir)
    # What the progress guard read (docs/cluster.md#progress-guard): each run's start
    # with the newest checkpoint, the step it resumed from, the warning, the commits.
    lines = [line.split() for line in (run_dir / "run_progress").read_text().splitlines()]
    events = sorted(
        (run, event, step)
        for job_, run, event, step, *_ in lines
        if job_ == job.id and event not in ATTEMPT_EVENTS  # the goodput's lines, below
    )
    stopped = str(stopped_at)
    assert events == sorted([
        ("0", "start", "0"), ("0", "resumed", "0"), ("0", "warned", "-"), ("0", "saved", stopped),
        ("1", "start", stopped), ("1", "resumed", stopped), ("1", "saved", str(MAX_STEPS)),
    ]), lines  # fmt: skip
    # Where the job's wall time went (megatron-lns status): two attempts of one job, the
    # first stopped on the warning, the time in the queue between them counted.
    report = run_report(run_dir)
    assert [(a.job_id, a.restart, a.how) for a in report.goodput.attempts] == [
        (job.id, 0, "stopped"), (job.id, 1, "finished"),
    ]  # fmt: skip
    assert report.goodput.rows["restarts, queue wait"] > 0
    assert report.goodput.rows["lost work"] == 0 and min(report.goodput.rows.values()) >= 0


def test_job_failing_at_run_time_ends_failed_without_requeue(slurm, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a tiny corpus\n" for i in range(200)))
    prefix = tmp_path / "data" / "corpus"
    preprocess(read_documents([corpus]), prefix)
    # Held at submit (the data exists then); the data disappears before it starts.
    job = submit(
        slurm, tmp_path, f"model.data.data_prefix=[{prefix}]", "cluster.sbatch_args=[--hold]"
    )
    Path(f"{prefix}.bin").unlink()
    subprocess.run(["scontrol", "release", job.id], check=True)
    run_dir = job.run_dir
    state = wait_for_end(job)

    assert state["JobState"] == "FAILED" and state["Restarts"] == "0", logs(run_dir)
    # 2 (the error) or 143: srun --kill-on-bad-exit TERMs the other rank, and reports
    # the highest status of all tasks.
    assert state["ExitCode"] in ("2:0", "143:0"), state["ExitCode"]
    job_log = job.log.read_text()
    assert f"failed: srun exited with status {state['ExitCode'][:-2]}; not requeued" in job_log
    run_log = job.run_log(0).read_text()
    assert f"model.data.data_prefix: {prefix}.bin does not exist" in run_log
    assert not (run_dir / "run_status").exists()
