"""Local ranks share this machine's cores instead of each starting a thread per core, and
end with their launcher."""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import fresh_launch_env, killed_on_exit, still_running, wait_while_running

from megatron_lns.runtime import spawn_local
from megatron_lns.runtime.local_ranks import _share_cpu_threads


def _record_threads(directory: str) -> None:
    Path(directory, f"rank{os.environ['RANK']}").write_text(str(torch.get_num_threads()))


@pytest.mark.slow
def test_local_ranks_split_the_intra_op_threads(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    fresh = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    all_cores = int(subprocess.run(fresh, capture_output=True, text=True, check=True).stdout)
    spawn_local(_record_threads, 2, str(tmp_path), timeout_s=300)
    threads = [int((tmp_path / f"rank{rank}").read_text()) for rank in range(2)]
    assert threads == [max(1, all_cores // 2)] * 2


def test_an_explicit_thread_count_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    _share_cpu_threads(world_size=4)
    assert torch.get_num_threads() == before


def _record_pid_and_sleep(directory: str) -> None:
    Path(directory, f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(600)


_LAUNCHER = """
import sys
from megatron_lns.runtime import spawn_local
from test_local_ranks import _record_pid_and_sleep
spawn_local(_record_pid_and_sleep, 2, sys.argv[1])
"""


@pytest.mark.slow
def test_the_ranks_of_a_sigkilled_launcher_stop(tmp_path):
    """A launcher killed outright runs no cleanup; its ranks, children of the forkserver
    (which outlives it), must still stop instead of training on alone."""
    here = Path(__file__).parent  # this module, and the helpers it imports
    environment = fresh_launch_env(PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]))
    command = [sys.executable, "-c", _LAUNCHER, str(tmp_path)]
    pid_files = [tmp_path / f"rank{rank}" for rank in range(2)]
    ranks = []
    try:
        with killed_on_exit(
            subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True)
        ) as launcher:
            wait_while_running(
                launcher,
                lambda: all(f.exists() and f.read_text() for f in pid_files),
                120,
                "ranks started",
            )
            ranks = [psutil.Process(int(f.read_text())) for f in pid_files]
        assert not still_running(ranks, within_s=30)
    finally:
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
