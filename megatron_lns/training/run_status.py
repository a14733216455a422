"""How the last run of an experiment ended, for whatever restarts it.

The trainer writes ``<run_dir>/run_status`` when it returns: one line, ``finished
STEP`` (max_steps reached) or ``stopped STEP`` (a stop request or exit_interval:
checkpoint saved, resumable); with asynchronous saves, only after the last one is
committed on every rank. A plain-text line so that a shell (SLURM's batch
script, outside any container) can read it with ``read -r state step``. A crash
writes nothing; launchers remove the file before each run.
"""

from __future__ import annotations

import os
from pathlib import Path

RUN_STATUS_FILE = "run_status"


def write_run_status(run_dir: Path, stopped_early: bool, step: int) -> None:
    path = Path(run_dir) / RUN_STATUS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{'stopped' if stopped_early else 'finished'} {step}\n")
    os.replace(tmp, path)  # readers never see half a line


def read_run_status(run_dir: Path) -> tuple[str, int] | None:
    path = Path(run_dir) / RUN_STATUS_FILE
    if not path.is_file():
        return None
    state, step = path.read_text().split()
    return state, int(step)
