"""One run per run directory: a lock while a run owns it, and no silent overwrite.

``<exp_dir>/<name>/`` holds a run's config, metrics, logs and checkpoints. Two
processes writing into it would interleave checkpoints that a later resume mixes,
so the first rank takes ``.lock`` (pid, host, start time, and what the job environment
records of its job: :meth:`~megatron_lns.runtime.job.JobEnvironment.lock_record`) for the
whole run and another run into the same directory is refused. A lock left by a killed job
is stale and is taken over, with a note saying why: on the same host when its process is
gone; from another host when the job environment says its job has ended (a scheduler's,
:meth:`~megatron_lns.runtime.job.JobEnvironment.judge_foreign_lock`). With
``exp_manager.resume_if_exists=false``
a directory that already holds a run is refused rather than overwritten: choose
another name, or resume it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

from megatron_lns.base.disk import disk_full_reported
from megatron_lns.base.errors import UserError
from megatron_lns.runtime.job import JobEnvironment, LocalJob

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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    """The lock on a run directory, held by this process of ``job`` until :meth:`release`."""

    def __init__(self, run_dir: Path, job: JobEnvironment) -> None:
        self.path = run_dir / LOCK_NAME
        self.job = job
        self.owner: dict[str, object] = {
            "pid": os.getpid(),
            "host": job.host,
            "started": time.time(),
            **job.lock_record(),
        }
        self.held = False

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            # A lock without its owner would refuse every later run: none or whole.
            unlink = functools.partial(self.path.unlink, missing_ok=True)
            with disk_full_reported(self.path, cleanup=unlink), os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self.held = True
            return
        raise RunDirError(f"could not lock {self.path.parent}: another run took it meanwhile")

    def _take_over_if_stale(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            holder = {}
        if not isinstance(holder, dict):
            holder = {}
        pid, host = holder.get("pid"), holder.get("host")
        run_dir = self.path.parent
        if host == self.owner["host"]:
            if isinstance(pid, int) and not pid_alive(pid):
                print(
                    f"note: removing the stale lock of process {pid}, which is gone, on {run_dir}"
                )
                self.path.unlink(missing_ok=True)
                return
            held_by = ""
        else:
            verdict = self.job.judge_foreign_lock(holder)  # a pid means nothing here
            held_by = verdict.held_by
            if verdict.stale:
                print(f"note: taking over the stale lock on {run_dir}: {verdict.stale}")
                self.path.unlink(missing_ok=True)
                return
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        where = f"process {pid} on {host} since {since}{held_by}" if pid else "another process"
        raise RunDirError(
            f"{run_dir} is in use by {where}: two runs must not share a run directory "
            f"(choose another exp_manager.name; if no run is active, delete {self.path})"
        )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def claim_run_dir(
    run_dir: Path, resume_if_exists: bool, job: JobEnvironment | None = None
) -> RunDirLock:
    """Create and lock ``run_dir`` for a new or resumed run of ``job`` (default: a
    :class:`~megatron_lns.runtime.job.LocalJob`; see module doc)."""
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create the run directory {run_dir}: {err.strerror}") from None
    if not os.access(run_dir, os.W_OK) or not os.access(run_dir / "checkpoints", os.W_OK):
        raise RunDirError(f"the run directory {run_dir} (or its checkpoints/) is not writable")
    lock = RunDirLock(run_dir, job or LocalJob())
    lock.acquire()
    if not resume_if_exists and holds_a_run(run_dir):
        lock.release()
        raise RunDirError(
            f"exp_manager.resume_if_exists=false, but {run_dir} already holds a run: choose "
            "another exp_manager.name or exp_dir, remove it, or set "
            "exp_manager.resume_if_exists=true to continue it"
        )
    return lock
