"""Rank 0's accounting of one attempt of a run, appended to ``run_progress`` as it goes.

The trainer tells :class:`AttemptRecorder` what its loop spends time on (each training
step, checkpoint saves, evaluation) and where it is; the recorder appends the lines
``training/goodput.py`` reads (:data:`ATTEMPT_EVENTS`), for every run, whoever
scheduled it: the job's identity and the attempt's start come through the job
environment (:class:`~megatron_lns.runtime.job.JobEnvironment`). A line that cannot be
written costs the records, not the run: one warning, then training goes on. It also
estimates the time left to ``max_steps`` for the periodic log line. Torch-free.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_lns.runtime.job import JobEnvironment
from megatron_lns.runtime.progress_file import RUN_PROGRESS_FILE, append_line
from megatron_lns.training.goodput import duration

# The events of the lines this recorder writes in ``run_progress`` (beside the batch
# script's own): an attempt's start, its progress, its end, and the hang timeouts it learnt.
ATTEMPT_EVENTS = ("began", "trained", "ended", "timeouts")
# Most seconds between two ``trained`` lines: what a crash can leave unrecorded.
RECORD_EVERY_S = 30.0
# Fewest seconds between two ``trained`` lines of logged steps: a run that logs every
# fast step writes no line per step (the batch script reads the whole file at each start).
RECORD_LOGGED_AFTER_S = 5.0


class AttemptRecorder:
    """The records of this attempt (``active``: this is rank 0, which writes them)."""

    def __init__(
        self,
        run_dir: Path,
        job: JobEnvironment,
        warn: Callable[[str], None],
        active: bool,
        started_at: float | None = None,
    ) -> None:
        """``started_at``: when the attempt started, where not when the job says (a
        process's later run, such as compare's next arm, starts when it is made)."""
        self.run_dir, self.warn, self.active = Path(run_dir), warn, active
        self.job_id, self.restart = job.record_id, job.restart_count
        # An in-job restart's lines say which one it is (the first start's say nothing).
        self.attempt_field = {"attempt": job.in_job_restart} if job.in_job_restart else {}
        self.started_at = job.attempt_started_at() if started_at is None else started_at
        self.load_s = self.train_s = self.save_s = self.eval_s = 0.0
        self.steps = self.step = self.samples = 0
        self.began_at: float | None = None
        self.last_line = time.monotonic()
        self.write_failed = False
        # How the attempt ended, once recorded: the first record wins (see ended).
        self.how: str | None = None
        self._ending = threading.Lock()

    def _append(self, event: str, **fields: object) -> None:
        if not self.active:
            return
        try:
            append_line(
                self.run_dir, self.job_id, self.restart, event, self.step,
                **self.attempt_field, **fields,
            )  # fmt: skip
        except OSError as err:
            if not self.write_failed:
                self.write_failed = True
                self.warn(
                    f"warning: cannot append to {self.run_dir / RUN_PROGRESS_FILE}: {err}; "
                    "this attempt's time is not accounted (megatron-lns status)"
                )
        self.last_line = time.monotonic()

    def _totals(self) -> dict[str, object]:
        return {
            "at": f"{time.time():.2f}",
            "steps": self.steps,
            "train_s": f"{self.train_s:.2f}",
            "save_s": f"{self.save_s:.2f}",
            "eval_s": f"{self.eval_s:.2f}",
            "samples": self.samples,
        }

    def began(self, step: int, samples: int, logged_past: int | None = None) -> None:
        """The first step is about to start, from ``step`` (0: a fresh start);
        ``logged_past``: the last step an earlier attempt logged past ``step`` (the
        metrics rows this resume dropped), which it trained after its last record."""
        now = time.time()
        self.began_at, self.step, self.samples = now, step, samples
        startup_s = max(0.0, now - self.started_at)
        past = {} if logged_past is None else {"logged_past": logged_past}
        self._append(
            "began", at=f"{now:.2f}", startup_s=f"{startup_s:.2f}",
            load_s=f"{self.load_s:.2f}", samples=samples, **past,
        )  # fmt: skip

    def step_done(self, step: int, seconds: float, samples: int) -> None:
        """A training step took ``seconds``; the run is at ``step`` with ``samples``."""
        self.steps += 1
        self.train_s += seconds
        self.step, self.samples = step, samples
        if time.monotonic() - self.last_line >= RECORD_EVERY_S:
            self._append("trained", **self._totals())

    def logged(self) -> None:
        """The step was logged on the console: a line too, unless one is only seconds old."""
        if time.monotonic() - self.last_line >= RECORD_LOGGED_AFTER_S:
            self._append("trained", **self._totals())

    def committed(self) -> None:
        """A checkpoint was committed: a line of where the attempt is."""
        self._append("trained", **self._totals())

    @contextlib.contextmanager
    def timing(self, what: str) -> Iterator[None]:
        """Count the time the loop spends inside as ``what`` (``load``, ``save``, ``eval``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            setattr(self, f"{what}_s", getattr(self, f"{what}_s") + seconds)

    def ended(self, how: str) -> None:
        """The attempt ends: ``finished``, ``stopped`` (checkpoint committed), ``failed`` or
        ``hung``. An attempt ends once: the first record wins, so that the failure a hang
        verdict causes in the main thread (the watchdog's thread recorded ``hung``) is not
        recorded as a second end."""
        with self._ending:
            if self.how is not None:
                return
            self.how = how
            self._append("ended", how=how, **self._totals())

    def timeouts(self, learnt: dict[str, float]) -> None:
        """The phase timeouts this attempt learnt (``training/phase_timeouts.py``), kept
        beside its accounting: a hang's verdict is only as good as its timeout."""
        self._append(
            "timeouts", **{f"{phase}_timeout_s": f"{s:.3g}" for phase, s in learnt.items()}
        )

    def hung(self, line: str) -> None:
        """The hang watchdog ends the attempt (from its thread; the main one is stuck)."""
        self.ended("hung")

    def time_to(self, max_steps: int) -> str | None:
        """The time left to ``max_steps`` at this attempt's rate (wall seconds per step
        since its first step, saves and evaluation included), as the log line says it."""
        if self.began_at is None or not self.steps:
            return None
        per_step = (time.time() - self.began_at) / self.steps
        return duration(max(0, max_steps - self.step) * per_step)
