"""Hang detection: stalled ranks named in one line, their stacks logged, the attempt ended
with HUNG_EXIT_CODE and no process left; a healthy run with slow first steps untouched."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from helpers import DEMO_CONFIG as DEMO
from helpers import ROOT, TINY_RUN_OVERRIDES, fresh_launch_env, logged_losses, still_running

from megatron_lns.base.errors import HUNG_EXIT_CODE
from megatron_lns.runtime.progress_file import read_events
from megatron_lns.training.checkpoint import latest_complete_checkpoint
from megatron_lns.training.hang_watchdog import (
    HangWatch,
    HangWatchdog,
    Heartbeat,
    StoreUnanswered,
    WatchdogStore,
    hang_line,
    stalled_ranks,
)
from megatron_lns.training.phase_timeouts import PhaseClock, Timeout, TimeoutSettings
from megatron_lns.training.run_report import run_report

HOST = socket.gethostname()


def _beat(rank, seq, step=5, where="torch/distributed/distributed_c10d.py:3913 all_reduce"):
    where = where.replace("/", os.sep)
    return Heartbeat(rank, "h", 100 + rank, seq, "step", step, 1.0, where)


def test_a_rank_whose_heartbeat_stopped_is_the_stalled_one():
    first = {0: _beat(0, 7), 1: _beat(1, 3)}
    second = {0: _beat(0, 9), 1: _beat(1, 3)}
    stalled = stalled_ranks(first, second, world_size=3)
    assert [(s.rank, s.how) for s in stalled] == [
        (1, "stopped responding"), (2, "never reported"),
    ]  # fmt: skip
    me = _beat(0, 9, step=6)
    line = hang_line(stalled[:1], me, Timeout(30, "5 x slowest step 2.10 s, min_timeout 30"))
    assert line == (
        "hang: rank 1 (host h, pid 101) stopped responding (last heartbeat in step 5); "
        "rank 0 waited in step 6 for 1.0 s, timeout 30 s (5 x slowest step 2.10 s, "
        "min_timeout 30)"
    )


def test_with_every_rank_alive_the_one_outside_a_collective_or_behind_is_named():
    before = {0: _beat(0, 1), 1: _beat(1, 1)}
    stuck = {0: _beat(0, 2), 1: _beat(1, 2, where="/x/checkpoint_io.py:40 write")}
    assert [(s.rank, s.how) for s in stalled_ranks(before, stuck, 2)] == [
        (1, "is stuck at /x/checkpoint_io.py:40 write")
    ]
    # A rank stuck outside a collective is named beside one whose heartbeat did not move
    # (which may only have been starved of CPU for a moment).
    starved = {0: _beat(0, 1), 1: _beat(1, 2, where="/x/fault_injection.py:109 inject_fault")}
    assert [(s.rank, s.how) for s in stalled_ranks(before, starved, 2)] == [
        (0, "stopped responding"), (1, "is stuck at /x/fault_injection.py:109 inject_fault"),
    ]  # fmt: skip
    waiting = where = "/m/megatron/core/pipeline_parallel/p2p_communication.py:80 _communicate"
    pipeline = {0: _beat(0, 2, where=waiting), 1: _beat(1, 2, where=where)}
    assert stalled_ranks(before, pipeline, 2)[0].how == "waits in a collective"
    behind = {0: _beat(0, 2, step=9), 1: _beat(1, 2, step=8)}
    assert [(s.rank, s.how) for s in stalled_ranks(before, behind, 2)] == [
        (1, "is behind the others")
    ]


def test_a_single_rank_stuck_past_its_timeout_ends_with_its_stacks(capfd):
    clock = [0.0]
    phases = PhaseClock(TimeoutSettings(rank_heartbeat_timeout=10), lambda: clock[0])
    phases.begin("step", 4)
    exits = []
    watchdog = HangWatchdog(phases, 0, 1, 0.1, None, exit_process=exits.append)

    def check_from_the_watchdogs_thread():
        thread = threading.Thread(target=watchdog.check)
        thread.start()
        thread.join()  # the main thread: stuck here

    check_from_the_watchdogs_thread()
    assert exits == []
    clock[0] = 11.0
    check_from_the_watchdogs_thread()
    assert exits == [HUNG_EXIT_CODE]
    err = capfd.readouterr().err
    assert err.startswith(f"hang: rank 0 (host {HOST}, pid {os.getpid()}) is stuck at "), err
    assert re.match(r"hang: [^\n]* is stuck at \S*threading.py:\d+ wait", err), err
    assert "waited in step 4 for 11.0 s, timeout 10 s (rank_heartbeat_timeout)" in err
    assert "test_a_single_rank_stuck_past_its_timeout_ends_with_its_stacks" in err  # stacks


@pytest.mark.slow
def test_a_stopped_store_is_a_verdict_not_a_stuck_watchdog():
    """torch's own client waits for ever on a stopped server."""
    server = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, datetime, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, None, True, datetime.timedelta(seconds=30),"
            " wait_for_workers=False)\n"
            "print(s.port, flush=True)\nsys.stdin.read()"  # until killed, or the test ends
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        store = WatchdogStore("127.0.0.1", int(server.stdout.readline()), timeout_s=1.0)
        store.call("set", "k", "v")
        assert store.get_if_set("k") == "v" and store.get_if_set("other") is None
        os.kill(server.pid, signal.SIGSTOP)
        # The stop takes hold as the server's threads are next scheduled: on a busy machine
        # its store thread may answer a call first. Wait until the kernel reports it stopped.
        assert os.WIFSTOPPED(os.waitpid(server.pid, os.WUNTRACED)[1])
        start = time.monotonic()
        with pytest.raises(StoreUnanswered, match="no answer in 1 s"):
            store.get_if_set("k")
        assert time.monotonic() - start < 5
        os.kill(server.pid, signal.SIGCONT)  # a store that answers again is used again
        assert store.get_if_set("k") == "v" and store.lost is None
    finally:
        server.kill()
        server.wait()


