"""How the last run of an experiment ended, for whatever restarts it.

The trainer writes ``<run_dir>/run_status`` when it returns: one line, ``finished
STEP`` (max_steps reached) or ``stopped STEP`` (a stop request or exit_interval:
checkpoint saved, resumable); with asynchronous saves, only after the last one is
committed on every rank. A plain-text line so that a shell (SLURM's batch
script, outside any container) can read it with ``read -r state step``. A crash
writes nothing; the trainer removes the file once it holds the run's lock, and puts it
back if the start fails before resume has accepted it (``run_claim.py``): the line then
still tells of the run that last trained there.

A launcher that must know what its own run wrote (SLURM's batch script: another job of
the same run directory, which fails on the lock, must not take the winner's line for
its own) names a file of its own in ``MEGATRON_LNS_RUN_STATUS_COPY``: the trainer
writes the same line there too, after ``run_status``.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_lns.base.disk import write_text_atomically
from megatron_lns.runtime.progress_file import count

RUN_STATUS_FILE = "run_status"
RUN_STATUS_COPY_ENV = "MEGATRON_LNS_RUN_STATUS_COPY"


def write_run_status(run_dir: Path, stopped_early: bool, step: int) -> None:
    """Readers never see half a line. A full disk is an error (``DiskFullError``), not a
    warning: without the file a launcher takes the run for a crash, so the run must not
    end as if it had written it."""
    line = f"{'stopped' if stopped_early else 'finished'} {step}\n"
    then = f"; the run itself ended at step {step}, and a rerun resumes from its newest checkpoint"
    write_text_atomically(Path(run_dir) / RUN_STATUS_FILE, line, then=then)
    if copy := os.environ.get(RUN_STATUS_COPY_ENV):
        write_text_atomically(copy, line, then=then)


def read_run_status(run_dir: Path) -> tuple[str, int] | None:
    """``(state, step)`` as :func:`write_run_status` wrote them; None when there is no
    such file or it says something else (an older or a hand-edited one: no run of this
    version ended with it). Raises ``OSError`` when the file is there but cannot be read."""
    path = Path(run_dir) / RUN_STATUS_FILE
    if not path.is_file():
        return None
    words = path.read_text(errors="replace").split()
    if len(words) != 2 or words[0] not in ("finished", "stopped"):
        return None
    state, step = words
    return (state, steps) if (steps := count(step)) is not None else None
