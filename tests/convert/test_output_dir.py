"""OUT_DIR of export-hf, import-hf and analyze: written as a hidden sibling and renamed
into place (convert/output.py), so it must have a name and a place beside it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import cli_error_of

from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.output import staged_output_dir


@pytest.mark.parametrize(
    ("out_dir", "what"),
    [
        (".", "the current directory"),
        ("sub/..", "the current directory"),
        ("..", "a parent of the current directory"),
    ],
)
def test_the_current_directory_or_one_above_it_is_refused(tmp_path, monkeypatch, out_dir, what):
    """'export-hf RUN .' ended in a ValueError traceback ('.' has no name to make the
    staging sibling's from); replacing it would leave the shell in a deleted directory."""
    (tmp_path / "here" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    with (
        pytest.raises(ConversionError, match=rf"^output directory {out_dir} is {what}, which"),
        staged_output_dir(out_dir, overwrite=True),
    ):
        pass
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["here", "sub"]


def test_a_path_through_dot_dot_is_written_where_it_leads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    with staged_output_dir("sub/../out") as stage:
        (stage / "file").write_text("x")
    assert (tmp_path / "out" / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sub"]


def test_analyze_refuses_its_out_before_the_analysis(tmp_path, monkeypatch, capsys):
    """'analyze RUN --out .' crashed only once the whole analysis had run: the output is
    now checked first (here before the missing run is even looked for)."""
    monkeypatch.chdir(tmp_path)
    assert cli_error_of(capsys, "analyze", "no-such-run", "--out", ".") == (
        "error: output directory . is the current directory, which the output would "
        "replace: name a directory to write (e.g. out)"
    )


def test_sigterm_midway_removes_the_staging_directory(tmp_path):
    """export-hf stopped by SIGTERM (kill, timeout, scancel) died at once and left its
    .OUT.partial-PID, which no later run removes; it now ends as on Ctrl-C, cleaned up,
    with the status a TERM gives (143)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as stopped, staged_output_dir(tmp_path / "out") as stage:
            (stage / "half-written.safetensors").write_bytes(b"x" * 100)
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL, "TERM would kill"
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises in here
        assert stopped.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(tmp_path.iterdir()) == []


def test_a_sigkilled_conversions_staging_directory_is_removed_by_the_next(tmp_path):
    """SIGKILL cannot be caught: the killed export left .OUT.partial-PID for good. The
    next conversion into OUT on that host now removes it, and leaves alone what a live
    process or another host's process may still be writing."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from megatron_lns.convert.output import staged_output_dir\n"
            "with staged_output_dir(sys.argv[1]) as stage:\n"
            "    (stage / 'half.safetensors').write_bytes(b'x')\n"
            "    print(stage.name, flush=True)\n"
            "    time.sleep(600)\n",
            str(tmp_path / "out"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    killed = child.stdout.readline().strip()
    child.kill()
    child.wait()
    host = socket.gethostname()
    assert killed == f".out.partial-{host}-{child.pid}"
    live = f".out.partial-{host}-{os.getppid()}"  # this test's parent: running
    other_host = f".out.partial-elsewhere-{child.pid}"
    for name in (live, other_host):
        (tmp_path / name).mkdir()
    with staged_output_dir(tmp_path / "out") as stage:
        (stage / "model.safetensors").write_bytes(b"y")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live, other_host])
