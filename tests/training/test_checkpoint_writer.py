"""Asynchronous and fully parallel checkpoint saves (megatron-core's strategies): they
resume bitwise, load at other layouts, and a job killed while one is being written
leaves nothing that resume would take, and no process behind."""

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers import DEMO_CONFIG as DEMO
from helpers import (
    ROOT,
    TINY_RUN_OVERRIDES,
    fit_and_summarize,
    fresh_launch_env,
    still_running,
    tiny_run_config,
    train_on_its_ranks,
)

from megatron_lns.training.checkpoint import COMPLETE_MARKER, latest_complete_checkpoint

pytestmark = pytest.mark.usefixtures("private_corpus_cache")

ASYNC = "exp_manager.checkpoint_callback_params.async_save=true"
PARALLEL_SAVE = "model.dist_ckpt_parallel_save=true"
PARALLEL_LOAD = "model.dist_ckpt_parallel_load=true"


def _train(cfg):
    """Train; the summary, and the processes it left running."""
    return {
        **fit_and_summarize(cfg),
        "children": [p.pid for p in psutil.Process().children(recursive=True)],
    }


def _run(tmp_path, cfg):
    return train_on_its_ranks(tmp_path, cfg, _train)


def test_an_async_save_takes_the_state_at_once_and_counts_only_once_committed(seeded, tmp_path):
    import torch
    from helpers import fixed_microbatches, tiny_config

    from megatron_lns.model.language_model import build_model
    from megatron_lns.training.build import wrap_with_ddp
    from megatron_lns.training.checkpoint import TrainingState, load_model_weights
    from megatron_lns.training.checkpoint_writer import CheckpointWriter
    from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler
    from megatron_lns.training.step import train_step

    cfg = tiny_config()
    model = wrap_with_ddp(build_model(cfg))
    optimizer, scheduler = build_optimizer_and_scheduler(model, OptimSettings(warmup_steps=1), 10)
    batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length)
    train_step(model, optimizer, batches)
    saved = [p.detach().clone() for p in model[0].parameters()]
    before = set(psutil.Process().children(recursive=True))

    writer = CheckpointWriter(tmp_path, asynchronous=True)
    path = writer.save(model, optimizer, scheduler, TrainingState(1, 4), "a: 1\n")
    train_step(model, optimizer, batches)  # training goes on while the save is written
    assert writer.pending == [path] and not path.exists()
    assert not (tmp_path / "iter_0000001.partial" / COMPLETE_MARKER).exists()
    assert latest_complete_checkpoint(tmp_path) is None
    assert writer.wait() == [path]
    assert latest_complete_checkpoint(tmp_path) == path
    assert (path / "config.yaml").read_text() == "a: 1\n"
    writer.close()
    assert set(psutil.Process().children(recursive=True)) <= before

    load_model_weights(model, path)  # the weights of the step saved, not of the next one
    for loaded, expected in zip(model[0].parameters(), saved, strict=True):
        assert torch.equal(loaded, expected)


def test_each_commit_is_reported_once_with_the_seconds_its_save_took(seeded, tmp_path):
    """The progress guard's save time (cluster/slurm/progress.py): reported when a checkpoint is
    committed, for a synchronous save at once, for an asynchronous one by the wait."""
    from helpers import tiny_config

    from megatron_lns.model.language_model import build_model
    from megatron_lns.training.build import wrap_with_ddp
    from megatron_lns.training.checkpoint import TrainingState
    from megatron_lns.training.checkpoint_writer import CheckpointWriter
    from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler

    model = wrap_with_ddp(build_model(tiny_config()))
    optimizer, scheduler = build_optimizer_and_scheduler(model, OptimSettings(), 10)
    for asynchronous in (False, True):
        commits = []
        writer = CheckpointWriter(
            tmp_path / str(asynchronous), asynchronous,
            on_commit=lambda path, seconds: commits.append((path, seconds)),  # noqa: B023
        )  # fmt: skip
        path = writer.save(model, optimizer, scheduler, TrainingState(1, 4), "")
        assert len(commits) == (0 if asynchronous else 1)
        writer.wait()
        writer.close()
        assert [p for p, _ in commits] == [path] and 0 < commits[0][1] < 60


def test_a_failed_background_write_is_one_error_naming_the_checkpoint(
    seeded, tmp_path, monkeypatch
):
    from helpers import tiny_config
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from megatron_lns.model.language_model import build_model
    from megatron_lns.training.build import wrap_with_ddp
    from megatron_lns.training.checkpoint import CheckpointError, TrainingState
    from megatron_lns.training.checkpoint_writer import CheckpointWriter
    from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # Inherited by the writer process that megatron forks.
    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(disk_full))
    model = wrap_with_ddp(build_model(tiny_config()))
    optimizer, scheduler = build_optimizer_and_scheduler(model, OptimSettings(), 10)
    writer = CheckpointWriter(tmp_path, asynchronous=True)
    writer.save(model, optimizer, scheduler, TrainingState(1, 4), "")
    with pytest.raises(CheckpointError) as info:
        writer.wait()
    writer.close()
    message = str(info.value)
    assert message.startswith(
        f"could not save checkpoint {tmp_path / 'iter_0000001'} (left as "
        "iter_0000001.partial, which resume ignores): "
    )
    assert "\n" not in message
    assert writer.pending == [] and latest_complete_checkpoint(tmp_path) is None


