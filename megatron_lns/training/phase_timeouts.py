"""Which phase a rank's main thread is in, since when, and how long that phase may last.

The trainer's main thread reports each phase as it enters it (:meth:`PhaseClock.begin`,
:meth:`PhaseClock.during`); the hang watchdog (``training/hang_watchdog.py``) reads
:meth:`PhaseClock.now` from its own thread and declares the run hung once the phase has
lasted longer than :meth:`PhaseClock.timeout`. The phases:

- ``startup``: from the process group's creation until the first step (data, model);
- ``load``: the checkpoint load;
- ``step``: training step N, from its start until the next phase begins (its logging and
  the poll that commits a background save included);
- ``eval``: an evaluation;
- ``save``: a checkpoint save (with ``async_save``: taking the state to write);
- ``commit``: waiting for background saves to be written and committed (``async_save``).

A phase's timeout is the configured one (``exp_manager.fault_tolerance``) until this
attempt has measured that phase once; then, with ``calculate_timeouts``, it is learnt:
``safety_factor`` x the slowest seen, at least ``min_timeout``, at most the configured one.
Start-up and load happen once per attempt, so they always keep the configured timeout;
so does ``commit``, whose waits range from nothing (a write finished long ago) to a whole
write (the last one), so that none of them bounds the next;
nothing learnt carries into the next attempt (a restart's first steps are slow again).

A pause is not a hang: time during which the whole process was stopped (Ctrl-Z, ``kill
-STOP`` of the run's process group, ``scontrol suspend``) counts in no phase's age and in
no measured phase (:class:`PauseMeter`). Torch-free: a thread reads it while the main
thread is blocked in C++.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PHASES = ("startup", "load", "step", "eval", "save", "commit")
# The phases that recur within an attempt, whose timeouts it can learn.
LEARNT_PHASES = ("step", "eval", "save")
# Learnt timeouts are announced again only when they changed by more than this fraction.
ANNOUNCE_CHANGE = 0.5


@dataclass(frozen=True)
class TimeoutSettings:
    """``exp_manager.fault_tolerance``'s timeouts, by the names the config gives them."""

    initial_rank_heartbeat_timeout: float = 600.0
    rank_heartbeat_timeout: float = 180.0
    checkpoint_save_timeout: float = 420.0
    calculate_timeouts: bool = True
    safety_factor: float = 5.0
    min_timeout: float = 30.0

    @classmethod
    def of(cls, fault_tolerance: object) -> TimeoutSettings:
        """The settings of a config's ``exp_manager.fault_tolerance`` section."""
        return cls(**{name: getattr(fault_tolerance, name) for name in cls.__dataclass_fields__})

    def configured(self, phase: str) -> tuple[float, str]:
        """The configured timeout of ``phase`` and the key that sets it."""
        key = {
            "startup": "initial_rank_heartbeat_timeout",
            "load": "initial_rank_heartbeat_timeout",
            "step": "rank_heartbeat_timeout",
            "eval": "rank_heartbeat_timeout",
            "save": "checkpoint_save_timeout",
            "commit": "checkpoint_save_timeout",
        }[phase]
        return getattr(self, key), key


@dataclass(frozen=True)
class PhaseNow:
    """Where the main thread is: ``phase`` of ``step`` (the step reached before a step
    starts), for ``age_s`` seconds."""

    phase: str
    step: int
    age_s: float


@dataclass(frozen=True)
class Timeout:
    seconds: float
    why: str  # where it came from, as the hang line says it

    def __str__(self) -> str:
        return f"{self.seconds:g} s ({self.why})"