# -- local two-rank runs


def _overrides(exp_dir, *more, restarts=0):
    return [
        *TINY_RUN_OVERRIDES, "trainer.devices=2", f"exp_manager.exp_dir={exp_dir}",
        f"exp_manager.fault_tolerance.max_rank_restarts={restarts}",  # 0: the attempt ends
        "exp_manager.fault_tolerance.workload_check_interval=0.25", *more,
    ]  # fmt: skip


class _Run:
    """``megatron-lns train`` with a fault injected; its output lines with their times, and
    every process it started."""

    def __init__(self, fault, *overrides, session=False):
        env = fresh_launch_env(MEGATRON_LNS_CACHE=os.environ["MEGATRON_LNS_CACHE"])
        if fault:
            env["MEGATRON_LNS_INJECT_FAULT"] = fault
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megatron_lns.cli", "train", str(DEMO), *overrides],
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=session,  # True: a process group of its own, as in a terminal
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.seen: set[psutil.Process] = set()
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout=600):
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            assert time.monotonic() < deadline, self.text
            with contextlib.suppress(psutil.Error):  # it has just ended
                self.seen.update(psutil.Process(self.process.pid).children(recursive=True))
            time.sleep(0.2)
        self._reader.join()
        return self.process.returncode

    @property
    def text(self):
        return "\n".join(line for _, line in self.lines)

    def at(self, pattern):
        """When the first line matching ``pattern`` came, and the line."""
        return next((t, line) for t, line in self.lines if re.search(pattern, line))

    def left_behind(self):
        return still_running(list(self.seen))

    def await_line(self, pattern, timeout=300):
        """The first line matching ``pattern``, waited for."""
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for _, line in self.lines):
            assert self.process.poll() is None and time.monotonic() < deadline, self.text
            time.sleep(0.05)
        return self.at(pattern)[1]

    def signal_every_process_group(self, signum):
        """``kill -SIGNUM -- -PGID`` for the launcher's process group and each rank's."""
        launcher = psutil.Process(self.process.pid)
        processes = [launcher, *launcher.children(recursive=True)]
        self.seen.update(processes[1:])
        for group in dict.fromkeys(os.getpgid(p.pid) for p in processes):
            assert group != os.getpgid(0)  # never the test's own
            os.killpg(group, signum)


