"""A thread in every rank that notices a hung run, names who stalled, and ends the attempt.

A stopped or stuck rank leaves the others waiting in a collective, silent, for the
process groups' timeout (``trainer.distributed_timeout_minutes``); a rank stuck outside
any collective (a stalled filesystem in a save) is never noticed at all. So every
``workload_check_interval`` seconds the watchdog of each rank:

1. checks its own main thread's phase against its timeout (``phase_timeouts.py``);
2. publishes this rank's heartbeat under ``hang_watchdog/<attempt>/<n>/heartbeat/<rank>``
   of rank 0's TCP store (``MASTER_ADDR:MASTER_PORT``; ``<n>`` counts the trainers of the
   process): rank, host, pid, a sequence number, the main thread's phase, step and the
   phase's age, and ``where`` the main thread is (its innermost Python frame);
3. reads ``hang_watchdog/<attempt>/<n>/abort``, which a rank that found the run hung sets;
4. on rank 0, until every rank is past its start-up, reads the others' heartbeats: a rank
   whose heartbeat stopped in ``startup`` or ``load`` is hung once that phase outlived its
   timeout (``initial_rank_heartbeat_timeout``), though rank 0 waits in its first step.

When the timeout expires, the rank reads every heartbeat twice, a few heartbeats apart
(publishing its own meanwhile: the others' timeouts often expire in the same moment),
and names the stalled ranks: those whose heartbeat stopped (the process is stopped, dead
or its host gone) and those whose main thread is not waiting in a collective; where
there are none, those behind the others. The first rank to set the abort key prints the
one line that names them, with the Python stacks of stalled ranks on its host read by
``py-spy dump --nonblocking`` (a stopped process cannot print its own). Every live rank
then writes the stacks of all its threads to stderr and ends with ``HUNG_EXIT_CODE``,
its child processes (background checkpoint writers, data loader workers) killed first.
The store is reached through a client of the watchdog's own whose every call is bounded:
a rank 0 that stopped answering (its process hosts the store) is itself a verdict
("the store does not answer"), never a watchdog stuck behind it.

A pause is not a hang: the ages judged are the phase clock's, which leaves out the time
the whole process was stopped (``PauseMeter``: Ctrl-Z, ``kill -STOP`` of the run,
``scontrol suspend``). A rank stopped on its own is still found by the others, whose
watchdogs kept running while it was stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

from megatron_lns.base.errors import HUNG_EXIT_CODE
from megatron_lns.runtime.fault_injection import attempt
from megatron_lns.runtime.launcher_env import launcher_environment
from megatron_lns.training.phase_timeouts import (
    PhaseClock,
    PhaseNow,
    Timeout,
    TimeoutSettings,
    timeouts_line,
)

# Seconds between two ticks of the meter of the time a rank was stopped as a whole.
PAUSE_TICK_S = 0.5
# Seconds a py-spy dump of a stalled rank may take.
PY_SPY_TIMEOUT_S = 20.0
# A main thread whose innermost frame is in here waits for other ranks.
# (megatron-core waits on the handles of its own asynchronous sends, receives and
# gradient reductions).
COLLECTIVE_CODE = tuple(
    path.replace("/", os.sep)
    for path in (
        "torch/distributed/",
        "megatron/core/pipeline_parallel/p2p_communication",
        "megatron/core/distributed/param_and_grad_buffer",
    )
)


_WATCHDOGS = itertools.count()


# The phases of a rank's start-up, which rank 0 watches in the others (_overdue_start).
START_PHASES = ("startup", "load")

# How a stalled rank that has no live watchdog is named.
SILENT = ("stopped responding", "never reported")


class StoreUnanswered(RuntimeError):
    """Rank 0's store did not answer a watchdog call in time (or refused it)."""


