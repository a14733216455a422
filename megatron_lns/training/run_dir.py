"""One run per run directory: a lock while a run owns it, and no silent overwrite.

``<exp_dir>/<name>/`` holds a run's config, metrics, logs and checkpoints. Two
processes writing into it would interleave checkpoints that a later resume mixes,
so the first rank takes ``.lock`` (pid, host, start time) for the whole run and
another run into the same directory is refused. A lock whose process is gone (a
killed job) is stale and is taken over. With ``exp_manager.resume_if_exists=false``
a directory that already holds a run is refused rather than overwritten: choose
another name, or resume it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from megatron_lns.errors import UserError

LOCK_NAME = ".lock"


class RunDirError(UserError):
    """The run directory is in use, holds another run, or cannot be written."""


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` has checkpoints or metrics of an earlier run."""
    checkpoints = run_dir / "checkpoints"
    has_checkpoints = checkpoints.is_dir() and any(
        p.name.startswith("iter_") for p in checkpoints.iterdir()
    )
    return has_checkpoints or (run_dir / "metrics.jsonl").is_file()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    """The lock on a run directory, held by this process until :meth:`release`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        self.held = False

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self.held = True
            return
        raise RunDirError(f"could not lock {self.path.parent}: another run took it meanwhile")

    def _take_over_if_stale(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            holder = {}
        pid, host = holder.get("pid"), holder.get("host")
        run_dir = self.path.parent
        if host == self.owner["host"] and isinstance(pid, int) and not _pid_alive(pid):
            print(f"note: removing the stale lock of process {pid}, which is gone, on {run_dir}")
            self.path.unlink(missing_ok=True)
            return
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        where = f"process {pid} on {host} since {since}" if pid else "another process"
        raise RunDirError(
            f"{run_dir} is in use by {where}: two runs must not share a run directory "
            f"(choose another exp_manager.name; if no run is active, delete {self.path})"
        )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def claim_run_dir(run_dir: Path, resume_if_exists: bool) -> RunDirLock:
    """Create and lock ``run_dir`` for a new or resumed run (see module doc)."""
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create the run directory {run_dir}: {err.strerror}") from None
    if not os.access(run_dir, os.W_OK) or not os.access(run_dir / "checkpoints", os.W_OK):
        raise RunDirError(f"the run directory {run_dir} (or its checkpoints/) is not writable")
    lock = RunDirLock(run_dir)
    lock.acquire()
    if not resume_if_exists and holds_a_run(run_dir):
        lock.release()
        raise RunDirError(
            f"exp_manager.resume_if_exists=false, but {run_dir} already holds a run: choose "
            "another exp_manager.name or exp_dir, remove it, or set "
            "exp_manager.resume_if_exists=true to continue it"
        )
    return lock
