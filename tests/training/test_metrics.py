"""The run's records on a full disk: metrics.jsonl and TensorBoard warn once and let the
run go on (its checkpoints stop it cleanly), keeping only whole rows; run_status, which
a launcher acts on, is an error."""

import json

import pytest
from helpers import fill_leaving, small_filesystem

from megatron_lns.base.disk import DiskFullError
from megatron_lns.training.metrics import MetricsLogger
from megatron_lns.training.run_status import RUN_STATUS_FILE, read_run_status, write_run_status


def _rows(run_dir):
    return [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_metrics_on_a_full_disk_warn_once_keep_whole_rows_and_name_the_gap(
    megatron_world1, tmp_path, capsys
):
    with small_filesystem(tmp_path / "disk", 256) as disk:
        run_dir = disk / "run"
        logger = MetricsLogger(run_dir, tensorboard=True, wandb=False, run_name="r")
        logger.log(1, {"loss": 1.0})
        fill_leaving(disk, 0)
        wide = {f"layer_{i}/metric": 1.0 for i in range(400)}  # a row over a page
        for step in (2, 3, 4):
            logger.log(step, wide, console=False)
        (disk / "filler").unlink()
        logger.log(5, {"loss": 1.0})
        logger.close()
        assert _rows(run_dir) == [1, 5]
        err = capsys.readouterr().err
        assert err.count(f"warning: cannot write {run_dir / 'metrics.jsonl'}: no space left") == 1
        assert f"{run_dir / 'metrics.jsonl'} lacks the rows of steps 2 to 4 (disk full)" in err
        assert err.count("warning: TensorBoard events: [Errno 28] No space left") == 1
        assert "Traceback" not in err


def test_a_resume_on_a_full_disk_logs_no_rows_rather_than_twice(megatron_world1, tmp_path, capsys):
    with small_filesystem(tmp_path / "disk", 64) as disk:
        run_dir = disk / "run"
        logger = MetricsLogger(run_dir, tensorboard=False, wandb=False)
        for step in range(1, 6):
            logger.log(step, {"loss": 1.0})
        logger.close()
        fill_leaving(disk, 0)
        resumed = MetricsLogger(run_dir, tensorboard=False, wandb=False, resume_step=3)
        resumed.log(4, {"loss": 2.0})
        resumed.close()
        assert _rows(run_dir) == [1, 2, 3, 4, 5]  # as before the resume, not 4 twice
        assert "this run logs no rows to it" in capsys.readouterr().err
        assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_run_status_on_a_full_disk_is_an_error_and_leaves_the_old_one(tmp_path):
    with small_filesystem(tmp_path / "disk", 64) as disk:
        write_run_status(disk, stopped_early=True, step=3)
        fill_leaving(disk, 0)
        with pytest.raises(DiskFullError, match=f"cannot write {disk / RUN_STATUS_FILE}: no"):
            write_run_status(disk, stopped_early=False, step=6)
        assert read_run_status(disk) == ("stopped", 3)
        assert sorted(p.name for p in disk.iterdir()) == ["filler", RUN_STATUS_FILE]
