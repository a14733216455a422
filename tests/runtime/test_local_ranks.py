"""Local ranks share this machine's cores instead of each starting a thread per core, and
end with their launcher."""

import contextlib
import os
import re
import signal
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


def _record_pid_and_wait_for_stop(directory: str) -> None:
    """A rank as the trainer is once started: it takes the stop signals (and would stop at
    its next step)."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    _record_pid_and_sleep(directory)


def _killed_on_attempt_0(directory: str) -> None:
    Path(directory, f"attempt{os.environ['MEGATRON_LNS_ATTEMPT']}-rank{os.environ['RANK']}").touch()
    if os.environ["MEGATRON_LNS_ATTEMPT"] == "0" and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)


def _stop_self_after_the_failure(calls=[]) -> int:  # noqa: B006 (counts the calls)
    """The restart policy's look at the checkpoints: the second one comes after the first
    attempt failed, before the next starts; a SIGTERM comes in that moment."""
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return 0


_STOPPABLE_LAUNCHER = """
import sys
from megatron_lns.base.exit_status import exit_status
from megatron_lns.runtime import spawn_local
from megatron_lns.runtime.restarts import RestartPolicy, spawn_with_restarts
import test_local_ranks as t

fn = getattr(t, sys.argv[2])
if sys.argv[3] == "restarts":
    policy = RestartPolicy(3, 3, t._stop_self_after_the_failure)
    launch = lambda: spawn_with_restarts(fn, 2, sys.argv[1], policy=policy)
else:
    launch = lambda: spawn_local(fn, 2, sys.argv[1])
sys.exit(exit_status(launch))
"""


def _stoppable_launcher(directory: Path, fn: str, how: str = "once") -> subprocess.Popen:
    here = Path(__file__).parent
    environment = fresh_launch_env(PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]))
    command = [sys.executable, "-c", _STOPPABLE_LAUNCHER, str(directory), fn, how]
    return subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True)


def _end_watching_descendants(launcher: subprocess.Popen) -> tuple[str, set]:
    """Wait for ``launcher`` to end (at most 300 s: a loaded 2-core CI machine), noting
    every process under it meanwhile; its stderr and those processes."""
    seen: set[psutil.Process] = set()
    deadline = time.monotonic() + 300
    while launcher.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            seen.update(psutil.Process(launcher.pid).children(recursive=True))
        time.sleep(0.02)
    assert launcher.poll() is not None, "the launcher did not end within 300 s"
    # Its stderr ends when every process that shares it (forkserver, ranks) has ended.
    return launcher.communicate(timeout=60)[1], seen


# What a stopped launch says of a rank the stop ended before it could stop at a step.
RANK_KILLED_BY_SIGTERM = r"rank \d was killed by SIGTERM before it could stop at a step"
RERUN = "rerun to resume"


def _stopped(launcher: subprocess.Popen, signum: int, error: str) -> tuple[str, set]:
    """Wait for ``launcher`` to end (``_end_watching_descendants``); assert that it ended by
    itself with 128 + ``signum`` and one ``error:`` line matching ``error`` (torch's import
    warnings aside) and no traceback. Its stderr and the processes seen under it."""
    stderr, seen = _end_watching_descendants(launcher)
    assert launcher.returncode == 128 + signum, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert re.fullmatch(error, lines[0]), lines[0]
    return stderr, seen


def _forkservers(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The launcher's forkserver, once started: not any child (importing torch starts a
    short-lived one, seconds before the launcher takes the stop signals)."""
    found = []
    for child in psutil.Process(launcher.pid).children():
        with contextlib.suppress(psutil.Error):
            if "forkserver" in " ".join(child.cmdline()):
                found.append(child)
    return found


@pytest.mark.slow
def test_a_stop_while_the_ranks_start_ends_the_launch_with_one_line_and_no_process(tmp_path):
    """SIGTERM to the launcher as soon as its forkserver exists (it is starting ranks):
    the launcher takes it, the ranks it started get it, and it ends by itself."""
    with killed_on_exit(_stoppable_launcher(tmp_path, "_record_pid_and_sleep")) as launcher:
        server = []
        wait_while_running(
            launcher, lambda: server.extend(_forkservers(launcher)) or server, 120, "forkserver"
        )
        launcher.send_signal(signal.SIGTERM)
        either = rf"(: {RANK_KILLED_BY_SIGTERM}| before the ranks started)"
        _, seen = _stopped(launcher, signal.SIGTERM, rf"error: stopped by SIGTERM{either}; {RERUN}")
    assert not still_running([*server, *seen])


@pytest.mark.slow
def test_a_second_stop_kills_the_ranks_and_says_so_in_one_line(tmp_path):
    pid_files = [tmp_path / f"rank{rank}" for rank in range(2)]
    with killed_on_exit(_stoppable_launcher(tmp_path, "_record_pid_and_wait_for_stop")) as launcher:
        wait_while_running(
            launcher, lambda: all(f.exists() and f.read_text() for f in pid_files), 120, "ranks"
        )
        ranks = [psutil.Process(int(f.read_text())) for f in pid_files]
        launcher.send_signal(signal.SIGINT)  # forwarded: the ranks would stop at a step
        time.sleep(1)
        assert launcher.poll() is None and not [r for r in ranks if not r.is_running()]
        launcher.send_signal(signal.SIGINT)
        _stopped(
            launcher,
            signal.SIGINT,
            r"error: stopped by SIGINT then SIGINT: rank \d was killed by SIGKILL before it "
            r"could stop at a step \(a second stop kills the ranks\); rerun to resume",
        )
    assert not still_running(ranks)