class WatchdogStore:
    """A client of rank 0's TCP store whose calls give up after ``timeout_s``.

    torch's client waits for ever on a server that was stopped (SIGSTOP) mid-call: each
    call runs in a thread of its own, abandoned (a daemon) when it does not return in
    time, with the client it holds; the next call connects afresh. ``lost`` says why the
    last call failed (None: it was answered).
    """

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.lost: str | None = None
        self._client: Any = None

    def call(self, method: str, *args: Any) -> Any:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                if self._client is None:
                    import torch.distributed as dist

                    self._client = dist.TCPStore(
                        self.host, self.port, None, False,
                        timedelta(seconds=self.timeout_s), wait_for_workers=False,
                    )  # fmt: skip
                outcome["value"] = getattr(self._client, method)(*args)
            except Exception as err:  # handed to the calling thread
                outcome["error"] = err

        worker = threading.Thread(target=run, name="hang-watchdog-store", daemon=True)
        worker.start()
        worker.join(self.timeout_s + 1.0)
        if worker.is_alive():
            self.lost = f"no answer in {self.timeout_s:g} s"
        elif "error" in outcome:
            self.lost = str(outcome["error"]).splitlines()[0][:200]
        else:
            self.lost = None
            return outcome["value"]
        self._client = None
        raise StoreUnanswered(self.lost)

    def get_if_set(self, key: str) -> str | None:
        if not self.call("check", [key]):
            return None
        return self.call("get", key).decode()

    def close(self) -> None:
        self._client = None


def who(rank: int, host: str, pid: int) -> str:
    """A rank as the watchdog's lines name it."""
    return f"rank {rank} (host {host}, pid {pid})"


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    host: str
    pid: int
    seq: int
    phase: str
    step: int
    age_s: float
    where: str

    def in_collective(self) -> bool:
        return any(part in self.where for part in COLLECTIVE_CODE)

    def who(self) -> str:
        return who(self.rank, self.host, self.pid)


@dataclass(frozen=True)
class Stalled:
    """A rank named stalled, and how (``stopped responding``, ``stuck in f.py:3 g``)."""

    rank: int
    who: str
    how: str
    heartbeat: Heartbeat | None


def main_thread_frame() -> str:
    """``path:line function`` of the main thread's innermost Python frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} {code.co_name}"


def stalled_ranks(
    first: dict[int, Heartbeat], second: dict[int, Heartbeat], world_size: int
) -> list[Stalled]:
    """Who stalled, from two reads of every heartbeat a few heartbeats apart (module doc)."""
    silent = [
        Stalled(rank, f"rank {rank}", "never reported", None)
        for rank in range(world_size)
        if rank not in second
    ]
    silent += [
        Stalled(rank, beat.who(), "stopped responding", beat)
        for rank, beat in sorted(second.items())
        if rank in first and first[rank].seq == beat.seq
    ]
    beats = sorted((b for r, b in second.items() if r not in {s.rank for s in silent}),
                   key=lambda b: b.rank)  # fmt: skip
    stuck = [
        Stalled(b.rank, b.who(), f"is stuck at {b.where}", b)
        for b in beats
        if not b.in_collective()
    ]
    # Both: a live rank stuck outside any collective is a culprit beyond doubt, and a
    # heartbeat that did not move may only be a rank starved of CPU on a loaded host.
    if silent or stuck:
        return sorted(silent + stuck, key=lambda s: s.rank)
    furthest = max(b.step for b in beats)
    behind = [
        Stalled(b.rank, b.who(), "is behind the others", b) for b in beats if b.step < furthest
    ]
    if behind:
        return behind
    return [Stalled(b.rank, b.who(), "waits in a collective", b) for b in beats]


def hang_line(stalled: list[Stalled], me: Heartbeat, timeout: Timeout) -> str:
    """The one line that names the stalled ranks, and what the detecting rank (``me``)
    waited in, for how long, against which timeout."""
    parts = []
    for s in stalled:
        beat = s.heartbeat
        if beat is None or s.how.startswith("does not answer"):  # no phase to say
            parts.append(f"{s.who} {s.how}")
        elif s.how == "stopped responding":
            parts.append(f"{s.who} stopped responding (last heartbeat in {beat.phase} {beat.step})")
        else:
            parts.append(f"{s.who} {s.how} in {beat.phase} {beat.step}")
    waited = f"rank {me.rank} waited in {me.phase} {me.step} for {me.age_s:.1f} s"
    return f"hang: {'; '.join(parts)}; {waited}, timeout {timeout}"


def py_spy_dump(pid: int) -> str:
    """The Python stack of process ``pid`` by py-spy (which reads a stopped process too)."""
    py_spy = Path(sys.executable).with_name("py-spy")
    command = str(py_spy) if py_spy.is_file() else shutil.which("py-spy")
    if command is None:
        return "py-spy not found next to the Python interpreter or on PATH"
    try:
        result = subprocess.run(
            [command, "dump", "--nonblocking", "--pid", str(pid)],
            capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"py-spy dump failed: {err}"
    return result.stdout + result.stderr


def own_stacks() -> str:
    """The stacks of every thread of this process, as faulthandler writes them."""
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(file=dump, all_threads=True)
        dump.seek(0)
        return dump.read()


def write_block(text: str) -> None:
    """Write ``text`` to stderr in one call, so that ranks' blocks do not interleave."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(2, text.encode(errors="replace"))


