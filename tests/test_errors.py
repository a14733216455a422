"""Which rank of a launch prints a user error: the first, once, and what that leaves."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers import ROOT, fresh_launch_env

from megatron_lns.base.errors import MARKER_PREFIX

# A rank of an external launch (torchrun, srun) that reports a user error.
REPORTING_RANK = """
from megatron_lns.base.errors import UserError, report_user_error_once
report_user_error_once(UserError("the same mistake on every rank"))
"""


def _ranks_of_one_launch(tmp_path: Path, port: str) -> list[str]:
    """Two ranks, started by one parent (this shell), report the same error in turn."""
    env = fresh_launch_env(
        PYTHONPATH=str(ROOT), WORLD_SIZE="2", MASTER_PORT=port, TMPDIR=str(tmp_path)
    )
    rank = f"{sys.executable} -c '{REPORTING_RANK}'"
    done = subprocess.run(
        ["sh", "-c", f"RANK=0 {rank}; RANK=1 {rank}"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stderr.splitlines()


def test_one_launch_reports_once_and_a_later_launch_removes_its_marker(tmp_path):
    assert tempfile.gettempdir() != str(tmp_path)
    first = _ranks_of_one_launch(tmp_path, "29500")
    assert first == ["error: the same mistake on every rank"]
    [marker] = tmp_path.glob(f"{MARKER_PREFIX}*")
    # A later launch on the same port reports its own error (a parent given the same pid
    # would have started later), and the ended launch's marker goes.
    second = _ranks_of_one_launch(tmp_path, "29500")
    assert second == ["error: the same mistake on every rank"]
    assert not marker.exists()
    assert len(list(tmp_path.glob(f"{MARKER_PREFIX}*"))) == 1


def test_a_marker_of_a_live_parent_is_kept(tmp_path):
    live = tmp_path / f"{MARKER_PREFIX}{os.getpid()}-{_own_start_time()}-1234"
    live.touch()
    _ranks_of_one_launch(tmp_path, "29501")
    assert live.exists()


def _own_start_time() -> str:
    return Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
