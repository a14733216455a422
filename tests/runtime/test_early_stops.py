"""A stop sent while ``train`` still starts (imports, building the run) is acted on once
the launcher or the trainer takes over, not lost and not a silent death."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import (
    DEMO_CONFIG,
    ROOT,
    TINY_RUN_OVERRIDES,
    fresh_launch_env,
    killed_on_exit,
    still_running,
    wait_while_running,
)

from megatron_lns.runtime.early_stops import early_stops_recorded, take_early_stops
from megatron_lns.training.stop_request import StopRequest


def test_a_stop_recorded_early_is_taken_by_the_stop_request():
    with early_stops_recorded():
        signal.raise_signal(signal.SIGUSR1)  # its default action would end this process
        request = StopRequest([signal.SIGUSR1])
        request.restore()
        assert request.requested
        assert take_early_stops() == []  # taken once


def test_a_stop_nothing_took_is_raised_again_once_the_command_is_done():
    script = (
        "import signal\n"
        "from megatron_lns.runtime.early_stops import early_stops_recorded\n"
        "with early_stops_recorded():\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "    print('went on', flush=True)\n"
        "print('not reached', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (-signal.SIGTERM, "went on\n"), done.stderr


def _importing_torch(pid: int) -> bool:
    """Whether process ``pid`` has begun to load torch (its library is mapped): the window
    in which a stop used to be lost, long before the launcher or trainer takes signals."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _train(tmp_path, *overrides):
    command = [sys.executable, "-m", "megatron_lns.cli", "train", str(DEMO_CONFIG)]
    command += [*TINY_RUN_OVERRIDES, *overrides, f"exp_manager.exp_dir={tmp_path}"]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=fresh_launch_env(MEGATRON_LNS_CACHE=os.environ["MEGATRON_LNS_CACHE"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_stop_while_a_local_launch_starts_starts_no_rank(tmp_path, private_corpus_cache):
    """SIGTERM while torch imports: the launcher started its ranks regardless of it
    (SIGINT) or died of it without a line (SIGTERM)."""
    with killed_on_exit(_train(tmp_path, "trainer.devices=2")) as launcher:
        wait_while_running(launcher, lambda: _importing_torch(launcher.pid), 60, "torch import")
        launcher.send_signal(signal.SIGTERM)
        seen = set()
        while launcher.poll() is None:  # every process it starts, to check none outlives it
            with contextlib.suppress(psutil.Error, subprocess.TimeoutExpired):
                seen.update(psutil.Process(launcher.pid).children(recursive=True))
                launcher.wait(timeout=0.05)
        _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert errors == ["error: stopped by SIGTERM before the ranks started; rerun to resume"], err
    assert "Traceback" not in err
    assert not still_running(list(seen))
    assert not (tmp_path / "lns" / "checkpoints").exists() or not any(
        (tmp_path / "lns" / "checkpoints").iterdir()
    )


@pytest.mark.slow
def test_a_stop_while_a_one_rank_run_starts_stops_it_at_its_first_step(
    tmp_path, private_corpus_cache
):
    with killed_on_exit(_train(tmp_path)) as run:
        wait_while_running(run, lambda: _importing_torch(run.pid), 60, "torch import")
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-2000:]
    assert "stopping at step 1 (checkpoint saved; rerun to resume)" in out, out[-2000:]
