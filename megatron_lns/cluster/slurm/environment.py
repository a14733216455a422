"""A run inside a SLURM job, as the trainer sees it: a SLURM :class:`JobEnvironment`.

The job's identity comes from SLURM's variables (:mod:`.job`); the run directory's lock
records it, and a lock another host left is stale when an earlier run of this same job
wrote it (SLURM requeued the job) or SLURM no longer runs the job that wrote it (asked
with ``squeue``). The time a run is given and the progress records are the batch
script's (:mod:`.progress`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lns.cluster.slurm import job as slurm_job
from megatron_lns.cluster.slurm.job import GONE, LIVE_STATES, SlurmJob, SlurmQueryError
from megatron_lns.cluster.slurm.progress import BATCH_START_ENV, ProgressRecorder, time_limit
from megatron_lns.runtime.job import ForeignLock, JobEnvironment, ProgressSettings

# The key of the lock's JSON that holds the job (SlurmJob.record()).
LOCK_KEY = "slurm"


@dataclass(frozen=True)
class SlurmEnvironment(JobEnvironment):
    """Run ``job.restart_count`` of SLURM job ``job``; ``job_state`` asks SLURM for another
    job's state (:func:`.job.job_state`; tests fake it)."""

    job: SlurmJob
    job_state: Callable[[str], str] = field(default=slurm_job.job_state, compare=False)

    @classmethod
    def of_this_process(
        cls,
        env: Mapping[str, str] = os.environ,
        job_state: Callable[[str], str] = slurm_job.job_state,
    ) -> SlurmEnvironment | None:
        """The job this process runs in (None outside SLURM: no ``SLURM_JOB_ID``)."""
        job = SlurmJob.of_this_process(env)
        return None if job is None else cls(job, job_state)

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def restart_count(self) -> int:
        return self.job.restart_count

    def lock_record(self) -> dict[str, object]:
        return {LOCK_KEY: self.job.record()}

    def judge_foreign_lock(self, holder: dict) -> ForeignLock:
        theirs = SlurmJob.from_record(holder.get(LOCK_KEY))
        if theirs is None or theirs.cluster != self.job.cluster:
            # Not both SLURM jobs of one cluster: the host and pid are all we know.
            return ForeignLock()
        job, host = theirs.job_id, holder.get("host")
        if job == self.job.job_id:
            if theirs.restart_count < self.job.restart_count:
                return ForeignLock(
                    stale=f"run {theirs.restart_count} of this SLURM job {job} left it on "
                    f"{host}, and SLURM has requeued the job since (this is run "
                    f"{self.job.restart_count})"
                )
            if theirs.run_and_attempt < self.job.run_and_attempt:
                return ForeignLock(
                    stale=f"attempt {theirs.attempt} of this SLURM job {job} (run "
                    f"{theirs.restart_count}) left it on {host}, and the batch script has "
                    f"restarted the ranks in-job since (this is attempt {self.job.attempt})"
                )
            return ForeignLock(held_by=f" (this SLURM job {job}, run {theirs.restart_count})")
        try:
            state = self.job_state(job)
        except SlurmQueryError as err:
            return ForeignLock(
                held_by=f" (SLURM job {job}; cannot ask SLURM whether it still runs: {err})"
            )
        if state in LIVE_STATES:
            return ForeignLock(held_by=f" (SLURM job {job}, {state})")
        ended = "no longer known to SLURM" if state == GONE else f"{state}, no longer running"
        return ForeignLock(stale=f"SLURM job {job}, which took it on {host}, is {ended}")

    def time_limit_s(self, configured: float | None) -> float | None:
        return time_limit(configured)

    def attempt_started_at(self) -> float:
        """The batch script's start (a container's start counts as start-up); this
        process's start under ``srun`` by hand."""
        batch_start = os.environ.get(BATCH_START_ENV, "").strip()
        return float(batch_start) if batch_start.isdigit() else super().attempt_started_at()

    def progress_records(
        self, run_dir: Path, settings: ProgressSettings
    ) -> ProgressRecorder | None:
        """The batch script's progress guard (under it only: ``srun`` by hand in an
        allocation has no requeue protocol)."""
        return ProgressRecorder.for_job(self.job, run_dir, settings)
