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
Torch-free: a thread reads it while the main thread is blocked in C++.
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


class PhaseClock:
    """The phase of this rank's main thread and the slowest time seen of each phase.

    Written by the main thread, read by the watchdog's; a lock keeps each read whole.
    ``clock`` is the time source (``time.monotonic``; tests pass their own).
    """

    def __init__(
        self, settings: TimeoutSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._lock = threading.Lock()
        self._phase, self._step, self._since = "startup", 0, clock()
        self.slowest: dict[str, float] = {}
        self._announced: dict[str, float] = {}

    def begin(self, phase: str, step: int | None = None) -> None:
        """The main thread enters ``phase`` (of ``step``; default: the current step); the
        phase it leaves counts as measured."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
        with self._lock:
            now = self.clock()
            lasted = now - self._since
            self.slowest[self._phase] = max(self.slowest.get(self._phase, 0.0), lasted)
            self._phase, self._since = phase, now
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

    def now(self) -> PhaseNow:
        with self._lock:
            return PhaseNow(self._phase, self._step, self.clock() - self._since)

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