def _detected_in_time(run):
    """Seconds from the injected stop to the hang line; asserts they are within twice the
    timeout the line names. (The stopped rank's last heartbeat may be a phase before the
    one it stopped in: it beats every workload_check_interval.)"""
    stopped_at, _ = run.at(r"^fault injection: stop on rank 1")
    found_at, line = run.at(r"^hang: ")
    timeout = float(re.search(r"timeout ([\d.]+) s", line).group(1))
    assert re.search(
        rf"^hang: rank 1 \(host {HOST}, pid \d+\) stopped responding \(last heartbeat in "
        rf"\w+ \d+\); rank 0 waited in \w+ \d+ for [\d.]+ s, timeout ", line
    ), line  # fmt: skip
    assert found_at - stopped_at <= 2 * timeout, (found_at - stopped_at, line)
    return found_at - stopped_at


def _ended_by_the_watchdog(tmp_path, fault: str, max_steps: int, timeout_key: str) -> _Run:
    """A two-rank run of ``max_steps`` with ``fault`` injected, ``timeout_key`` (of
    exp_manager.fault_tolerance) and the floor of learnt timeouts at 4 s and no restart,
    waited for: it must fail, its hang found in time (how soon is printed)."""
    run = _Run(
        fault,
        *_overrides(tmp_path, f"trainer.max_steps={max_steps}",
                    f"exp_manager.fault_tolerance.{timeout_key}=4",
                    "exp_manager.fault_tolerance.min_timeout=4"),
    )  # fmt: skip
    assert run.wait() != 0
    seconds = _detected_in_time(run)
    print(f"detected {seconds:.1f} s after the stop: {run.at('^hang: ')[1]}")
    return run


@pytest.mark.long
@pytest.mark.usefixtures("private_corpus_cache")
def test_a_rank_stopped_mid_step_is_named_with_its_stack_and_the_attempt_ends(tmp_path):
    run = _ended_by_the_watchdog(tmp_path, "kind=stop,rank=1,step=7", 40, "rank_heartbeat_timeout")
    out = run.text
    assert len(re.findall(r"^hang: ", out, re.M)) == 1
    assert f"error: rank 0 exited with code {HUNG_EXIT_CODE}" in out  # no restart: attempt ended
    # The stopped rank's stack, read by py-spy: stopped inside the step.
    spy = out.split("py-spy dump of stalled rank 1", 1)[1]
    assert "inject_fault" in spy and "train_step" in spy
    # Every live rank's threads: rank 0's main thread waits in a collective.
    stacks = out.split("hang watchdog: rank 0", 1)[1]
    assert "ends in " in stacks and "distributed_c10d.py" in stacks
    assert not run.left_behind()
    ended = [e for e in read_events(tmp_path / "lns") if e.event == "ended"]
    assert ended[-1].fields["how"] == "hung"


@pytest.mark.long
@pytest.mark.usefixtures("private_corpus_cache")
def test_a_hung_run_restarts_in_job_and_trains_on_bitwise(tmp_path, straight_two_rank_run):
    """Issue 35's first case end to end: a rank stopped mid-step is detected, every rank
    restarts in-job from the newest checkpoint, and the loss curve is the uninterrupted
    run's."""
    every_2 = "exp_manager.checkpoint_callback_params.every_n_train_steps=2"
    hung = _Run(
        "kind=stop,rank=1,step=4",
        *_overrides(tmp_path / "hung", every_2, "exp_manager.fault_tolerance.min_timeout=4",
                    "exp_manager.fault_tolerance.rank_heartbeat_timeout=4", restarts=1),
    )  # fmt: skip
    assert hung.wait() == 0, hung.text
    _detected_in_time(hung)
    _, restart = hung.at("^in-job restart")
    assert re.match(r"in-job restart 1 of 1: rank 0 found the run hung \(exit code 75\)", restart)
    assert restart.endswith("from the checkpoint of step 2"), restart
    assert logged_losses(tmp_path / "hung" / "lns") == logged_losses(straight_two_rank_run)
    assert [a.how for a in run_report(tmp_path / "hung" / "lns").goodput.attempts] == [
        "hung", "finished",
    ]  # fmt: skip
    assert not hung.left_behind()


