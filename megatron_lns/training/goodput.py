"""Where a run's wall time went: the accounting of its attempts, from ``run_progress``.

A run trains in attempts: the first start, and every resume after a stop, a requeue or a
crash. Rank 0 of each attempt appends to ``<run_dir>/run_progress``
(:mod:`megatron_lns.runtime.progress_file`; :mod:`.attempt_recorder` writes them)::

    JOB RESTART began R [attempt=A] at=T startup_s=S load_s=L samples=N
    JOB RESTART trained S [attempt=A] at=T steps=K train_s=X save_s=Y eval_s=Z samples=N
    JOB RESTART ended S [attempt=A] at=T how=finished|stopped|failed steps=K train_s=X ...

``attempt``: the in-job restart (``runtime/restarts.py``: the ranks restarted by their
launcher inside the job after a dead or hung one; absent: 0, the job's first start), so
that an attempt is named by job, scheduler restart and in-job restart.
``began``: before the first step, from step ``R`` (0: a fresh start); ``startup_s`` from
the attempt's start as its launcher saw it (a SLURM batch script's start, else the
launcher process's) to the first step, of which ``load_s`` loading the checkpoint.
``trained``: the attempt so far (cumulative: ``steps`` training steps in ``train_s``
seconds, the training loop blocked ``save_s`` seconds in checkpoint saves and ``eval_s``
in evaluation), with the console's log line (unless the last line is seconds old), at
least every half minute, and at each committed checkpoint. ``ended``:
the same at a clean end (``finished``: max_steps; ``stopped``: a stop request or
exit_interval, its checkpoint committed; ``failed``: an error the trainer raised). A
crash or a kill writes nothing: an attempt without ``ended`` ended at its last line.

From these, :func:`account` divides the wall time: productive steps (each up to where
every rank agrees it is done, so waiting for a slower rank is training at its pace: the
straggler report names such ranks); start-up; checkpoint
load; saves; evaluation; lost work (the steps an attempt that did not end cleanly trained
past the step the next attempt resumed from, which are trained again); restarts and queue
wait (from an attempt's last line to the next one's start, when both belong to one
scheduler job: a requeue, or one launch: an in-job restart); and the rest (logging,
shutdown). The time between two jobs
(a new ``submit``, a rerun by hand) is nobody's allocation and is not counted.
Torch-free: ``megatron-lns status`` reads it on a login node.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from megatron_lns.runtime.progress_file import LOCAL_JOB_ID, ProgressEvent, count

CLEAN_ENDS = ("finished", "stopped")


@dataclass
class Attempt:
    """One attempt of a run, as its records tell it (module doc)."""

    job_id: str
    restart: int
    in_job_restart: int
    began_at: float  # epoch seconds of its first step
    startup_s: float
    load_s: float
    first_step: int
    last_step: int
    last_at: float  # epoch seconds of its last record
    steps: int = 0
    train_s: float = 0.0
    save_s: float = 0.0
    eval_s: float = 0.0
    samples: int = 0
    how: str | None = None  # finished / stopped / failed; None: no end was recorded
    lost_steps: int = 0
    lost_s: float = 0.0  # of its recorded training time
    unrecorded_lost_s: float = 0.0  # of the steps it trained after its last record
    logged_past: int | None = None  # its ``began``: the last step the previous one logged

    @property
    def key(self) -> tuple[str, int, int]:
        """What names this attempt's lines in ``run_progress``."""
        return self.job_id, self.restart, self.in_job_restart

    @property
    def start(self) -> float:
        return self.began_at - self.startup_s

    @property
    def wall_s(self) -> float:
        return max(0.0, self.last_at - self.start)

    @property
    def step_s(self) -> float | None:
        """Wall seconds per step since the first step (saves and evaluation included)."""
        return (self.last_at - self.began_at) / self.steps if self.steps else None

    def update(self, event: ProgressEvent) -> None:
        """Take the cumulative numbers of a ``trained`` or ``ended`` line."""
        self.last_at = max(self.last_at, event.number("at", self.last_at))
        if event.step is not None:
            self.last_step = event.step
        self.steps = int(event.number("steps", self.steps))
        self.train_s = event.number("train_s", self.train_s)
        self.save_s = event.number("save_s", self.save_s)
        self.eval_s = event.number("eval_s", self.eval_s)
        self.samples = int(event.number("samples", self.samples))
        if event.event == "ended":
            self.how = event.fields.get("how", "failed")


def attempts_of(events: list[ProgressEvent]) -> list[Attempt]:
    """The attempts the accounting lines of ``events`` describe, in order; the lines of
    other writers (a batch script's progress guard) are passed over."""
    attempts: list[Attempt] = []
    for event in events:
        if event.event == "began":
            at = event.number("at")
            attempts.append(
                Attempt(
                    job_id=event.job_id,
                    restart=event.restart,
                    in_job_restart=_in_job_restart(event),
                    began_at=at,
                    startup_s=max(0.0, event.number("startup_s")),
                    load_s=max(0.0, event.number("load_s")),
                    first_step=event.step or 0,
                    last_step=event.step or 0,
                    last_at=at,
                    samples=int(event.number("samples")),
                    logged_past=_optional_step(event, "logged_past"),
                )
            )
        elif event.event in ("trained", "ended") and attempts:
            current = attempts[-1]
            if current.key == (event.job_id, event.restart, _in_job_restart(event)):
                current.update(event)
    return attempts


