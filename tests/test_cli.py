"""The command line as a Unix tool: output into a pipe whose reader has gone."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`submit ... --dry-run | head -1`: the reader leaves after one line; Python ignores
    SIGPIPE, so the write raises BrokenPipeError, which must not become a traceback."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes
    try:
        result = subprocess.run(
            [sys.executable, "-m", "megatron_lns.cli", "submit", str(DEMO), "--dry-run"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            env=env,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141  # 128 + SIGPIPE, as a shell reports `cat big | head`