@pytest.mark.long
@pytest.mark.usefixtures("private_corpus_cache")
def test_a_rank_stopped_while_saving_leaves_a_partial_checkpoint_no_resume_picks(tmp_path):
    hung = _ended_by_the_watchdog(
        tmp_path, "kind=stop,rank=1,step=6,phase=save", 9, "checkpoint_save_timeout"
    )
    assert not hung.left_behind()
    checkpoints = tmp_path / "lns" / "checkpoints"
    assert (checkpoints / "iter_0000006.partial").is_dir()
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000003"

    resumed = _Run(None, *_overrides(tmp_path, "trainer.max_steps=9"))
    assert resumed.wait() == 0, resumed.text
    assert f"resumed from {checkpoints / 'iter_0000003'}" in resumed.text
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000009"


@pytest.mark.long
@pytest.mark.usefixtures("private_corpus_cache")
def test_slow_first_steps_and_a_slow_first_save_do_not_stop_a_healthy_run(tmp_path):
    """The first steps and the first save are slow (as compilation and a cold filesystem
    make them); the timeouts learnt from them are recorded and never fire."""
    run = _Run(
        "kind=slow,rank=0,step=1,until=2,seconds=1.5;"
        "kind=slow,rank=1,step=3,until=3,phase=save,seconds=1.5",
        *_overrides(tmp_path, "trainer.max_steps=12",
                    "exp_manager.fault_tolerance.min_timeout=3",
                    "exp_manager.fault_tolerance.safety_factor=3"),
    )  # fmt: skip
    assert run.wait() == 0, run.text
    assert "hang:" not in run.text
    (timeouts,) = [e for e in read_events(tmp_path / "lns") if e.event == "timeouts"]
    # 3 x the slow first steps and save (1.5 s and more), not the floor
    learnt = timeouts.number("step_timeout_s"), timeouts.number("save_timeout_s")
    assert 4.5 <= learnt[0] < 180 and 4.5 <= learnt[1] < 420, timeouts
    assert "hang watchdog: timeouts learnt in this attempt: step " in run.text


@contextlib.contextmanager
def _never_left_stopped(run):
    """Whatever the block does, the run is continued, and killed if it still runs."""
    try:
        yield
    finally:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            run.signal_every_process_group(signal.SIGCONT)
        if run.process.poll() is None:
            run.process.kill()
            run.wait()


@pytest.mark.long
@pytest.mark.usefixtures("private_corpus_cache")
def test_a_paused_run_is_not_a_hung_one(tmp_path):
    """The whole run stopped (kill -STOP of its process groups, as Ctrl-Z or scontrol
    suspend stop it) for longer than the timeouts it learnt, then continued, finishes as
    if never paused: no hang found, no attempt lost, the pause in no learnt timeout."""
    run = _Run(
        None,
        *_overrides(tmp_path, "trainer.max_steps=12",
                    "exp_manager.fault_tolerance.rank_heartbeat_timeout=60",
                    "exp_manager.fault_tolerance.safety_factor=2",
                    "exp_manager.fault_tolerance.min_timeout=3"),
        session=True,
    )  # fmt: skip
    with _never_left_stopped(run):
        run.await_line(r"\] step +4 ")  # steps and an evaluation measured: learnt timeouts
        run.signal_every_process_group(signal.SIGSTOP)
        time.sleep(15)  # the pause itself
        lines_before = len(run.lines)
        run.signal_every_process_group(signal.SIGCONT)
        assert run.wait() == 0, run.text
    assert "hang:" not in run.text and "hang watchdog: rank" not in run.text, run.text
    assert re.search(r"\] step +12 ", "\n".join(x for _, x in run.lines[lines_before:]))
    assert [a.how for a in run_report(tmp_path / "lns").goodput.attempts] == ["finished"]
    (timeouts,) = [e for e in read_events(tmp_path / "lns") if e.event == "timeouts"]
    assert timeouts.number("step_timeout_s") < 15, timeouts  # the pause is no step's time
    assert not run.left_behind()


