"""``megatron-lns submit`` on a real SLURM: a job runs to max_steps; a job warned as
SLURM warns before a time limit or preemption saves, requeues itself, resumes and
ends with exactly the uninterrupted loss curve; a job failing at run time ends FAILED
without a requeue.

Needs a running cluster with ``SLURM_CONF`` exported (``.ci/run`` starts one with
``slurm/test-cluster/cluster.sh``). Without one the tests skip, except under CI=true,
where they fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import DEMO_CONFIG as DEMO
from helpers import ROOT, TINY_MODEL_OVERRIDES, TORCHRUN_VARIABLES

from megatron_lns.cli import main
from megatron_lns.data.preprocess import preprocess, read_documents
from megatron_lns.training.checkpoint import latest_complete_checkpoint

pytestmark = pytest.mark.slow

MAX_STEPS = 10
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
# The job name ends in the submission's time stamp (config/cluster.py: job_name).
JOB_NAME = "megatron_lns-tiny_cpu_demo-lns-"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
WAIT_S = 240


def _no_cluster_reason() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    if not os.environ.get("SLURM_CONF") and not Path("/etc/slurm/slurm.conf").is_file():
        return "SLURM_CONF is not set"
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-o", "%t %c"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if result.returncode != 0:
        return "sinfo failed: " + " ".join(result.stderr.split())
    nodes = [line.split() for line in result.stdout.splitlines() if line.strip()]
    if not any(state.rstrip("*") in ("idle", "mix") and int(cpus) >= 2 for state, cpus in nodes):
        return f"no idle node with 2 CPUs (sinfo: {result.stdout.strip()!r})"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Submitting jobs: the environment sbatch passes on to them; cancels leftovers."""
    reason = _no_cluster_reason()
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but no SLURM cluster is reachable: {reason}")
        pytest.skip(
            f"no SLURM cluster reachable ({reason}); start one with "
            "`slurm/test-cluster/cluster.sh start DIR` and export SLURM_CONF=DIR/slurm.conf"
        )
    submitted: list[str] = []
    with pytest.MonkeyPatch.context() as env:
        # sbatch hands the submitting environment to the job (its --export=ALL default).
        for name in TORCHRUN_VARIABLES:
            env.delenv(name, raising=False)
        env.setenv("PYTHONPATH", str(ROOT), prepend=os.pathsep)
        env.setenv("MEGATRON_LNS_CACHE", str(tmp_path_factory.getbasetemp() / "corpus_cache"))
        env.chdir(ROOT)
        yield submitted
    for job_id in submitted:
        subprocess.run(["scancel", job_id], capture_output=True)


