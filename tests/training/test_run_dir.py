"""One run per run directory; metrics are not duplicated by a resume; a checkpoint save
leaves no helper process behind."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys

import pytest
from helpers import tiny_config

from megatron_lns.model import build_model
from megatron_lns.training.checkpoint import save_model_weights
from megatron_lns.training.metrics import MetricsLogger
from megatron_lns.training.run_dir import LOCK_NAME, RunDirError, claim_run_dir


def _lock_held_by(run_dir, pid, host=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = {"pid": pid, "host": host or socket.gethostname(), "started": 0}
    (run_dir / LOCK_NAME).write_text(json.dumps(owner))


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