@pytest.mark.slow
def test_a_stop_between_in_job_attempts_starts_no_further_attempt(tmp_path):
    with killed_on_exit(
        _stoppable_launcher(tmp_path, "_killed_on_attempt_0", "restarts")
    ) as launcher:
        stderr, seen = _stopped(
            launcher,
            signal.SIGTERM,
            r"error: stopped by SIGTERM before the ranks started; rerun to resume",
        )
    (restart,) = [line for line in stderr.splitlines() if line.startswith("in-job restart")]
    assert restart.startswith("in-job restart 1 of 3: rank 1 was killed by SIGKILL at ")
    assert sorted(p.name for p in tmp_path.glob("attempt*")) == ["attempt0-rank0", "attempt0-rank1"]
    assert not still_running(list(seen))


@pytest.mark.slow
def test_a_killed_rank_is_said_killed_by_its_signal(tmp_path, capsys):
    """A rank killed from outside printed nothing: the line names the signal, as the
    in-job restart's line does, and points at no output above."""
    from megatron_lns.base.exit_status import exit_status

    def launch() -> None:
        attempt_0 = {"MEGATRON_LNS_ATTEMPT": "0"}
        spawn_local(_killed_on_attempt_0, 2, str(tmp_path), environment=attempt_0)

    assert exit_status(launch) == 1
    assert capsys.readouterr().err == "error: rank 1 was killed by SIGKILL\n"


def _started_ranks(launcher: subprocess.Popen, directory: Path) -> list[psutil.Process]:
    """The ranks of ``launcher``, once each has recorded its pid in ``directory``."""
    pid_files = [directory / f"rank{rank}" for rank in range(2)]
    wait_while_running(
        launcher, lambda: all(f.exists() and f.read_text() for f in pid_files), 120, "ranks"
    )
    return [psutil.Process(int(f.read_text())) for f in pid_files]


def _await_stopped(launcher: subprocess.Popen, processes: list[psutil.Process]) -> None:
    """Wait until every one of ``processes`` is stopped (state T in /proc/PID/stat)."""
    wait_while_running(
        launcher, lambda: all(p.status() == psutil.STATUS_STOPPED for p in processes), 60, "T"
    )


@contextlib.contextmanager
def _ended_in_the_end(ranks: list[psutil.Process]):
    """Kills ``ranks`` when the block ends: a rank left stopped (a failed test) would never
    take the SIGTERM its launcher's end sends it."""
    try:
        yield
    finally:
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()


@pytest.mark.slow
def test_ctrl_z_stops_the_ranks_with_the_launcher_and_a_kill_of_the_job_ends_them(tmp_path):
    """SIGTSTP to the launcher (a terminal's Ctrl-Z) stops every rank and the launcher;
    a shell's ``kill %1`` of the stopped job (SIGTERM, then SIGCONT) continues the ranks
    and ends them as a stop of a running launch does, leaving no process."""
    with killed_on_exit(_stoppable_launcher(tmp_path, "_record_pid_and_sleep")) as launcher:
        ranks = _started_ranks(launcher, tmp_path)
        with _ended_in_the_end(ranks):
            launcher.send_signal(signal.SIGTSTP)
            _await_stopped(launcher, [psutil.Process(launcher.pid), *ranks])
            launcher.send_signal(signal.SIGTERM)
            launcher.send_signal(signal.SIGCONT)
            said = rf"error: stopped by SIGTERM: {RANK_KILLED_BY_SIGTERM}; {RERUN}"
            _, seen = _stopped(launcher, signal.SIGTERM, said)
            assert not still_running([*ranks, *seen])


@pytest.mark.slow
def test_the_ranks_of_a_launcher_killed_while_stopped_stop(tmp_path):
    """A launcher SIGKILLed while Ctrl-Z holds the run stopped cannot continue its ranks,
    and stopped ranks take no SIGTERM from its end: they must still end."""
    with killed_on_exit(_stoppable_launcher(tmp_path, "_record_pid_and_sleep")) as launcher:
        ranks = _started_ranks(launcher, tmp_path)
        with _ended_in_the_end(ranks):
            launcher.send_signal(signal.SIGTSTP)
            _await_stopped(launcher, ranks)
            launcher.kill()
            assert not still_running(ranks, within_s=30)


@pytest.mark.slow
def test_a_stop_reaches_ranks_stopped_from_outside(tmp_path):
    """Ranks stopped by someone else (kill -STOP of their groups) take a stop request
    only once continued: the launcher continues them after forwarding it, so the launch
    ends by itself instead of waiting for them."""
    with killed_on_exit(_stoppable_launcher(tmp_path, "_record_pid_and_sleep")) as launcher:
        ranks = _started_ranks(launcher, tmp_path)
        with _ended_in_the_end(ranks):
            for rank in ranks:
                os.killpg(rank.pid, signal.SIGSTOP)
            _await_stopped(launcher, ranks)
            launcher.send_signal(signal.SIGTERM)
            _stopped(
                launcher,
                signal.SIGTERM,
                r"error: stopped by SIGTERM: rank \d was killed by SIGTERM before it could "
                r"stop at a step; rerun to resume",
            )
            assert not still_running(ranks)
