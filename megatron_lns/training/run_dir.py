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
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lns.base.disk import disk_full_reported
from megatron_lns.base.errors import UserError
from megatron_lns.base.processes import pid_alive
from megatron_lns.base.timestamps import epoch_seconds, local_time
from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.runtime.job import JobEnvironment, LocalJob
from megatron_lns.training.run_status import RUN_STATUS_FILE

LOCK_NAME = ".lock"
# The largest process id there can be (pid_t); os.kill overflows past it.
_MAX_PID = 2**31 - 1
# The files a run replaces whole and cannot do without, and what it keeps there: its
# config at the start, and at the end how it ended (for whatever restarts it). A start
# keeps the last run's until resume accepts it (run_claim.py).
REPLACED_RUN_FILES = {RUN_CONFIG: "its config", RUN_STATUS_FILE: "how it ended"}


class RunDirError(UserError):
    """The run directory is in use, holds another run, or cannot be written."""


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` has checkpoints or metrics of an earlier run."""
    checkpoints = run_dir / "checkpoints"
    has_checkpoints = checkpoints.is_dir() and any(
        p.name.startswith("iter_") for p in checkpoints.iterdir()
    )
    return has_checkpoints or (run_dir / "metrics.jsonl").is_file()


@dataclass(frozen=True)
class LockHolder:
    """What a run directory's lock says of its holder, each part only where it says it
    as :class:`RunDirLock` writes it (a record torn by a kill or edited by hand may hold
    anything): ``pid`` a process id, ``host`` a name, ``started`` a time; ``record``: the
    whole record as read (``{}`` when it is no JSON object), for what a job environment
    added to it (:meth:`~megatron_lns.runtime.job.JobEnvironment.judge_foreign_lock`)."""

    pid: int | None = None
    host: str | None = None
    started: float | None = None
    record: dict = field(default_factory=dict)

    @property
    def named(self) -> bool:
        """Whether it names a process, on a host, that can be asked whether it runs."""
        return self.pid is not None and self.host is not None

    def describe(self, held_by: str = "") -> str:
        """``process P on HOST since TIME`` (``held_by`` added), or words for a record
        that names none."""
        if not self.named:
            return f"a process its lock does not name readably{held_by}"
        since = f" since {local_time(self.started)}" if self.started is not None else ""
        return f"process {self.pid} on {self.host}{since}{held_by}"


def read_lock(path: Path) -> LockHolder | None:
    """The holder of the lock at ``path``, or None when there is no lock: the one reader
    of ``.lock``, for the next run (:class:`RunDirLock`) and ``megatron-lns status``."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    except OSError:  # there, but unreadable: it stands, naming no holder
        return LockHolder()
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return LockHolder()
    pid, host = record.get("pid"), record.get("host")
    is_pid = isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= _MAX_PID
    return LockHolder(
        pid=pid if is_pid else None,
        host=host if isinstance(host, str) and host else None,
        started=epoch_seconds(record.get("started")),
        record=record,
    )


# What ``train`` accepts to write a run to another directory; commands that choose the
# run directory themselves (compare's --out) say theirs.
ELSEWHERE = "choose another exp_manager.name"


class RunDirLock:
    """The lock on a run directory, held by this process of ``job`` until :meth:`release`."""

    def __init__(self, run_dir: Path, job: JobEnvironment, elsewhere: str = ELSEWHERE) -> None:
        self.path = run_dir / LOCK_NAME
        self.job = job
        self.elsewhere = elsewhere  # how the command writes a run to another directory
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
        holder = read_lock(self.path)
        if holder is None:  # released meanwhile: the next try takes it
            return
        run_dir = self.path.parent
        if holder.host == self.owner["host"]:
            if holder.pid is not None and not pid_alive(holder.pid):
                print(
                    f"note: removing the stale lock of process {holder.pid}, which is gone, "
                    f"on {run_dir}"
                )
                self.path.unlink(missing_ok=True)
                return
            held_by = ""
        else:
            verdict = self.job.judge_foreign_lock(holder.record)  # a pid means nothing here
            held_by = verdict.held_by
            if verdict.stale:
                print(f"note: taking over the stale lock on {run_dir}: {verdict.stale}")
                self.path.unlink(missing_ok=True)
                return
        where = holder.describe(held_by)
        raise RunDirError(
            f"{run_dir} is in use by {where}: two runs must not share a run directory "
            f"({self.elsewhere}; if no run is active, delete {self.path})"
        )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def claim_run_dir(
    run_dir: Path,
    resume_if_exists: bool,
    job: JobEnvironment | None = None,
    elsewhere: str = ELSEWHERE,
) -> RunDirLock:
    """Create and lock ``run_dir`` for a new or resumed run of ``job`` (default: a
    :class:`~megatron_lns.runtime.job.LocalJob`; see module doc), and remove how the last
    run there ended."""
    lock = RunDirLock(run_dir, job or LocalJob(), elsewhere)
    lock_run_dir(lock, resume_if_exists)
    forget_how_the_last_run_ended(run_dir)
    return lock


def lock_run_dir(lock: RunDirLock, resume_if_exists: bool) -> None:
    """:func:`claim_run_dir` with a lock of the caller's, touching nothing the last run
    left: for a start that reads it first, to put it back should the start fail
    (``run_claim.py``)."""
    run_dir = lock.path.parent
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create the run directory {run_dir}: {err.strerror}") from None
    if not os.access(run_dir, os.W_OK) or not os.access(run_dir / "checkpoints", os.W_OK):
        raise RunDirError(f"the run directory {run_dir} (or its checkpoints/) is not writable")
    lock.acquire()
    if not resume_if_exists and holds_a_run(run_dir):
        lock.release()
        raise RunDirError(
            f"exp_manager.resume_if_exists=false, but {run_dir} already holds a run: choose "
            "another exp_manager.name or exp_dir, remove it, or set "
            "exp_manager.resume_if_exists=true to continue it"
        )
    if problem := unreplaceable_run_file(run_dir):
        lock.release()
        raise RunDirError(problem)


def forget_how_the_last_run_ended(run_dir: Path) -> None:
    """Remove ``run_status``: how the last run ended is no longer news once a new one has
    started. Call it holding the lock alone, so that a second job of this run directory
    cannot remove the line of the first."""
    (run_dir / RUN_STATUS_FILE).unlink(missing_ok=True)


def unreplaceable_run_file(run_dir: Path) -> str | None:
    """Why a file that the run replaces whole, and cannot do without, could not be
    replaced in ``run_dir`` (a directory there, an immutable or read-only file); None
    when each can. Asked before the run starts, so that it does not train for hours to
    fail on its last write (``run_status``). The files it appends to (``metrics.jsonl``,
    ``run_progress``) are not asked about: a write they refuse costs their records, not
    the run."""
    for name, what in REPLACED_RUN_FILES.items():
        path = run_dir / name
        if path.is_symlink() or not path.exists():  # a link is replaced, not followed
            continue
        if path.is_dir():
            why = "is a directory"
        elif not os.access(path, os.W_OK):
            why = "cannot be replaced (it is read-only or immutable)"
        else:
            continue
        return f"{path} {why}, but the run writes {what} there: move it out of the way"
    return None
