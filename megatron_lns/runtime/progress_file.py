"""``<run_dir>/run_progress``: what each attempt of a run did, one plain-text line per event.

Every line reads ``JOB_ID RESTART EVENT STEP [KEY=VALUE ...] [TEXT]``: the scheduler's job
id (``local`` for a run no scheduler watches) and its restart count, an event name, a
step (``-`` for none), then fields. Lines are appended across attempts and jobs by
several writers: a SLURM batch script (bash, outside any container: its progress guard,
``cluster/slurm/progress.py``) and rank 0 of the trainer (the accounting of its wall time,
``training/goodput.py``). Each line is one ``write`` to a file opened with ``O_APPEND``,
so lines never interleave. A line that a kill or a full disk cut short, or that was
edited by hand, is no record: :func:`read_progress` leaves it out and says which it left
(the next writer's line may follow a torn one on the same line, so that can be any line,
not only the last). Torch-free: ``megatron-lns status`` reads it on a login node.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lns.base.timestamps import epoch_seconds

RUN_PROGRESS_FILE = "run_progress"
# The job id of the lines of a run that no scheduler watches.
LOCAL_JOB_ID = "local"


@dataclass(frozen=True)
class ProgressEvent:
    job_id: str
    restart: int
    event: str
    step: int | None
    fields: dict[str, str] = field(default_factory=dict)
    text: str = ""  # the words after the step (a warning's text)

    def number(self, key: str, default: float = 0.0) -> float:
        """Field ``key`` as a finite number (``default`` when absent or unreadable: no
        writer writes ``nan`` or ``inf``)."""
        try:
            value = float(self.fields[key])
        except (KeyError, ValueError):
            return default
        return value if math.isfinite(value) else default


def append_line(
    run_dir: Path,
    job_id: str,
    restart: int,
    event: str,
    step: int | None,
    text: str = "",
    **fields: object,
) -> None:
    """Append one line (one ``write``; ``O_APPEND`` keeps concurrent lines whole)."""
    words = [job_id, str(restart), event, "-" if step is None else str(step)]
    words += [f"{key}={value}" for key, value in fields.items()]
    words += text.split()  # one line whatever the text holds
    fd = os.open(Path(run_dir) / RUN_PROGRESS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (" ".join(words) + "\n").encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ProgressLines:
    """What ``run_progress`` holds: its records, and the numbers (1-based) of the lines
    that are none (module doc)."""

    events: list[ProgressEvent]
    unreadable: list[int]


def read_progress(run_dir: Path) -> ProgressLines:
    """Every record of ``run_progress`` and the lines that are none (none of either when
    there is no file). Raises ``OSError`` when the file is there but cannot be read."""
    path = Path(run_dir) / RUN_PROGRESS_FILE
    if not path.is_file():
        return ProgressLines([], [])
    events, unreadable = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        event = _parse(line.split())
        if event is None:
            unreadable.append(number)
        else:
            events.append(event)
    return ProgressLines(events, unreadable)


def read_events(run_dir: Path) -> list[ProgressEvent]:
    """Every record of ``run_progress`` (:func:`read_progress`, the lines that are none
    left out)."""
    return read_progress(run_dir).events


def count(word: str) -> int | None:
    """A count (a restart, a step) as run files record it, ASCII digits; None for any
    other word (``str.isdigit`` also takes ``²``, which ``int`` refuses)."""
    return int(word) if word.isascii() and word.isdigit() else None


def _parse(words: list[str]) -> ProgressEvent | None:
    """The record a line's ``words`` hold, or None when they are not one: fewer than four
    words, a restart or step (other than ``-``) that is no count, or an ``at`` that is no
    time (every writer writes ``time.time()`` there)."""
    if len(words) < 4:
        return None
    job_id, restart, name, step = words[0], count(words[1]), words[2], count(words[3])
    if restart is None or (step is None and words[3] != "-"):
        return None
    pairs = dict(word.split("=", 1) for word in words[4:] if "=" in word)
    event = ProgressEvent(job_id, restart, name, step, pairs, " ".join(words[4:]))
    if "at" in pairs and epoch_seconds(event.number("at", default=-1.0)) is None:
        return None
    return event
