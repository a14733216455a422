"""One run per run directory; metrics are not duplicated by a resume; a checkpoint save
leaves no helper process behind."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys

import pytest
from helpers import immutable, run_distributed, tiny_config, tiny_run_config

from megatron_lns.cluster.slurm.environment import SlurmEnvironment
from megatron_lns.cluster.slurm.job import GONE, SlurmQueryError
from megatron_lns.model.language_model import build_model
from megatron_lns.runtime.job import LocalJob
from megatron_lns.training.checkpoint import save_model_weights
from megatron_lns.training.metrics import MetricsLogger
from megatron_lns.training.run_dir import LOCK_NAME, RunDirError, claim_run_dir


def _lock_held_by(run_dir, pid, host=None, slurm_job=None, restart_count=0):
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = {"pid": pid, "host": host or socket.gethostname(), "started": 0}
    if slurm_job is not None:
        owner["slurm"] = {"job_id": slurm_job, "restart_count": restart_count, "cluster": "c1"}
    (run_dir / LOCK_NAME).write_text(json.dumps(owner))


@pytest.fixture()
def in_slurm_job(monkeypatch):
    """This process as run ``restart`` of SLURM job 41 on cluster c1."""

    def enter(restart=0):
        monkeypatch.setenv("SLURM_JOB_ID", "41")
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        monkeypatch.setenv("SLURM_CLUSTER_NAME", "c1")

    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(name, raising=False)
    return enter


def _slurm_says(state):
    """A fake of SLURM's answer on a job's state, remembering the jobs asked about."""

    def job_state(job_id):
        job_state.asked.append(job_id)
        if isinstance(state, Exception):
            raise state
        return state

    job_state.asked = []
    return job_state


def _not_asked(job_id):
    raise AssertionError(f"SLURM was asked about job {job_id}")


def _this_job(job_state):
    """The job `megatron-lns train` runs in here, asking SLURM through ``job_state``."""
    return SlurmEnvironment.of_this_process(job_state=job_state) or LocalJob()


def test_a_second_run_into_a_locked_directory_is_refused(tmp_path):
    lock = claim_run_dir(tmp_path / "run", resume_if_exists=True)
    with pytest.raises(RunDirError, match=f"is in use by process {os.getpid()} on"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True)
    lock.release()
    claim_run_dir(tmp_path / "run", resume_if_exists=True).release()


def test_a_lock_on_another_host_is_refused_with_how_to_clear_it(tmp_path):
    _lock_held_by(tmp_path / "run", 1, host="some-other-node")
    with pytest.raises(RunDirError, match=r"on some-other-node .*delete .*\.lock"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True)


def test_the_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    _lock_held_by(tmp_path / "run", int(gone.stdout))
    lock = claim_run_dir(tmp_path / "run", resume_if_exists=True)
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert "stale lock" in capsys.readouterr().out
    lock.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_requeued_job_on_another_host_takes_over_its_earlier_runs_lock(
    tmp_path, in_slurm_job, capsys
):
    in_slurm_job(restart=2)
    _lock_held_by(tmp_path / "run", os.getpid(), "gpu007", slurm_job="41", restart_count=1)
    lock = claim_run_dir(tmp_path / "run", resume_if_exists=True, job=_this_job(_not_asked))
    assert capsys.readouterr().out == (
        f"note: taking over the stale lock on {tmp_path / 'run'}: run 1 of this SLURM job 41 "
        "left it on gpu007, and SLURM has requeued the job since (this is run 2)\n"
    )
    owner = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    assert owner["slurm"] == {"job_id": "41", "restart_count": 2, "cluster": "c1"}
    lock.release()


def test_the_same_run_of_a_job_on_another_host_is_refused(tmp_path, in_slurm_job):
    in_slurm_job(restart=1)
    _lock_held_by(tmp_path / "run", 7, "gpu007", slurm_job="41", restart_count=1)
    with pytest.raises(RunDirError, match=r"process 7 on gpu007 .*\(this SLURM job 41, run 1\)"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True, job=_this_job(_not_asked))


@pytest.mark.parametrize(
    ("state", "said"),
    [(GONE, "no longer known to SLURM"), ("CANCELLED", "CANCELLED, no longer running"),
     ("PENDING", "PENDING, no longer running")],
)  # fmt: skip
def test_the_lock_of_a_job_slurm_no_longer_runs_is_taken_over_from_any_host(
    tmp_path, in_slurm_job, capsys, state, said
):
    in_slurm_job()
    _lock_held_by(tmp_path / "run", os.getpid(), "gpu007", slurm_job="40")
    slurm = _slurm_says(state)
    claim_run_dir(tmp_path / "run", resume_if_exists=True, job=_this_job(slurm)).release()
    assert slurm.asked == ["40"]
    assert capsys.readouterr().out == (
        f"note: taking over the stale lock on {tmp_path / 'run'}: SLURM job 40, which took it "
        f"on gpu007, is {said}\n"
    )


@pytest.mark.parametrize(
    ("slurm", "said"),
    [(_slurm_says("RUNNING"), "SLURM job 40, RUNNING"),
     (_slurm_says(SlurmQueryError("squeue is not installed here")),
      "SLURM job 40; cannot ask SLURM whether it still runs: squeue is not installed here")],
    ids=["running", "unknown"],
)  # fmt: skip
def test_the_lock_of_a_live_job_on_another_host_is_refused(tmp_path, in_slurm_job, slurm, said):
    in_slurm_job(restart=3)
    _lock_held_by(tmp_path / "run", 7, "gpu007", slurm_job="40")
    with pytest.raises(RunDirError, match=rf"process 7 on gpu007 since .* \({said}\): .*\.lock"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True, job=_this_job(slurm))
    assert (tmp_path / "run" / LOCK_NAME).is_file()


def test_on_the_same_host_only_the_lock_holders_process_decides(tmp_path, in_slurm_job):
    in_slurm_job(restart=1)  # a requeue of the job that took the lock, whose pid is alive
    _lock_held_by(tmp_path / "run", os.getpid(), slurm_job="41", restart_count=0)
    with pytest.raises(RunDirError, match=f"is in use by process {os.getpid()} on"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True, job=_this_job(_slurm_says(GONE)))


def test_without_slurm_a_lock_from_another_host_is_refused_as_before(tmp_path, in_slurm_job):
    _lock_held_by(tmp_path / "run", 7, "gpu007", slurm_job="41")
    with pytest.raises(RunDirError, match=r"process 7 on gpu007 since [-0-9 :]*: two runs"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True, job=_this_job(_not_asked))
    (tmp_path / "run" / LOCK_NAME).unlink()
    lock = claim_run_dir(tmp_path / "run", resume_if_exists=True, job=_this_job(_not_asked))
    assert "slurm" not in json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    lock.release()


@pytest.mark.parametrize("started", ["x", 1e30, float("nan"), None])
def test_a_live_lock_whose_start_is_no_time_is_refused_in_one_line(tmp_path, started):
    """Process 1 always runs: the lock stands, and its start is left unsaid."""
    (tmp_path / "run").mkdir()
    record = {"pid": 1, "host": socket.gethostname(), "started": started}
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps(record))
    with pytest.raises(RunDirError, match=r"in use by process 1 on [^ ]+: two runs must not"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True)


@pytest.mark.parametrize("pid", [99999999999999999999, 0, -1, True, "7", None])
def test_a_lock_that_names_no_process_is_refused_not_taken_over(tmp_path, pid):
    """No pid that can be asked whether it runs: nobody can tell the lock is stale."""
    _lock_held_by(tmp_path / "run", pid)
    with pytest.raises(RunDirError, match="in use by a process its lock does not name readably"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True)
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == pid


def test_no_resume_into_a_directory_that_holds_a_run_is_refused(tmp_path):
    (tmp_path / "run" / "checkpoints" / "iter_0000003").mkdir(parents=True)
    with pytest.raises(RunDirError, match=r"resume_if_exists=false, but .* already holds a run"):
        claim_run_dir(tmp_path / "run", resume_if_exists=False)
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    assert (tmp_path / "run" / "checkpoints" / "iter_0000003").is_dir()  # nothing touched


def test_a_run_directory_that_cannot_be_created_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match=r"cannot create the run directory .*file/run"):
        claim_run_dir(tmp_path / "file" / "run", resume_if_exists=True)


@pytest.mark.parametrize("name", ["config.yaml", "run_status"])
def test_a_directory_where_the_run_writes_a_file_is_refused_before_it_starts(tmp_path, name):
    """run_status is written last: found only then, the run would have trained in vain."""
    (tmp_path / "run" / name).mkdir(parents=True)
    with pytest.raises(RunDirError, match=f"^{tmp_path / 'run' / name} is a directory, but"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True)
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_an_immutable_run_status_is_refused_before_the_run_starts(tmp_path):
    status = tmp_path / "run" / "run_status"
    status.parent.mkdir()
    status.write_text("finished 6\n")
    with immutable(status), pytest.raises(RunDirError, match=f"^{status} cannot be replaced"):
        claim_run_dir(tmp_path / "run", resume_if_exists=True)
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_config_that_cannot_be_stored_releases_the_lock(tmp_path, megatron_world1):
    """Past the check before the start, the write itself fails (a directory at its
    temporary name): one line naming the config, and no lock left to refuse the next run."""
    import torch

    from megatron_lns.training.run_start import claim_run_directory

    (tmp_path / "run" / f"config.yaml.tmp-{os.getpid()}").mkdir(parents=True)
    with pytest.raises(RunDirError, match=f"^cannot write {tmp_path / 'run' / 'config.yaml'}: is"):
        claim_run_directory(
            tmp_path / "run", True, "a: 1\n", LocalJob(), torch.device("cpu"), print
        )
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_resumed_run_drops_the_metrics_logged_after_its_checkpoint(tmp_path, megatron_world1):
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 8, "lo')  # torn
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb=False, resume_step=4)
    logger.log(5, {"loss": 0.5}, console=False)
    logger.close()
    steps = [
        json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert steps == [1, 2, 3, 4, 5]


def test_a_checkpoint_save_leaves_no_helper_process(seeded, tmp_path):
    save_model_weights(build_model(tiny_config()), tmp_path / "weights")
    assert multiprocessing.active_children() == []


def test_a_lock_the_full_disk_cannot_hold_is_one_line_and_not_left_behind(tmp_path):
    """An empty lock would refuse every later run ("in use by another process")."""
    from helpers import fill_leaving, small_filesystem

    from megatron_lns.base.disk import DiskFullError

    with small_filesystem(tmp_path / "disk", 64) as disk:
        (disk / "run" / "checkpoints").mkdir(parents=True)
        fill_leaving(disk, 0)
        with pytest.raises(DiskFullError, match=f"^cannot write {disk / 'run' / LOCK_NAME}: no"):
            claim_run_dir(disk / "run", resume_if_exists=True)
        assert not (disk / "run" / LOCK_NAME).exists()
        (disk / "filler").unlink()
        claim_run_dir(disk / "run", resume_if_exists=True).release()  # once there is space


def _fail_after_claiming_the_run(cfg) -> bool:
    """Build a trainer whose checkpoint writer cannot be made; whether the lock is left."""
    from megatron_lns.config.paths import run_directory
    from megatron_lns.training import trainer

    def cannot_be_made(*args, **kwargs):
        raise RuntimeError("injected: the checkpoint writer cannot be made")

    trainer.CheckpointWriter = cannot_be_made
    with pytest.raises(RuntimeError, match="injected"):
        trainer.Trainer(cfg)
    return (run_directory(cfg) / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_failure_between_claiming_the_run_and_building_the_model_releases_the_lock(tmp_path):
    cfg = tiny_run_config(tmp_path / "exp")
    assert run_distributed(_fail_after_claiming_the_run, 1, tmp_path / "results", cfg) == [False]


def _train_without_writing_run_status(cfg) -> str:
    """Train with a run_status that cannot be written at the end; the state `status` reads."""
    from megatron_lns.base.disk import WriteError
    from megatron_lns.config.paths import run_directory
    from megatron_lns.training import trainer
    from megatron_lns.training.run_report import run_report

    def cannot_write(run_dir, *args):
        raise WriteError(f"cannot write {run_dir}/run_status: injected")

    trainer.write_run_status = cannot_write
    with pytest.raises(WriteError, match="injected"):
        trainer.Trainer(cfg).fit()
    return run_report(run_directory(cfg)).state


@pytest.mark.slow
def test_a_run_status_that_cannot_be_written_ends_the_attempt_as_failed(tmp_path):
    """run_status was written before the attempt's end was recorded: a failure to write it
    left no end, and `status` called the attempt killed or crashed."""
    cfg = tiny_run_config(tmp_path / "exp", "trainer.max_steps=3")
    assert run_distributed(_train_without_writing_run_status, 1, tmp_path / "r", cfg) == ["failed"]
