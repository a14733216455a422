"""The job a training run belongs to, as the trainer needs to know it, whoever scheduled it.

A run is started by hand (``megatron-lns train``, torchrun) or by a cluster scheduler that
may stop, restart and requeue it. What the trainer must learn of that job is the same for
every scheduler and sits behind :class:`JobEnvironment`:

- its identity: the job's id, how often the scheduler restarted it, the host;
- what the run directory's lock records of it, and whether a lock left on *another host*
  is stale (a pid means nothing there: only the scheduler can say that job has ended);
- the time the job is given (a time slice's length), where the scheduler sets one;
- which signals ask for a checkpoint and a clean stop;
- the records a scheduler's launcher reads between runs (progress across requeues);
- when this attempt of the run started, as its launcher saw it, from which the trainer's
  accounting of the run's wall time (``training/goodput.py``) measures its start-up.

:class:`LocalJob` is a run that no scheduler watches. Cluster backends implement the rest
(``megatron_lns/cluster/<backend>/job.py``) and the command that starts a run chooses one
(``megatron_lns.cluster.job_of_this_process``): ``training/`` never knows which.
Torch-free, so that ``submit`` on a login node can import the backends.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from megatron_lns.runtime.fault_injection import attempt
from megatron_lns.runtime.progress_file import LOCAL_JOB_ID

# SIGUSR1 is what schedulers send ahead of a time limit or pre-emption (SLURM's
# ``--signal``); a second SIGINT interrupts at once (the trainer's stop request).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@dataclass(frozen=True)
class ForeignLock:
    """The verdict on a run-directory lock another host left: ``stale`` says why it may be
    taken over (empty: it may not, or nobody can tell); ``held_by`` is what the refusal
    adds about its job (`` (SLURM job 40, RUNNING)``)."""

    stale: str = ""
    held_by: str = ""


@dataclass(frozen=True)
class ProgressSettings:
    """What a progress record judges a run's time slices by (``cluster.*`` and the
    checkpoint interval of the config)."""

    lead_s: float  # seconds between the stop warning and the time limit
    time_limit_s: float | None  # the job's: JobEnvironment.time_limit_s
    every: int  # every_n_train_steps
    async_save: bool


class ProgressRecords(Protocol):
    """Rank 0's records of a run for whatever restarts it (a batch script's progress guard).

    Each method returns lines for the run's log: warnings about the time it is given, or
    one line saying the records cannot be written (that costs the records, not the run)."""

    def resumed(self, step: int) -> list[str]:
        """The first step is about to start, from ``step`` (0: a fresh start)."""
        ...

    def step_done(self, seconds: float) -> None: ...

    def committed(self, step: int, save_s: float) -> list[str]:
        """A checkpoint of ``step`` was committed after ``save_s`` seconds of saving."""
        ...


def process_start_time() -> float:
    """Epoch seconds at which this process started (Linux's ``/proc``), so that the
    imports before any of our code runs count as start-up; now, where ``/proc`` cannot
    tell."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class JobEnvironment(ABC):
    """The job this process runs in (module doc). Picklable: local ranks receive it."""

    @property
    @abstractmethod
    def job_id(self) -> str | None:
        """The scheduler's id of the job (None: no scheduler runs it)."""

    @property
    def restart_count(self) -> int:
        """How often the scheduler restarted (requeued) the job before this run."""
        return 0

    @property
    def in_job_restart(self) -> int:
        """Which in-job restart of this run this process belongs to (0: the first start):
        ``MEGATRON_LNS_ATTEMPT``, set by the launcher that restarts the ranks after a dead
        or hung one (``runtime/restarts.py``). With :attr:`restart_count` it names an
        attempt in the run's records."""
        return attempt()

    @property
    def host(self) -> str:
        return socket.gethostname()

    @property
    def record_id(self) -> str:
        """The job as the run's records (``run_progress``) name it: the scheduler's id, or
        ``local``; with :attr:`restart_count` it names an attempt of a scheduled job."""
        return self.job_id or LOCAL_JOB_ID

    def attempt_started_at(self) -> float:
        """Epoch seconds at which this attempt of the run started, as its launcher saw it
        (a batch script's start, the container's included): the start of its start-up.
        By default, this process's start."""
        return process_start_time()

    def lock_record(self) -> dict[str, object]:
        """What the run directory's lock records of this job, beside pid, host and start."""
        return {}

    def judge_foreign_lock(self, holder: dict) -> ForeignLock:
        """Whether the lock ``holder`` (a lock's JSON) that another host wrote is stale.
        Without a scheduler to ask, nobody can tell: the lock stands."""
        return ForeignLock()

    def time_limit_s(self, configured: float | None) -> float | None:
        """Seconds this run is given (None: no limit): the scheduler's, or ``configured``."""
        return configured

    def stop_signals(self) -> tuple[signal.Signals, ...]:
        """The signals that ask for a checkpoint and a clean exit at the next step."""
        return STOP_SIGNALS

    def progress_records(self, run_dir: Path, settings: ProgressSettings) -> ProgressRecords | None:
        """Rank 0's records for the scheduler's launcher (None: it reads none)."""
        return None


@dataclass(frozen=True)
class LocalJob(JobEnvironment):
    """A run that no scheduler watches: ``megatron-lns train`` or torchrun by hand, the
    ranks of ``compare``, tests. Its lock is judged by its process alone. ``started_at``:
    the start of the process that made it (the launcher of local ranks, which receive it
    pickled), so that spawning the ranks counts as start-up."""

    started_at: float = field(default_factory=process_start_time, compare=False)

    @property
    def job_id(self) -> str | None:
        return None

    def attempt_started_at(self) -> float:
        """The launcher's start for the first attempt; a rank's own start for an in-job
        restart (the launcher spawned it then: the time before is the restart's)."""
        return self.started_at if self.in_job_restart == 0 else process_start_time()