def _submit(submitted: list[str], exp_dir: Path, *overrides: str) -> str:
    """`megatron-lns submit` (in this process: the same code, without another start-up)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    args = ["submit", str(DEMO), *JOB, f"exp_manager.exp_dir={exp_dir}", *overrides]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(args)
    assert code == 0, stderr.getvalue()
    first = stdout.getvalue().splitlines()[0]
    assert first.startswith("submitted job "), stdout.getvalue()
    job_id = first.split()[2].rstrip(":")
    submitted.append(job_id)
    run_dir = exp_dir / "lns"
    assert f"job log: {_log(run_dir, job_id)}\n" in stdout.getvalue()
    return job_id


def _log(run_dir: Path, job_id: str, run: str = "") -> Path:
    """The job's log (``run``: "-restart<k>", that run's own log)."""
    stamp = next((run_dir / "slurm").iterdir()).name  # one submission per run directory
    return run_dir / "logs" / f"{JOB_NAME}{stamp}-{job_id}{run}.log"


def _job(job_id: str) -> dict[str, str]:
    # A busy slurmctld occasionally drops a client connection: ask again.
    for _ in range(10):
        result = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True
        )
        if result.returncode == 0:
            return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)
        time.sleep(1)
    raise AssertionError(f"scontrol show job {job_id} keeps failing: {result.stderr}")


def _logs(run_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(run_dir.glob("logs/*.log")))


def _wait_until(job_id: str, run_dir: Path, done, what: str) -> dict[str, str]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        job = _job(job_id)
        if done(job):
            return job
        time.sleep(1)
    subprocess.run(["scancel", job_id], capture_output=True)
    pytest.fail(f"job {job_id}: no {what} after {WAIT_S}s ({_job(job_id)})\n{_logs(run_dir)}")


def _wait_for_end(job_id: str, run_dir: Path) -> dict[str, str]:
    return _wait_until(job_id, run_dir, lambda job: job["JobState"] in TERMINAL, "end")


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    exp_dir = tmp_path_factory.mktemp("uninterrupted")
    job_id = _submit(slurm, exp_dir)
    return job_id, exp_dir / "lns", _wait_for_end(job_id, exp_dir / "lns")


def test_submitted_job_runs_to_max_steps(uninterrupted):
    job_id, run_dir, job = uninterrupted
    assert job["JobState"] == "COMPLETED", _logs(run_dir)
    assert job["ExitCode"] == "0:0" and job["Restarts"] == "0"
    job_log = _log(run_dir, job_id).read_text()
    assert f"finished at step {MAX_STEPS}" in job_log
    run_log = _log(run_dir, job_id, "-restart0").read_text()
    assert f"step {MAX_STEPS:6d}  loss" in run_log
    assert (run_dir / "run_status").read_text() == f"finished {MAX_STEPS}\n"
    assert latest_complete_checkpoint(run_dir / "checkpoints").name == f"iter_{MAX_STEPS:07d}"
    assert [step for step, _ in _losses(run_dir)] == list(range(1, MAX_STEPS + 1))
    assert len(list((run_dir / "slurm").glob("*/job.sbatch"))) == 1


def test_preempted_job_requeues_and_continues_the_loss_curve_exactly(
    slurm, uninterrupted, tmp_path
):
    job_id = _submit(slurm, tmp_path)
    run_dir = tmp_path / "lns"

    def trained_three_steps(job):
        metrics = run_dir / "metrics.jsonl"
        return job["JobState"] in TERMINAL or (
            metrics.is_file() and metrics.read_text().count('"loss"') >= 3
        )

    assert _wait_until(job_id, run_dir, trained_three_steps, "step 3")["JobState"] == "RUNNING"
    # What SLURM does cluster.preemption_signal_lead_s before the time limit, to the
    # batch shell, its children and every task.
    subprocess.run(["scancel", "--signal=USR1", "--full", job_id], check=True)
    _wait_until(job_id, run_dir, lambda job: job["Restarts"] == "1", "requeue")
    # SLURM holds a requeued job back ~2 minutes (BeginTime); as root, start it sooner.
    # Not in the same second as the requeue: slurmd compares a new launch credential with
    # the previous run's revocation by the second and kills a start within it ("Job
    # credential revoked"; seen once in CI as a FAILED job with no restart1 log).
    subprocess.run(
        ["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], capture_output=True
    )
    job = _wait_for_end(job_id, run_dir)

    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", _logs(run_dir)
    job_log = _log(run_dir, job_id).read_text()
    assert "requeueing (1 of at most 5)" in job_log, job_log
    assert f"finished at step {MAX_STEPS}" in job_log
    stopped_at = int(job_log.split("restart 0: stopped at step ")[1].split(";")[0])
    assert 3 <= stopped_at < MAX_STEPS
    second_run = _log(run_dir, job_id, "-restart1").read_text()
    assert f"(step {stopped_at})" in second_run and "resumed from" in second_run
    # Every step exactly once, with the uninterrupted job's losses (bitwise on CPU).
    assert _losses(run_dir) == _losses(uninterrupted[1])
    # What the progress guard read (docs/cluster.md#progress-guard): each run's start
    # with the newest checkpoint, the step it resumed from, the warning, the commits.
    lines = [line.split() for line in (run_dir / "run_progress").read_text().splitlines()]
    events = sorted((run, event, step) for job_, run, event, step, *_ in lines if job_ == job_id)
    stopped = str(stopped_at)
    assert events == sorted([
        ("0", "start", "0"), ("0", "resumed", "0"), ("0", "warned", "-"), ("0", "saved", stopped),
        ("1", "start", stopped), ("1", "resumed", stopped), ("1", "saved", str(MAX_STEPS)),
    ]), lines  # fmt: skip


def test_job_failing_at_run_time_ends_failed_without_requeue(slurm, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a tiny corpus\n" for i in range(200)))
    prefix = tmp_path / "data" / "corpus"
    preprocess(read_documents([corpus]), prefix, workers=1)
    # Held at submit (the data exists then); the data disappears before it starts.
    job_id = _submit(
        slurm, tmp_path, f"model.data.data_prefix=[{prefix}]", "cluster.sbatch_args=[--hold]"
    )
    Path(f"{prefix}.bin").unlink()
    subprocess.run(["scontrol", "release", job_id], check=True)
    run_dir = tmp_path / "lns"
    job = _wait_for_end(job_id, run_dir)

    assert job["JobState"] == "FAILED" and job["Restarts"] == "0", _logs(run_dir)
    # 2 (the error) or 143: srun --kill-on-bad-exit TERMs the other rank, and reports
    # the highest status of all tasks.
    assert job["ExitCode"] in ("2:0", "143:0"), job["ExitCode"]
    job_log = _log(run_dir, job_id).read_text()
    assert f"failed: srun exited with status {job['ExitCode'][:-2]}; not requeued" in job_log
    run_log = _log(run_dir, job_id, "-restart0").read_text()
    assert f"model.data.data_prefix: {prefix}.bin does not exist" in run_log
    assert not (run_dir / "run_status").exists()
