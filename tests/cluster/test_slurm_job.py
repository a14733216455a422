"""What the run-directory lock learns of SLURM jobs: this process's job from SLURM's
variables, another job's state from ``squeue`` (faked here by a script on PATH)."""

import pytest

from megatron_lns.cluster.slurm.job import GONE, SlurmJob, SlurmQueryError, job_state


@pytest.fixture()
def squeue(tmp_path, monkeypatch):
    """Install a fake ``squeue`` printing ``stdout``/``stderr`` and exiting with ``status``."""

    def install(stdout="", stderr="", status=0):
        script = tmp_path / "squeue"
        script.write_text(
            f'#!/bin/sh\necho "$@" > {tmp_path}/args\nprintf "{stdout}"\n'
            f'printf "{stderr}" >&2\nexit {status}\n'
        )
        script.chmod(0o755)
        monkeypatch.setenv("PATH", str(tmp_path))
        return tmp_path / "args"

    return install


@pytest.mark.parametrize(
    ("stdout", "stderr", "status", "state"),
    [("RUNNING\\n", "", 0, "RUNNING"), ("CANCELLED\\n", "", 0, "CANCELLED"),
     ("COMPLETED\\nRUNNING\\n", "", 0, "RUNNING"), ("", "", 0, GONE),
     ("", "slurm_load_jobs error: Invalid job id specified\\n", 1, GONE)],
)  # fmt: skip
def test_the_state_squeue_reports(squeue, stdout, stderr, status, state):
    args = squeue(stdout, stderr, status)
    assert job_state("40") == state
    assert args.read_text().split() == [
        "--noheader",
        "--states=all",
        "--jobs",
        "40",
        "--format",
        "%T",
    ]


def test_a_controller_that_does_not_answer_is_an_unknown_not_an_ended_job(squeue):
    squeue(stderr="slurm_load_jobs error: Unable to contact slurm controller\\n", status=1)
    with pytest.raises(SlurmQueryError, match=r"squeue failed: .*Unable to contact slurm"):
        job_state("40")


def test_no_squeue_is_an_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmQueryError, match="squeue is not installed here"):
        job_state("40")


def test_the_job_of_this_process_and_its_record():
    assert SlurmJob.of_this_process({}) is None
    job = SlurmJob.of_this_process({"SLURM_JOB_ID": "41", "SLURM_CLUSTER_NAME": "c1"})
    assert job == SlurmJob("41", 0, "c1")
    requeued = SlurmJob.of_this_process({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"})
    assert requeued == SlurmJob("41", 2, None)
    assert SlurmJob.from_record(requeued.record()) == requeued
    assert SlurmJob.from_record(None) is None and SlurmJob.from_record({"job_id": 41}) is None