def _optional_step(event: ProgressEvent, key: str) -> int | None:
    return count(event.fields.get(key, ""))


def _in_job_restart(event: ProgressEvent) -> int:
    return int(event.number("attempt", 0))


@dataclass
class Goodput:
    """The wall time of a run's attempts, divided (module doc); seconds."""

    attempts: list[Attempt]
    rows: dict[str, float] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return sum(self.rows.values())

    @property
    def fraction(self) -> float | None:
        """Productive steps over wall time (None before any time was recorded)."""
        return self.rows["productive steps"] / self.wall_s if self.wall_s > 0 else None


# The rows of the table, in order.
ROWS = (
    "productive steps",
    "start-up",
    "checkpoint load",
    "checkpoint saves",
    "evaluation",
    "lost work",
    "restarts, queue wait",
    "other",
)


def _charge_lost_work(attempts: list[Attempt], resumable_step: int | None) -> None:
    """Charge each attempt that did not end cleanly the steps it trained past the step the
    next attempt resumed from (``resumable_step`` for the last one: the newest complete
    checkpoint's step; None while it may still be running), at its mean step time.

    A crash leaves up to half a minute of steps after the attempt's last record; the next
    attempt's ``logged_past`` (the last metrics row it dropped) says how far it got. Their
    time lies between its last record and the next start (``unrecorded_lost_s``), which
    :func:`account` moves from the restart's time to the lost work."""
    for index, attempt in enumerate(attempts):
        if attempt.how in CLEAN_ENDS:
            continue
        after = attempts[index + 1] if index + 1 < len(attempts) else None
        later = after.first_step if after is not None else resumable_step
        if later is None:
            continue
        resumed_at = max(later, attempt.first_step)
        recorded = max(0, attempt.last_step - resumed_at)
        reached = max(attempt.last_step, (after and after.logged_past) or 0)
        unrecorded = max(0, reached - max(attempt.last_step, resumed_at))
        attempt.lost_steps = recorded + unrecorded
        rates = [a.train_s / a.steps for a in (attempt, after) if a is not None and a.steps]
        per_step = rates[0] if rates else 0.0
        attempt.lost_s = min(attempt.train_s, recorded * per_step)
        attempt.unrecorded_lost_s = unrecorded * per_step


def queue_wait_s(before: Attempt, after: Attempt) -> float:
    """From ``before``'s last record to ``after``'s start, when ``after`` is an in-job
    restart of ``before``'s launch or both are attempts of one scheduler job (a
    requeue); 0 otherwise (a rerun by hand: nobody's allocation between them)."""
    in_job = after.in_job_restart > 0 and after.key[:2] == before.key[:2]
    requeue = before.job_id == after.job_id and before.job_id != LOCAL_JOB_ID
    return max(0.0, after.start - before.last_at) if in_job or requeue else 0.0


def account(events: list[ProgressEvent], resumable_step: int | None) -> Goodput:
    """The accounting of the run whose ``run_progress`` holds ``events``;
    ``resumable_step``: the step a next attempt would resume from (None: the last attempt
    may still be running, so nothing of it is lost yet)."""
    attempts = attempts_of(events)
    _charge_lost_work(attempts, resumable_step)
    rows = dict.fromkeys(ROWS, 0.0)
    for attempt in attempts:
        rows["productive steps"] += attempt.train_s - attempt.lost_s
        rows["start-up"] += max(0.0, attempt.startup_s - attempt.load_s)
        rows["checkpoint load"] += attempt.load_s
        rows["checkpoint saves"] += attempt.save_s
        rows["evaluation"] += attempt.eval_s
        rows["lost work"] += attempt.lost_s
    for before, after in itertools.pairwise(attempts):
        gap = queue_wait_s(before, after)
        lost = min(gap, before.unrecorded_lost_s)
        rows["lost work"] += lost
        rows["restarts, queue wait"] += gap - lost
    wall = sum(attempt.wall_s for attempt in attempts) + rows["restarts, queue wait"]
    # What no record names; never below 0 (the records are rounded to 10 ms).
    rows["other"] = max(0.0, wall - sum(rows.values()))
    return Goodput(attempts, rows)


def duration(seconds: float) -> str:
    """``42 s``, ``12m 05s``, ``3h 07m``, ``2d 04h``: as a person reads a duration."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h"
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def goodput_table(goodput: Goodput) -> list[str]:
    """The rows as lines: seconds, a readable duration and the share of the wall time."""
    wall = goodput.wall_s
    lines = [f"{'':22}{'seconds':>11}  {'':>9}{'share':>8}"]
    for name, seconds in [*goodput.rows.items(), ("wall time", wall)]:
        share = f"{100 * seconds / wall:7.1f}%" if wall > 0 else "      -"
        lines.append(f"{name:22}{seconds:11.1f}  {duration(seconds):>9} {share}")
    fraction = goodput.fraction
    said = "-" if fraction is None else f"{100 * fraction:.1f}%"
    lines.append(f"goodput {said} (productive steps over wall time)")
    return lines