def _the_ranks_groups(run):
    """Every process of the ranks' process groups (each rank leads one), and the launcher."""
    launcher = psutil.Process(run.process.pid)
    descendants = launcher.children(recursive=True)
    run.seen.update(descendants)
    groups = {os.getpgid(p.pid) for p in descendants} - {os.getpgid(launcher.pid)}
    assert len(groups) == 2, descendants
    return [launcher, *(p for p in descendants if os.getpgid(p.pid) in groups)]


@pytest.mark.long
@pytest.mark.usefixtures("private_corpus_cache")
def test_ctrl_z_stops_the_whole_run_and_fg_continues_it(tmp_path):
    """SIGTSTP to the launcher of a two-rank run (a terminal's Ctrl-Z) stops each rank's
    process group and the launcher; SIGCONT to the launcher (fg) continues them all, and
    the run finishes as if never stopped."""
    run = _Run(None, *_overrides(tmp_path, "trainer.max_steps=12"), session=True)
    with _never_left_stopped(run):
        run.await_line(r"\] step +4 ")
        processes = _the_ranks_groups(run)
        os.kill(run.process.pid, signal.SIGTSTP)
        deadline = time.monotonic() + 60
        while not all(p.status() == psutil.STATUS_STOPPED for p in processes):  # state T
            assert time.monotonic() < deadline, [(p, p.status()) for p in processes]
            time.sleep(0.05)
        os.kill(run.process.pid, signal.SIGCONT)
        assert run.wait() == 0, run.text
    assert "hang:" not in run.text and "hang watchdog: rank" not in run.text, run.text
    assert [a.how for a in run_report(tmp_path / "lns").goodput.attempts] == ["finished"]
    assert not run.left_behind()


@pytest.mark.parametrize("on", [True, False])
def test_the_watchdog_runs_only_when_on_and_close_joins_it(on):
    from helpers import tiny_run_config

    cfg = tiny_run_config("/nonexistent", f"exp_manager.create_fault_tolerance_callback={on}")
    said, recorded = [], []
    watch = HangWatch(cfg.exp_manager, 0, 1, said.append, recorded.append)
    assert (watch.watchdog is not None) == on
    watch.step(1)
    watch.step(2)
    watch.close()
    assert not [t for t in threading.enumerate() if t.name == "hang-watchdog"]
    if on:  # the learnt timeouts are said and recorded at the end of the attempt
        assert said[-1] == "hang watchdog: timeouts learnt in this attempt: step 30 s"
        assert recorded == [{"step": 30.0}]
    else:  # no watchdog applies timeouts: none is said to be learnt
        assert recorded == [] and said == []


