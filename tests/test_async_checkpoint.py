"""Asynchronous and fully parallel checkpoint saves (megatron-core's strategies): they
resume bitwise, load at other layouts, and a job killed while one is being written
leaves nothing that resume would take, and no process behind."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers import DEMO_CONFIG as DEMO
from helpers import TINY_RUN_OVERRIDES, fresh_launch_env, run_distributed, tiny_run_config

from megatron_lns.training.checkpoint import COMPLETE_MARKER, latest_complete_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_corpus_cache")]

ROOT = Path(__file__).resolve().parents[1]
ASYNC = "exp_manager.checkpoint_callback_params.async_save=true"
PARALLEL_SAVE = "model.dist_ckpt_parallel_save=true"
PARALLEL_LOAD = "model.dist_ckpt_parallel_load=true"


def _train(cfg):
    """Train; the losses, where it resumed from, and the processes it left running."""
    from megatron_lns.training.trainer import Trainer

    summary = Trainer(cfg).fit()
    return {
        "losses": summary.train_losses,
        "valid": summary.valid_loss,
        "resumed_from": summary.resumed_from,
        "children": [p.pid for p in psutil.Process().children(recursive=True)],
    }


def _run(tmp_path, cfg):
    world = cfg.trainer.devices
    return run_distributed(_train, world, tmp_path / f"r{time.monotonic_ns()}", cfg)


def test_async_saves_resume_bitwise_and_leave_no_process(tmp_path):
    straight = _run(tmp_path, tiny_run_config(tmp_path / "straight"))[0]
    resumed_dir = tmp_path / "resumed"
    # exit_interval=4: the step-3 save is committed by a later step's poll, the step-4
    # one by the wait before the run stops.
    first = _run(tmp_path, tiny_run_config(resumed_dir, ASYNC, "trainer.exit_interval=4"))[0]
    assert [s for s, _ in first["losses"]] == [1, 2, 3, 4]
    assert first["children"] == []
    checkpoints = resumed_dir / "lns" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_0000003", "iter_0000004"]
    second = _run(tmp_path, tiny_run_config(resumed_dir, ASYNC))[0]
    assert second["resumed_from"] == 4
    assert first["losses"] + second["losses"] == straight["losses"]  # bitwise on CPU
    assert second["valid"] == straight["valid"]
    assert second["children"] == []
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000006"


def test_parallel_async_save_at_dp2_loads_at_dp2_and_at_tp2(tmp_path):
    dp2 = ["trainer.devices=2"]
    straight = _run(tmp_path, tiny_run_config(tmp_path / "straight", *dp2))[0]
    run_dir = tmp_path / "parallel"
    stopped = _run(
        tmp_path, tiny_run_config(run_dir, *dp2, ASYNC, PARALLEL_SAVE, "trainer.exit_interval=3")
    )
    assert all(rank["children"] == [] for rank in stopped)
    checkpoint = run_dir / "lns" / "checkpoints" / "iter_0000003"
    # Both data-parallel ranks wrote shards of the replicated weights and optimizer state.
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    resumed = _run(tmp_path, tiny_run_config(run_dir, *dp2, PARALLEL_LOAD))[0]
    assert resumed["resumed_from"] == 3
    assert stopped[0]["losses"] + resumed["losses"] == straight["losses"]

    tp2 = ["trainer.devices=2", "model.tensor_model_parallel_size=2"]
    resume_at_tp2 = f"exp_manager.resume_from_checkpoint={checkpoint}"
    resharded = _run(tmp_path, tiny_run_config(tmp_path / "tp2", *tp2, resume_at_tp2))[0]
    assert resharded["resumed_from"] == 3
    expected = dict(straight["losses"])
    for step, loss in resharded["losses"]:
        assert loss == pytest.approx(expected[step], rel=1e-4), step


# Training whose background write of the step-4 checkpoint never ends: the writer (a
# process forked by the rank) records its pid, then hangs.
KILLED_DURING_ASYNC_SAVE = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    real_write = FileSystemWriterAsync.write_preloaded_data_multithread

    def write_then_hang(transforms, use_msc, rank, buckets, results_queue):
        if any("iter_0000004.partial" in str(bucket[0]) for bucket in buckets):
            Path(sys.argv[1]).write_text(str(os.getpid()))
            time.sleep(600)
        real_write(transforms, use_msc, rank, buckets, results_queue)

    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(write_then_hang)
    from megatron_lns.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


def test_job_killed_during_an_async_save_leaves_nothing_to_resume_from_or_running(tmp_path):
    every_2 = "exp_manager.checkpoint_callback_params.every_n_train_steps=2"
    args = ["train", str(DEMO), *TINY_RUN_OVERRIDES, every_2, ASYNC]
    marker = tmp_path / "writer_pid"
    job = subprocess.Popen(
        [sys.executable, "-c", KILLED_DURING_ASYNC_SAVE, str(marker), *args,
         f"exp_manager.exp_dir={tmp_path}"],
        cwd=ROOT, env=fresh_launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not (marker.exists() and marker.read_text()):
        assert job.poll() is None, job.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    helpers = psutil.Process(job.pid).children(recursive=True)
    writer = psutil.Process(int(marker.read_text()))
    assert writer in helpers  # and the server of the writer's result queue
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    gone, alive = psutil.wait_procs(helpers, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    checkpoints = tmp_path / "lns" / "checkpoints"
    assert (checkpoints / "iter_0000004.partial").is_dir()
    assert not (checkpoints / "iter_0000004.partial" / COMPLETE_MARKER).exists()
    assert not (checkpoints / "iter_0000004").exists()
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000002"

    resumed = _run(tmp_path, tiny_run_config(tmp_path, every_2, ASYNC))[0]
    assert resumed["resumed_from"] == 2
    straight = _run(tmp_path, tiny_run_config(tmp_path / "straight", every_2))[0]
    assert resumed["losses"] == straight["losses"][2:]
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000006"
