"""End-to-end training from YAML: parallel layouts, exact resume, resharded resume,
and a job killed in the middle of a checkpoint save."""

import json
import math
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import DEMO_CONFIG as DEMO
from helpers import (
    ROOT,
    TINY_RUN_OVERRIDES,
    fresh_launch_env,
    tiny_run_config,
    train_on_its_ranks,
)

from megatron_lns.training.checkpoint import latest_complete_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_corpus_cache")]


def _run(tmp_path, cfg):
    return train_on_its_ranks(tmp_path, cfg)[0]


@pytest.mark.parametrize(
    "layout",
    [
        ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
        ["model.pipeline_model_parallel_size=2", "model.data.num_workers=1"],
        ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
    ],
    ids=["tp2_sp", "pp2_with_loader_workers", "pp2_vp2"],
)
def test_training_from_yaml_at_parallel_layouts(tmp_path, layout):
    cfg = tiny_run_config(tmp_path, "trainer.devices=2", *layout)
    result = _run(tmp_path, cfg)
    losses = [loss for _, loss in result["losses"]]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert math.isfinite(result["valid"])
    run_dir = tmp_path / "lns"
    assert latest_complete_checkpoint(run_dir / "checkpoints").name == "iter_0000006"
    assert (run_dir / "checkpoints" / "iter_0000003" / "config.yaml").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    full_rows = [r for r in logged if "lr" in r]
    assert {"loss", "ppl", "lr", "grad_norm", "tokens_per_s", "tflops_per_device"} <= full_rows[
        0
    ].keys()
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, 7))  # every step
    assert any("val_ppl" in r for r in logged)
    assert (run_dir / "config.yaml").is_file()


def test_resume_continues_the_loss_curve_exactly(tmp_path, straight_tiny_run):
    straight = straight_tiny_run
    first = _run(tmp_path, tiny_run_config(tmp_path / "resumed", "trainer.exit_interval=3"))
    assert [s for s, _ in first["losses"]] == [1, 2, 3]
    second = _run(tmp_path, tiny_run_config(tmp_path / "resumed"))
    assert second["resumed_from"] == 3
    assert first["losses"] + second["losses"] == straight["losses"]  # bitwise on CPU
    assert second["valid"] == straight["valid"]


@pytest.mark.parametrize(
    "layout",
    [["model.tensor_model_parallel_size=2"], ["model.pipeline_model_parallel_size=2"]],
    ids=["tp1_to_tp2", "pp1_to_pp2"],
)
def test_resume_at_a_different_parallel_layout(tmp_path, layout, straight_tiny_run):
    straight = straight_tiny_run
    _run(tmp_path, tiny_run_config(tmp_path / "resharded", "trainer.exit_interval=3"))
    resumed = _run(tmp_path, tiny_run_config(tmp_path / "resharded", "trainer.devices=2", *layout))
    assert resumed["resumed_from"] == 3
    expected = dict(straight["losses"])
    for step, loss in resumed["losses"]:
        assert loss == pytest.approx(expected[step], rel=1e-4), step


KILL_DURING_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def save_then_hang(state_dict, directory, *args, **kwargs):
        result = real_save(state_dict, directory, *args, **kwargs)
        if Path(directory).name == "iter_0000004.partial":
            Path(sys.argv[1]).write_text("in save")
            time.sleep(600)
        return result

    dist_checkpointing.save = save_then_hang
    from megatron_lns.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.long
def test_job_killed_during_checkpoint_save_resumes_from_previous_complete(tmp_path):
    overrides = [
        *TINY_RUN_OVERRIDES,
        "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
    ]
    env = fresh_launch_env()
    marker = tmp_path / "marker"
    args = ["train", str(DEMO), *overrides, f"exp_manager.exp_dir={tmp_path}"]
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_DURING_SAVE, str(marker), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, "training exited before reaching the save"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    checkpoints = tmp_path / "lns" / "checkpoints"
    assert (checkpoints / "iter_0000004.partial").is_dir()
    assert not (checkpoints / "iter_0000004").exists()
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000002"

    resumed = _run(
        tmp_path,
        tiny_run_config(tmp_path, "exp_manager.checkpoint_callback_params.every_n_train_steps=2"),
    )
    assert resumed["resumed_from"] == 2
    straight = _run(
        tmp_path,
        tiny_run_config(
            tmp_path / "straight", "exp_manager.checkpoint_callback_params.every_n_train_steps=2"
        ),
    )
    assert resumed["losses"] == straight["losses"][2:]
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000006"
    assert not (
        checkpoints / "iter_0000004.partial"
    ).exists()  # cleaned when step 4 was saved again
