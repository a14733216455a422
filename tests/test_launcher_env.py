"""The launcher's variables: a partial or inconsistent set is refused in one line before
any process group exists, and the launches that set them properly still start."""

import os
import subprocess
import sys

import pytest
from helpers import DEMO_CONFIG, ROOT, TINY_RUN_OVERRIDES, fresh_launch_env

from megatron_lns.runtime.launcher_env import LauncherEnvironmentError, launcher_environment

FULL = {"LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env, world",
    [
        ({}, None),  # megatron-lns starts the ranks itself
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, None),  # exported, harmless
        ({"RANK": "0", "WORLD_SIZE": "1"}, 1),  # a world of one picks its own port
        ({"RANK": "1", "WORLD_SIZE": "2", **FULL, "LOCAL_RANK": "1"}, 2),  # torchrun, srun
        ({"RANK": "3", "WORLD_SIZE": "4", **FULL, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 4),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, None),  # batch step
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, None),  # srun of one task
    ],
)
def test_launches_that_are_accepted(env, world):
    launch = launcher_environment(env)
    assert (launch.world_size if launch else None) == world


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0"}, "RANK='0' is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' is set but RANK is not"),
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK='1' is set but RANK and WORLD_SIZE are not"),
        ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not an"),
        ({"RANK": "x", "WORLD_SIZE": "1"}, "RANK='x' in the environment is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", **FULL}, "RANK must be in 0..WORLD_SIZE-1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", **FULL, "LOCAL_RANK": "1"}, "LOCAL_RANK must be in"),
        (
            {"RANK": "1", "WORLD_SIZE": "2", **FULL, "LOCAL_WORLD_SIZE": "3"},
            "LOCAL_WORLD_SIZE must be in 1..WORLD_SIZE",
        ),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT must be in"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "also needs LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        (
            {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"},
            "task SLURM_PROCID=1 of SLURM_STEP_NUM_TASKS=2 srun tasks, but RANK",
        ),
    ],
)
def test_partial_or_inconsistent_launches_are_refused_naming_the_variables(env, message):
    with pytest.raises(LauncherEnvironmentError) as err:
        launcher_environment(env)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def _train(tmp_path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_lns.cli",
            "train",
            str(DEMO_CONFIG),
            *TINY_RUN_OVERRIDES,
            f"exp_manager.exp_dir={tmp_path}",
            *overrides,
        ],
        cwd=ROOT,
        env=fresh_launch_env(MEGATRON_LNS_CACHE=os.environ["MEGATRON_LNS_CACHE"], **env),
        capture_output=True,
        text=True,
        timeout=180,  # before the fix, the first case waited 30 minutes
    )


@pytest.mark.parametrize(
    "env, devices, message",
    [
        (
            {"RANK": "0", "WORLD_SIZE": "2"},
            2,
            "error: RANK='0' WORLD_SIZE='2': a world of 2 ranks also needs LOCAL_RANK, "
            "MASTER_ADDR, MASTER_PORT",
        ),
        ({"RANK": "0"}, 2, "error: RANK='0' is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "abc"}, 1, "error: WORLD_SIZE='abc' in the environment is not an"),
        (
            {"RANK": "0", "WORLD_SIZE": "1"},
            2,
            "error: WORLD_SIZE=1 from the launcher (RANK=0 WORLD_SIZE=1",
        ),
    ],
    ids=["rank-and-world-without-address", "rank-alone", "world-not-a-number", "world-of-one"],
)
@pytest.mark.usefixtures("private_corpus_cache")
def test_train_refuses_a_stale_launcher_environment_in_one_line(tmp_path, env, devices, message):
    """The issue's examples: a wait of 30 minutes, one process trained without a word, a
    traceback."""
    done = _train(tmp_path, env, f"trainer.devices={devices}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message), done.stderr
    assert done.stderr.count("\n") == 1 and "unset RANK WORLD_SIZE" in done.stderr
    assert not (tmp_path / "lns").exists()  # nothing trained


def test_a_rank_of_an_external_launch_destroys_its_process_groups_on_every_exit():
    """srun's and torchrun's ranks run the job in-process: the process groups must be
    gone before the interpreter tears down, after a success and after an error (a group
    alive then can end the rank in std::terminate, which fails a finished SLURM job)."""
    script = (
        "import torch.distributed as dist\n"
        "from megatron_lns.runtime import ParallelLayout, init_distributed, run_job\n"
        "def job(fail):\n"
        "    init_distributed(ParallelLayout(), device='cpu')\n"
        "    if fail:\n"
        "        raise RuntimeError('boom')\n"
        "run_job(job, 1, 1, False, multi_node_hint='')\n"
        "print('after success:', dist.is_initialized())\n"
        "try:\n"
        "    run_job(job, 1, 1, True, multi_node_hint='')\n"
        "except RuntimeError:\n"
        "    print('after error:', dist.is_initialized())\n"
    )
    from megatron_lns.runtime.distributed import free_port

    launch = {**FULL, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port())}
    env = fresh_launch_env(**launch, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["after success: False", "after error: False"]