def _two_ranks_in_step_4(exits: list[int], settings=None, starting=()):
    """The watchdogs of two ranks of one run (a 10 s step timeout, or ``settings``; one
    store, the first heartbeats published) and the clock of their phases, at 0 s into
    step 4 (the ranks in ``starting``: into their start-up)."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False
    )
    clock = [0.0]
    watchdogs = []
    for rank in (0, 1):
        settings = settings or TimeoutSettings(rank_heartbeat_timeout=10)
        phases = PhaseClock(settings, lambda: clock[0])
        if rank not in starting:
            phases.begin("step", 4)
        store = WatchdogStore("127.0.0.1", server.port, timeout_s=2.0)
        watchdogs.append(HangWatchdog(phases, rank, 2, 0.1, store, exit_process=exits.append))
    for watchdog in watchdogs:
        watchdog.prefix = "shared"  # two "processes" of one run
        watchdog.check()  # first heartbeats
    return server, watchdogs, clock


def _check_in_threads(watchdogs, stagger_s: float = 0.0) -> None:
    threads = [threading.Thread(target=w.check) for w in watchdogs]
    for thread in threads:
        thread.start()
        time.sleep(stagger_s)
    for thread in threads:
        thread.join()


def test_ranks_that_find_the_hang_together_print_one_line_and_all_end(capfd):
    """Both ranks' phases expire at once (a collective neither leaves): the abort key's
    compare-and-set lets one name the hang; both dump their stacks and end."""
    exits = []
    _server, watchdogs, clock = _two_ranks_in_step_4(exits)
    clock[0] = 11.0
    _check_in_threads(watchdogs)
    assert exits == [HUNG_EXIT_CODE, HUNG_EXIT_CODE]
    err = capfd.readouterr().err
    assert len(re.findall(r"^hang: ", err, re.M)) == 1, err
    for rank in (0, 1):
        assert f"hang watchdog: rank {rank} (host {HOST}, pid {os.getpid()}) ends in step 4" in err


def test_a_rank_that_found_the_hang_still_answers_the_others(capfd):
    """A rank names the stalled ones from heartbeats read about a second apart; a rank
    whose own timeout expired a moment later is looking too, and keeps publishing while
    it does, so it is not named as having stopped responding."""
    exits = []
    _server, watchdogs, clock = _two_ranks_in_step_4(exits)
    clock[0] = 11.0
    _check_in_threads(watchdogs, stagger_s=0.2)  # rank 0 looks first, and reports
    line = next(x for x in capfd.readouterr().err.splitlines() if x.startswith("hang: "))
    assert "stopped responding" not in line, line
    assert exits == [HUNG_EXIT_CODE, HUNG_EXIT_CODE]


def test_a_rank_that_moves_on_while_the_others_are_read_is_not_declared_hung(capfd):
    """Rank 0's step outlived its timeout, but the step ended while the watchdog read the
    heartbeats again: no verdict, and no line naming the next step with its age of a
    moment (the line and the verdict are of one observation)."""
    exits = []
    _server, watchdogs, clock = _two_ranks_in_step_4(exits)
    clock[0] = 11.0
    looking = threading.Thread(target=watchdogs[0].check)
    looking.start()
    time.sleep(0.3)  # inside the second read, which waits at least a second
    watchdogs[0].phases.begin("step", 5)
    looking.join()
    assert exits == []
    assert "hang:" not in capfd.readouterr().err


def test_a_rank_stopped_in_its_start_up_is_found_by_its_start_up_timeout(capfd):
    """Rank 1 stopped while starting (its watchdog with it); rank 0 waits in its step, whose
    timeout is far longer: rank 0 finds rank 1 hung once its start-up outlived
    initial_rank_heartbeat_timeout, and the line says so."""
    exits = []
    settings = TimeoutSettings(initial_rank_heartbeat_timeout=6, rank_heartbeat_timeout=180)
    _server, watchdogs, clock = _two_ranks_in_step_4(exits, settings, starting=(1,))
    watchdogs[0].check()  # rank 0 reads rank 1's heartbeat of 0 s into its start-up
    clock[0] = 5.0
    watchdogs[0].check()
    assert exits == []  # 5 s: within its timeout
    clock[0] = 7.0
    watchdogs[0].check()  # rank 1 published nothing since: stopped
    assert exits == [HUNG_EXIT_CODE]
    line = next(x for x in capfd.readouterr().err.splitlines() if x.startswith("hang: "))
    # (Rank 0 is named too: in this test its main thread waits in no collective.)
    assert line.endswith(
        f"; rank 1 (host {HOST}, pid {os.getpid()}) stopped responding (last heartbeat "
        "in startup 0); rank 1 waited in startup 0 for 7.0 s, timeout 6 s "
        "(initial_rank_heartbeat_timeout)"
    ), line