@pytest.mark.slow
def test_async_saves_resume_bitwise_and_leave_no_process(tmp_path):
    # Saves at steps 3 (committed by a later step's poll) and 6 (by the final wait).
    whole = _run(tmp_path, tiny_run_config(tmp_path / "whole", ASYNC))[0]
    assert whole["children"] == []
    step3 = tmp_path / "whole" / "lns" / "checkpoints" / "iter_0000003"
    # Resumed from step 3, stopped by exit_interval at 5: the run waits for that save.
    resumed = _run(
        tmp_path,
        tiny_run_config(
            tmp_path / "resumed", ASYNC, "trainer.exit_interval=5",
            f"exp_manager.resume_from_checkpoint={step3}",
        ),
    )[0]  # fmt: skip
    assert resumed["resumed_from"] == 3
    assert resumed["losses"] == whole["losses"][3:5]  # bitwise on CPU
    assert resumed["children"] == []
    from megatron_lns.training.run_status import read_run_status

    run_dir = tmp_path / "resumed" / "lns"
    assert latest_complete_checkpoint(run_dir / "checkpoints").name == "iter_0000005"
    assert read_run_status(run_dir) == ("stopped", 5)


@pytest.mark.slow
def test_parallel_async_save_at_dp2_resumes_bitwise_with_parallel_load(tmp_path):
    dp2 = ["trainer.devices=2", ASYNC, PARALLEL_SAVE]
    whole = _run(tmp_path, tiny_run_config(tmp_path / "whole", *dp2))
    assert all(rank["children"] == [] for rank in whole)
    step3 = tmp_path / "whole" / "lns" / "checkpoints" / "iter_0000003"
    # Both data-parallel ranks wrote a share of the replicated weights and optimizer
    # state (without the parallel save rank 1 writes only its RNG state).
    rank0, rank1 = (step3 / f"__{rank}_0.distcp" for rank in (0, 1))
    assert rank1.stat().st_size > rank0.stat().st_size / 3

    resume = f"exp_manager.resume_from_checkpoint={step3}"
    resumed = _run(tmp_path, tiny_run_config(tmp_path / "resumed", *dp2, PARALLEL_LOAD, resume))
    assert resumed[0]["resumed_from"] == 3
    assert resumed[0]["losses"] == whole[0]["losses"][3:]


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


@pytest.mark.long
@pytest.mark.slow
def test_job_killed_during_an_async_save_leaves_nothing_to_resume_from_or_running(tmp_path):
    every_2 = "exp_manager.checkpoint_callback_params.every_n_train_steps=2"
    args = ["train", str(DEMO), *TINY_RUN_OVERRIDES, every_2, ASYNC]
    marker = tmp_path / "writer_pid"
    job = subprocess.Popen(
        [sys.executable, "-c", KILLED_DURING_ASYNC_SAVE, str(marker), *args,
         f"exp_manager.exp_dir={tmp_path}"],
        cwd=ROOT, env=fresh_launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 600  # a loaded CI machine
    try:
        while not (marker.exists() and marker.read_text()):
            assert job.poll() is None, job.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.1)
    except AssertionError:
        job.kill()  # with the writer and the queue server, which die with it
        raise
    helpers = psutil.Process(job.pid).children(recursive=True)
    writer = psutil.Process(int(marker.read_text()))
    assert writer in helpers  # and the server of the writer's result queue
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    survivors = still_running(helpers)
    for process in survivors:  # so that a failure here leaves nothing running either
        process.kill()
    assert not survivors

    checkpoints = tmp_path / "lns" / "checkpoints"
    assert (checkpoints / "iter_0000004.partial").is_dir()
    assert not (checkpoints / "iter_0000004.partial" / COMPLETE_MARKER).exists()
    assert not (checkpoints / "iter_0000004").exists()
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000002"

    resumed = _run(tmp_path, tiny_run_config(tmp_path, every_2, ASYNC))[0]
    assert resumed["resumed_from"] == 2
    assert [step for step, _ in resumed["losses"]] == [3, 4, 5, 6]
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000006"
    assert not (checkpoints / "iter_0000004.partial").exists()  # replaced by step 4's save


def test_a_background_save_onto_a_full_disk_is_one_line_and_gives_the_space_back(seeded, tmp_path):
    from helpers import directory_bytes, fill_leaving, small_filesystem, tiny_config

    from megatron_lns.base.disk import DiskFullError
    from megatron_lns.model.language_model import build_model
    from megatron_lns.training.build import wrap_with_ddp
    from megatron_lns.training.checkpoint import TrainingState
    from megatron_lns.training.checkpoint_writer import CheckpointWriter
    from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler

    model = wrap_with_ddp(build_model(tiny_config()))
    optimizer, scheduler = build_optimizer_and_scheduler(model, OptimSettings(), 10)
    with small_filesystem(tmp_path / "disk", 4096) as disk:
        writer = CheckpointWriter(disk, asynchronous=True)
        try:
            first = writer.save(model, optimizer, scheduler, TrainingState(1, 4), "")
            writer.wait()
            fill_leaving(disk, directory_bytes(first) // 2)
            writer.save(model, optimizer, scheduler, TrainingState(2, 8), "")
            with pytest.raises(DiskFullError) as info:
                writer.wait()
        finally:
            writer.close()
        assert str(info.value).startswith(f"cannot write {disk / 'iter_0000002'}: no space left")
        assert str(info.value).endswith(
            "; iter_0000002.partial removed, a rerun resumes from iter_0000001 once space is freed"
        )
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "iter_0000001"]
        assert latest_complete_checkpoint(disk) == first
