"""The batch script trusts only the run_status line its own attempt wrote: a second job
of the same run directory (which fails on the run's lock) neither takes the first job's
line for its own nor removes it; a stop it was not warned of is named by its cause."""

from __future__ import annotations

from test_slurm_render import DEMO, TINY_TP2, _cfg, _exp, _run_batch_script

from megatron_lns.training.run_dir import claim_run_dir
from megatron_lns.training.run_status import RUN_STATUS_COPY_ENV, write_run_status


def test_a_job_that_lost_the_lock_fails_and_leaves_the_other_jobs_run_status(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    result, requeues, _, job = _run_batch_script(tmp_path, cfg, "lost_lock")
    assert result.returncode == 2 and requeues == "", result.stdout
    assert "finished" not in result.stdout, result.stdout
    assert "failed: srun exited with status 2; not requeued" in result.stdout
    assert (job.paths.run_dir / "run_status").read_text() == "finished 6\n"


def test_a_run_status_there_before_the_job_is_left_to_the_trainer(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    status = tmp_path / "runs" / cfg.exp_manager.name / "run_status"
    status.parent.mkdir(parents=True)
    status.write_text("finished 6\n")  # another job's, which may be reading it
    result, _, _, _ = _run_batch_script(tmp_path, cfg, "fail")
    assert result.returncode == 3 and "finished" not in result.stdout, result.stdout
    assert status.read_text() == "finished 6\n"


def test_the_trainer_removes_the_last_run_status_once_it_holds_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run_status").write_text("finished 6\n")
    claim_run_dir(run_dir, resume_if_exists=True).release()
    assert not (run_dir / "run_status").exists()


def test_the_trainer_writes_its_line_to_the_launchers_file_too(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_STATUS_COPY_ENV, str(tmp_path / "mine"))
    write_run_status(tmp_path, stopped_early=True, step=4)
    assert (tmp_path / "run_status").read_text() == "stopped 4\n"
    assert (tmp_path / "mine").read_text() == "stopped 4\n"


def test_a_stop_signalled_to_the_job_steps_only_is_requeued_as_a_preemption(tmp_path):
    """`scancel --signal=USR1 JOB` (no --full) reaches the ranks, not the batch shell:
    the stop at step 3 is no step of trainer.exit_interval (null here)."""
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "exit_interval")
    assert result.returncode == 0 and requeues == "requeue 42\n", result.stdout
    assert "trainer.exit_interval (checkpoint saved)" not in result.stdout
    assert "stopped at step 3 on a stop request sent to the job steps" in result.stdout
    assert "stopped at step 3; requeueing (1 of at most" in result.stdout


def test_a_stop_at_a_step_of_exit_interval_is_named_so_and_not_requeued(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path), "trainer.exit_interval=3")
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "exit_interval")
    assert result.returncode == 0 and requeues == "", result.stdout
    assert "stopped at step 3 by trainer.exit_interval (checkpoint saved)" in result.stdout