class PauseMeter:
    """The seconds during which this whole process was stopped, as far as it can tell.

    The clock counts the time a process spends stopped (SIGSTOP, Ctrl-Z, ``scontrol
    suspend``), and nothing inside a stopped process runs to notice. So, once started, a
    thread of its own ticks every ``tick_s`` seconds: a gap between two ticks (or between
    a tick and a reading) of more than ``grace_s`` means no thread of the process ran for
    that long, which only a stop explains (a thread late by a second on a busy host is not
    one), and the gap, less the tick it would have waited anyway, counts as paused. A
    rank stopped on its own (a host stalled in the kernel) is paused by this measure too:
    the other ranks, which were not, find it hung. Every reading ticks first, so a
    reading right after a stop counts it, whichever thread runs first. Not started (a
    test's clock): nothing counts as paused.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tick_s = self.grace_s = 0.0
        self._lock = threading.Lock()
        self._paused_s = 0.0
        self._last: float | None = None  # None: not started, no gap is judged
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, tick_s: float) -> PauseMeter:
        self.tick_s, self.grace_s = tick_s, max(2.0, 4 * tick_s)
        self._last = self.clock()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="pause-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the ticking thread; no gap counts as paused any more (idempotent)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._thread = self._last = None

    def _run(self) -> None:
        while not self._stopping.wait(self.tick_s):
            self.paused_s()

    def paused_s(self) -> float:
        """Tick, and return the seconds paused since the start."""
        with self._lock:
            if self._last is not None:
                now = self.clock()
                if now - self._last > self.grace_s:
                    self._paused_s += now - self._last - self.tick_s
                self._last = now
            return self._paused_s


class PhaseClock:
    """The phase of this rank's main thread and the slowest time seen of each phase.

    Written by the main thread, read by the watchdog's; a lock keeps each read whole.
    ``clock`` is the time source (``time.monotonic``; tests pass their own); the time
    ``pauses`` counts is left out of every phase's time (module doc).
    """

    def __init__(
        self, settings: TimeoutSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.pauses = PauseMeter(clock)
        self._lock = threading.Lock()
        self._phase, self._step, self._since = "startup", 0, clock()
        self._paused_before = 0.0  # the pauses' seconds when the phase began
        self.slowest: dict[str, float] = {}
        self._announced: dict[str, float] = {}

    def begin(self, phase: str, step: int | None = None) -> None:
        """The main thread enters ``phase`` (of ``step``; default: the current step); the
        phase it leaves counts as measured."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
        with self._lock:
            lasted, paused = self._age()
            self.slowest[self._phase] = max(self.slowest.get(self._phase, 0.0), lasted)
            self._phase, self._since, self._paused_before = phase, self.clock(), paused
            if step is not None:
                self._step = step

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Inside: ``phase``; afterwards the phase before it, its time counted afresh."""
        previous = self._phase
        self.begin(phase)
        try:
            yield
        finally:
            self.begin(previous)

    def _age(self) -> tuple[float, float]:
        """The current phase's age less its paused time, and the pauses' seconds."""
        paused = self.pauses.paused_s()
        age = self.clock() - self._since - (paused - self._paused_before)
        return max(0.0, age), paused

    def now(self) -> PhaseNow:
        with self._lock:
            return PhaseNow(self._phase, self._step, self._age()[0])

    def unpaused(self) -> float:
        """The clock less the time paused: a time whose differences are ages as
        :meth:`now` measures them (another rank's heartbeat, timed here)."""
        return self.clock() - self.pauses.paused_s()

    def timeout(self, phase: str) -> Timeout:
        """How long ``phase`` may last now (module doc)."""
        s = self.settings
        configured, key = s.configured(phase)
        with self._lock:
            slowest = self.slowest.get(phase)
        if not s.calculate_timeouts or slowest is None or phase not in LEARNT_PHASES:
            return Timeout(configured, f"{key}")
        multiple = s.safety_factor * slowest
        learnt = max(s.min_timeout, multiple)
        basis = f"{s.safety_factor:g} x slowest {phase} {slowest:.2f} s"
        if multiple < s.min_timeout:
            basis += f", min_timeout {s.min_timeout:g}"
        if learnt >= configured:
            return Timeout(configured, f"{key}, the cap of {basis}")
        return Timeout(learnt, basis)

    def learnt(self) -> dict[str, float]:
        """The timeout of each phase measured so far (seconds), for the records."""
        with self._lock:
            measured = [phase for phase in LEARNT_PHASES if phase in self.slowest]
        return {phase: self.timeout(phase).seconds for phase in measured}

    def changed_timeouts(self) -> dict[str, float]:
        """The learnt timeouts that changed by more than ``ANNOUNCE_CHANGE`` since they were
        last returned here (each is returned once when first learnt): what to print."""
        changed = {}
        for phase, seconds in self.learnt().items():
            before = self._announced.get(phase)
            if before is None or abs(seconds - before) > ANNOUNCE_CHANGE * before:
                changed[phase] = self._announced[phase] = seconds
        return changed


def timeouts_line(timeouts: dict[str, float]) -> str:
    """``step 12.5 s, save 30 s``: timeouts as the log and ``run_progress`` show them."""
    return ", ".join(f"{phase} {seconds:.3g} s" for phase, seconds in timeouts.items())