def end_process(code: int = HUNG_EXIT_CODE) -> None:
    """Kill this process's children (background writers, loader workers), then exit at
    once: the main thread is blocked in C++ and would never unwind."""
    with contextlib.suppress(psutil.Error):
        children = psutil.Process().children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(children, timeout=5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class HangWatchdog:
    """The watchdog thread of one rank (module doc). ``store``: None for a world of one.
    ``on_hang(line)`` runs in the watchdog's thread before the process ends (records)."""

    def __init__(
        self,
        phases: PhaseClock,
        rank: int,
        world_size: int,
        interval_s: float,
        store: WatchdogStore | None,
        on_hang: Callable[[str], None] | None = None,
        exit_process: Callable[[int], None] = end_process,
    ) -> None:
        self.phases, self.rank, self.world_size = phases, rank, world_size
        self.interval_s, self.store, self.on_hang = interval_s, store, on_hang
        self.exit_process = exit_process
        self.host, self.pid = socket.gethostname(), os.getpid()
        # Each watchdog of a process (the ranks make the same in the same order) its own
        # keys: a test runs trainer after trainer on one store.
        self.prefix = f"hang_watchdog/{attempt()}/{next(_WATCHDOGS)}"
        self._seq = 0
        # Rank 0's heartbeat, read once: who to name (and py-spy) if its store stops.
        self._rank0: Heartbeat | None = None
        # Rank 0's watch on the others' start-up (None: every rank is past it): the seq
        # of each one's heartbeat, and when that seq was first read here.
        self._starting: dict[int, tuple[int, float]] | None = {} if rank == 0 else None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it (idempotent)."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self.store is not None:
            self.store.close()

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.check()
            self._stopping.wait(self.interval_s)

    def check(self) -> None:
        """One heartbeat: check this rank's timeout, publish, look for an abort. The
        timeout first: a store that stopped answering makes each call wait its limit."""
        now = self.phases.now()
        timeout = self.phases.timeout(now.phase)
        if now.age_s > timeout.seconds and not self._stopping.is_set():
            self._detected(now, timeout)
            return
        if self.store is not None:
            with contextlib.suppress(StoreUnanswered):
                self._publish(now)
                if self._starting is not None and (overdue := self._overdue_start()):
                    self._detected(now, *overdue)
                    return
                if self._rank0 is None and self.rank != 0:
                    self._rank0 = self._heartbeats(ranks=[0]).get(0)
                if (abort := self.store.get_if_set(self._key("abort"))) is not None:
                    said = json.loads(abort)
                    self._end(said["line"], False, said["silent"])

    def _heartbeat(self, now: PhaseNow) -> Heartbeat:
        return Heartbeat(self.rank, self.host, self.pid, self._seq, now.phase, now.step,
                         round(now.age_s, 2), main_thread_frame())  # fmt: skip

    def _publish(self, now: PhaseNow) -> None:
        self._seq += 1
        beat = self._heartbeat(now)
        self.store.call("set", self._key("heartbeat", self.rank), json.dumps(beat.__dict__))

    def _heartbeats(self, ranks: list[int] | None = None) -> dict[int, Heartbeat]:
        beats = {}
        for rank in range(self.world_size) if ranks is None else ranks:
            text = self.store.get_if_set(self._key("heartbeat", rank))
            if text is not None:
                beats[rank] = Heartbeat(**json.loads(text))
        return beats

    def _overdue_start(self) -> tuple[Timeout, Heartbeat] | None:
        """A rank whose heartbeat stopped in ``startup`` or ``load`` for longer than that
        phase's timeout (its own watchdog, stopped with it, cannot say so; the others wait
        in their first step, whose timeout may be longer), with its phase's age as read
        here; None while none is. Rank 0 looks until every rank is past its start-up."""
        beats, read_at, starting = self._heartbeats(), self.phases.unpaused(), {}
        for rank in range(1, self.world_size):
            beat = beats.get(rank)
            if beat is not None and beat.phase not in START_PHASES:
                continue
            seq, seen_at = (self._starting or {}).get(rank, (None, read_at))
            if beat is None:
                starting[rank] = (-1, read_at)  # not yet reporting: process group still forming
                continue
            seen_at = seen_at if seq == beat.seq else read_at
            starting[rank] = (beat.seq, seen_at)
            age = beat.age_s + read_at - seen_at
            timeout = self.phases.timeout(beat.phase)
            if age > timeout.seconds:
                return timeout, dataclasses.replace(beat, age_s=round(age, 2))
        self._starting = starting or None
        return None

    def _detected(self, now: PhaseNow, timeout: Timeout, overdue: Heartbeat | None = None) -> None:
        """This rank's phase outlived its timeout, or ``overdue``'s start-up did: name the
        stalled ranks, end the run."""
        me = self._heartbeat(now)
        try:
            if self.store is None:
                stalled = [Stalled(self.rank, me.who(), f"is stuck at {me.where}", me)]
            elif self.store.lost is not None:  # its last call went unanswered: no retry
                raise StoreUnanswered(self.store.lost)
            else:
                first = self._heartbeats()
                if not self._beat_while_others_publish():
                    return  # the main thread got out and closed the trainer: not hung
                stalled = stalled_ranks(first, self._heartbeats(), self.world_size)
        except StoreUnanswered as err:
            at = f"the store at {self.store.host}:{self.store.port}"
            who = f"{self._rank0.who()[:-1]}, {at})" if self._rank0 else f"rank 0 ({at})"
            stalled = [Stalled(0, who, f"does not answer ({err})", self._rank0)]
        # The verdict and its line are of one observation: this rank still in the phase
        # that outlived its timeout, after the others were read. One that got out
        # meanwhile is not stuck (another rank's verdict, if any, still ends it).
        again = self.phases.now()
        if (again.phase, again.step) != (now.phase, now.step) or again.age_s < now.age_s:
            return
        line = hang_line(stalled, overdue or self._heartbeat(again), timeout)
        # The ranks that cannot end on their own: rank 0 waits for all others.
        reporter, silent = True, [s.rank for s in stalled if s.how in SILENT]
        if self.store is not None and self.store.lost is None:
            said = json.dumps({"line": line, "silent": silent})
            with contextlib.suppress(StoreUnanswered):
                first = self.store.call("compare_set", self._key("abort"), "", said).decode()
                reporter = first == said  # else another rank found it first: its verdict
                verdict = json.loads(first)
                line, silent = verdict["line"], verdict["silent"]
        self._end(line, reporter, silent, stalled)

    def _beat_while_others_publish(self) -> bool:
        """Wait long enough for every live rank to publish again, even late on a busy
        machine, publishing as usual meanwhile: another rank whose timeout expires now
        reads this rank's heartbeats in the same wait, and must not find it silent.
        False: the watchdog was stopped meanwhile."""
        deadline = time.monotonic() + max(3 * self.interval_s, 1.0)
        while (left := deadline - time.monotonic()) > 0:
            if self._stopping.wait(min(self.interval_s, left)):
                return False
            self._publish(self.phases.now())
        return True

    def _end(
        self, line: str, reporter: bool, silent: list[int], stalled: list[Stalled] = ()
    ) -> None:
        now = self.phases.now()
        me = who(self.rank, self.host, self.pid)
        if reporter:
            write_block(line + "\n")
            for s in stalled:  # a stopped rank cannot print its own stacks
                beat = s.heartbeat
                if beat is not None and beat.host == self.host and beat.pid != self.pid:
                    write_block(f"py-spy dump of stalled {s.who}:\n{py_spy_dump(beat.pid)}\n")
        if self.on_hang is not None:
            with contextlib.suppress(Exception):
                self.on_hang(line)
        write_block(
            f"hang watchdog: {me} ends in {now.phase} {now.step} (exit code "
            f"{HUNG_EXIT_CODE}); its threads' stacks:\n{own_stacks()}"
        )
        self._acknowledge(len(silent))
        self.exit_process(HUNG_EXIT_CODE)

    def _acknowledge(self, silent: int) -> None:
        """Count this rank out; rank 0, whose process hosts the store, waits (briefly) for
        the other live ranks to have read the abort key before its exit takes the store."""
        if self.store is None or self.store.lost is not None:
            return
        with contextlib.suppress(StoreUnanswered):
            self.store.call("add", self._key("ended"), 1)
            if self.rank != 0:
                return
            deadline = time.monotonic() + 3 * self.interval_s + 5.0
            while time.monotonic() < deadline:
                if self.store.call("add", self._key("ended"), 0) >= self.world_size - silent:
                    return
                time.sleep(0.1)


def store_address() -> tuple[str, int] | None:
    """Rank 0's store as the launcher named it (None: a world of one, no store)."""
    launch = launcher_environment()
    if launch is None or launch.world_size <= 1:
        return None
    return launch.master_addr, launch.master_port


class HangWatch:
    """What the trainer holds: the phase clock of its main thread, and the watchdog thread
    where ``exp_manager.create_fault_tolerance_callback`` is on (started here: the process
    group exists). ``say`` prints on rank 0; ``record(timeouts)`` keeps the learnt
    timeouts in the run's records; ``on_hang(line)`` records a hang before the exit."""

    def __init__(
        self,
        exp_manager: Any,
        rank: int,
        world_size: int,
        say: Callable[[str], None],
        record: Callable[[dict[str, float]], None],
        on_hang: Callable[[str], None] | None = None,
    ) -> None:
        ft = exp_manager.fault_tolerance
        self.phases = PhaseClock(TimeoutSettings.of(ft))
        self.say, self.record, self.on_hang = say, record, on_hang
        self.watchdog = None
        if exp_manager.create_fault_tolerance_callback:
            address = store_address()
            # Long enough for a busy store, short against the timeouts it serves.
            store_timeout_s = max(2.0, 2 * ft.workload_check_interval)
            store = None if address is None else WatchdogStore(*address, store_timeout_s)
            # A pause is not a hang: the time the whole process was stopped is no age.
            self.phases.pauses.start(min(PAUSE_TICK_S, ft.workload_check_interval))
            self.watchdog = HangWatchdog(
                self.phases, rank, world_size, ft.workload_check_interval, store, self._hung
            ).start()

    def _hung(self, line: str) -> None:
        """In the watchdog's thread, before the process ends: the records of a hang."""
        if learnt := self.phases.learnt():
            self.record(learnt)
        if self.on_hang is not None:
            self.on_hang(line)

    def step(self, step: int) -> None:
        """Training step ``step`` starts; say learnt timeouts that changed much (only where
        a watchdog applies them)."""
        self.phases.begin("step", step)
        if self.watchdog is not None and (changed := self.phases.changed_timeouts()):
            self.say(f"hang watchdog: timeouts learnt so far: {timeouts_line(changed)}")

    def during(self, phase: str) -> contextlib.AbstractContextManager[None]:
        return self.phases.during(phase)

    def close(self) -> None:
        """Stop and join the watchdog; say and record the timeouts learnt (idempotent)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.phases.pauses.stop()
            self.watchdog = None
            if learnt := self.phases.learnt():
                self.say(f"hang watchdog: timeouts learnt in this attempt: {timeouts_line(learnt)}")
                self.record(learnt)
