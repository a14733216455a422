"""Local ranks share this machine's cores instead of each starting a thread per core."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
