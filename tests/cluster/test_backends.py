"""The backend registry: which job a process runs in, and which executor ``submit`` uses."""

import pickle
import signal

from megatron_lns.cluster import executor_for, job_of_this_process
from megatron_lns.cluster.backends import BACKENDS
from megatron_lns.cluster.slurm.environment import SlurmEnvironment
from megatron_lns.cluster.slurm.executor import SlurmExecutor
from megatron_lns.cluster.slurm.job import SlurmJob
from megatron_lns.runtime.job import LocalJob, ProgressSettings

SETTINGS = ProgressSettings(lead_s=60, time_limit_s=3600, every=50, async_save=False)


def test_a_process_under_slurm_runs_in_its_slurm_job_and_any_other_locally():
    under_srun = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2", "SLURM_CLUSTER_NAME": "c1"}
    job = job_of_this_process(under_srun)
    assert job == SlurmEnvironment(SlurmJob("41", 2, "c1"))
    assert (job.job_id, job.restart_count) == ("41", 2)
    assert job.lock_record() == {"slurm": {"job_id": "41", "restart_count": 2, "cluster": "c1"}}
    assert job_of_this_process({}) == LocalJob()
    assert job_of_this_process({"SLURM_JOB_ID": " "}) == LocalJob()


def test_a_local_run_records_nothing_and_cannot_judge_another_hosts_lock(tmp_path):
    job = LocalJob()
    assert (job.job_id, job.restart_count, job.lock_record()) == (None, 0, {})
    holder = {"pid": 7, "host": "gpu007", "slurm": {"job_id": "40", "restart_count": 0}}
    assert job.judge_foreign_lock(holder).stale == ""
    assert job.time_limit_s(900.0) == 900.0
    assert job.progress_records(tmp_path, SETTINGS) is None
    assert signal.SIGUSR1 in job.stop_signals()  # a scheduler's warning, or sent by hand


def test_slurm_records_progress_only_under_its_batch_script(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRON_LNS_BATCH_START", raising=False)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    job = SlurmEnvironment(SlurmJob("42", 3))
    assert job.progress_records(tmp_path, SETTINGS) is None  # srun by hand
    monkeypatch.setenv("MEGATRON_LNS_BATCH_START", "1000")
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1900")
    assert job.time_limit_s(3600) == 900  # SLURM's end time wins over the configured limit
    recorder = job.progress_records(tmp_path, SETTINGS)
    assert (recorder.job, recorder.started_at) == (SlurmJob("42", 3), 1000)


def test_job_environments_reach_spawned_ranks_whole():
    for job in (LocalJob(), SlurmEnvironment(SlurmJob("41", 1, "c1"))):
        assert pickle.loads(pickle.dumps(job)) == job


def test_submit_uses_the_registered_slurm_executor():
    assert set(BACKENDS) == {"slurm"}
    assert isinstance(executor_for(None), SlurmExecutor)


def test_the_lock_of_an_earlier_in_job_attempt_is_stale_on_any_host():
    """The batch script's in-job restart may start rank 0 on another node (a node left out):
    the lock the killed attempt left there names an earlier attempt of this very run."""
    env = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2", "MEGATRON_LNS_ATTEMPT": "1"}
    job = job_of_this_process(env)
    assert job.lock_record()["slurm"]["attempt"] == 1
    earlier = {"pid": 7, "host": "n2", "slurm": {"job_id": "41", "restart_count": 2}}
    assert "attempt 0 of this SLURM job 41 (run 2) left it on n2" in (
        job.judge_foreign_lock(earlier).stale
    )
    same = {**earlier, "slurm": job.lock_record()["slurm"]}
    verdict = job.judge_foreign_lock(same)
    assert verdict.stale == "" and "run 2" in verdict.held_by
