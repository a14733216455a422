"""``<run_dir>/run_progress``: what each attempt of a run did, one plain-text line per event.

Every line reads ``JOB_ID RESTART EVENT STEP [KEY=VALUE ...] [TEXT]``: the scheduler's job
id (``local`` for a run no scheduler watches) and its restart count, an event name, a
step (``-`` for none), then fields. Lines are appended across attempts and jobs by
several writers: a SLURM batch script (bash, outside any container: its progress guard,
``cluster/slurm/progress.py``) and rank 0 of the trainer (the accounting of its wall time,
``training/goodput.py``). Each line is one ``write`` to a file opened with ``O_APPEND``,
so lines never interleave; a reader skips a line it cannot parse (a torn last line).
Torch-free: ``megatron-lns status`` reads it on a login node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

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
        """Field ``key`` as a number (``default`` when absent or unreadable)."""
        try:
            return float(self.fields[key])
        except (KeyError, ValueError):
            return default


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


def read_events(run_dir: Path) -> list[ProgressEvent]:
    """Every well-formed line of ``run_progress`` (none when there is no file)."""
    path = Path(run_dir) / RUN_PROGRESS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        words = line.split()
        if len(words) < 4 or not words[1].isdigit():
            continue
        step = int(words[3]) if words[3].isdigit() else None
        pairs = dict(word.split("=", 1) for word in words[4:] if "=" in word)
        text = " ".join(words[4:])
        events.append(ProgressEvent(words[0], int(words[1]), words[2], step, pairs, text))
    return events
