"""In-job restarts of local ranks (runtime/restarts.py): which failures restart, how often,
and what is left of an attempt; the policy on a stand-in launch, the processes for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_lns.base.errors import HUNG_EXIT_CODE, USER_ERROR_EXIT_CODE, RankFailed
from megatron_lns.runtime import restarts
from megatron_lns.runtime.restarts import RestartPolicy, RestartsEnded, spawn_with_restarts


class _Launches:
    """Stands in for spawn_local: each launch ends as the next outcome says (an exit code
    for rank 1, or None: success), committing checkpoints of the steps ``progress`` gives."""

    def __init__(self, outcomes, progress=None, stop_signal=False):
        self.outcomes, self.progress = list(outcomes), list(progress or [])
        self.stop_signal = stop_signal
        self.newest = 0
        self.calls = []

    def __call__(self, fn, world_size, *args, environment, stop_signals):
        self.calls.append((args, environment))
        if self.progress:
            self.newest = self.progress.pop(0)
        code = self.outcomes.pop(0)
        if code is not None:
            if self.stop_signal:
                stop_signals.append(signal.SIGTERM)
            raise RankFailed(1, code)


def _run(monkeypatch, launches, max_restarts=3, without_progress=2):
    monkeypatch.setattr(restarts, "spawn_local", launches)
    policy = RestartPolicy(max_restarts, without_progress, lambda: launches.newest)
    spawn_with_restarts(print, 2, "first", policy=policy, restart_args=("again",))


def test_a_killed_rank_restarts_every_rank_with_the_attempt_and_the_resume_args(
    monkeypatch, capsys
):
    launches = _Launches([-signal.SIGKILL, HUNG_EXIT_CODE, None], progress=[2, 4, 6])
    _run(monkeypatch, launches)
    assert launches.calls == [
        (("first",), {"MEGATRON_LNS_ATTEMPT": "0"}),
        (("again",), {"MEGATRON_LNS_ATTEMPT": "1"}),
        (("again",), {"MEGATRON_LNS_ATTEMPT": "2"}),
    ]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("in-job restart 1 of 3: rank 1 was killed by SIGKILL at ")
    assert lines[0].endswith("; every rank restarts (attempt 1) from the checkpoint of step 2")
    assert "rank 1 found the run hung (exit code 75)" in lines[1]


@pytest.mark.parametrize(
    "code", [0, USER_ERROR_EXIT_CODE, -signal.SIGTERM, 130], ids=["ok", "user", "term", "int"]
)
def test_what_a_restart_would_repeat_or_the_user_asked_for_is_not_restarted(monkeypatch, code):
    launches = _Launches([code])
    with pytest.raises(RankFailed) as raised:
        _run(monkeypatch, launches)
    assert type(raised.value) is RankFailed and len(launches.calls) == 1


def test_a_failure_after_the_users_stop_signal_is_not_restarted(monkeypatch):
    launches = _Launches([-signal.SIGKILL], stop_signal=True)  # the second Ctrl-C kills
    with pytest.raises(RankFailed):
        _run(monkeypatch, launches)
    assert len(launches.calls) == 1


def test_restarts_that_commit_nothing_new_end_the_run_with_that_cause(monkeypatch, capsys):
    # The first attempt commits step 2; both restarts fail before committing another.
    launches = _Launches([-signal.SIGKILL] * 3, progress=[2, 2, 2])
    with pytest.raises(RestartsEnded) as raised:
        _run(monkeypatch, launches)
    assert len(launches.calls) == 3
    assert str(raised.value) == (
        "rank 1 was killed by SIGKILL; the last 2 in-job restart(s) committed no checkpoint "
        "newer than the one of step 2 (exp_manager.fault_tolerance."
        "max_restarts_without_progress=2): the failure recurs; stopping"
    )
    assert raised.value.explained and raised.value.exit_code == -signal.SIGKILL


def test_restarts_used_up_without_progress_name_the_recurring_failure(monkeypatch):
    """Both limits hit by the same failure: the cause named is the one the batch script
    names (slurm/sbatch.template), that the failure recurs."""
    launches = _Launches([-signal.SIGKILL] * 3, progress=[2, 2, 2])
    with pytest.raises(RestartsEnded) as raised:
        _run(monkeypatch, launches, max_restarts=2, without_progress=2)
    assert len(launches.calls) == 3
    assert "max_restarts_without_progress=2): the failure recurs" in str(raised.value)


def test_restarts_that_progress_go_on_until_they_are_used_up(monkeypatch):
    launches = _Launches([HUNG_EXIT_CODE] * 4, progress=[2, 4, 6, 8])
    with pytest.raises(RestartsEnded) as raised:
        _run(monkeypatch, launches, max_restarts=3, without_progress=1)
    assert len(launches.calls) == 4
    assert str(raised.value) == (
        "rank 1 found the run hung (exit code 75); restarted 3 time(s) in-job "
        "(exp_manager.fault_tolerance.max_rank_restarts=3); a rerun resumes from the "
        "checkpoint of step 8"
    )


def _die_once_leaving_a_child(directory: str) -> None:
    """Rank 1 of the first attempt starts a process in its group, then is SIGKILLed;
    every rank records its attempt and rendezvous port."""
    rank, attempt = os.environ["RANK"], os.environ["MEGATRON_LNS_ATTEMPT"]
    Path(directory, f"attempt{attempt}-rank{rank}").write_text(os.environ["MASTER_PORT"])
    if (rank, attempt) == ("1", "0"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(directory, "child").write_text(str(child.pid))
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_rank_leaves_no_process_and_the_restart_a_new_rendezvous(tmp_path, capsys):
    policy = RestartPolicy(1, 1, lambda: 0)
    start = time.monotonic()
    spawn_with_restarts(_die_once_leaving_a_child, 2, str(tmp_path), policy=policy)
    assert time.monotonic() - start < 300
    ports = {p.name: p.read_text() for p in tmp_path.glob("attempt*")}
    assert sorted(ports) == ["attempt0-rank0", "attempt0-rank1", "attempt1-rank0", "attempt1-rank1"]
    assert ports["attempt0-rank0"] != ports["attempt1-rank0"]
    assert _ends(int((tmp_path / "child").read_text()), within_s=10)
    assert "in-job restart 1 of 1: rank 1 was killed by SIGKILL" in capsys.readouterr().err


def _ends(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie: killed, not yet reaped by init)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
