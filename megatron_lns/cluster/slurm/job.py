"""The SLURM job this process runs in, and whether SLURM still runs another one.

The run directory's lock (``training/run_dir.py``) records the job that took it (through
:mod:`.environment`), so that a later job can tell a lock left behind by a killed job (an
earlier run or in-job attempt of the same job, or a job SLURM has ended) from the lock of
a live job, whichever host each ran on: a pid says nothing about a process on another
host.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_lns.runtime.fault_injection import attempt

# The states in which a job's processes may still exist (and write into its run directory).
LIVE_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING"})
# What job_state says of a job SLURM no longer knows (ended longer ago than MinJobAge).
GONE = "GONE"
QUERY_TIMEOUT_S = 60


class SlurmQueryError(Exception):
    """SLURM could not be asked about a job (no squeue here, no controller answering)."""


@dataclass(frozen=True)
class SlurmJob:
    """One run of a SLURM job: its id, how often SLURM had requeued it before this run,
    and the batch script's in-job restart within the run (``attempt``)."""

    job_id: str
    restart_count: int = 0
    cluster: str | None = None
    attempt: int = 0

    @classmethod
    def of_this_process(cls, env: Mapping[str, str] = os.environ) -> SlurmJob | None:
        """The job this process runs in (None outside SLURM)."""
        job_id = env.get("SLURM_JOB_ID", "").strip()
        if not job_id:
            return None
        restarts = env.get("SLURM_RESTART_COUNT", "0").strip()
        return cls(
            job_id,
            int(restarts) if restarts.isdigit() else 0,
            env.get("SLURM_CLUSTER_NAME") or None,
            attempt(env),
        )

    @classmethod
    def from_record(cls, record: object) -> SlurmJob | None:
        """The job :meth:`record` wrote (None for anything else: an older lock, no SLURM)."""
        if not isinstance(record, dict) or not isinstance(record.get("job_id"), str):
            return None
        restarts, cluster = record.get("restart_count", 0), record.get("cluster")
        attempt = record.get("attempt", 0)
        return cls(
            record["job_id"],
            restarts if isinstance(restarts, int) else 0,
            cluster if isinstance(cluster, str) else None,
            attempt if isinstance(attempt, int) else 0,
        )

    def record(self) -> dict[str, object]:
        """The lock's record of this run; ``attempt`` only after an in-job restart."""
        record = {"job_id": self.job_id, "restart_count": self.restart_count}
        record["cluster"] = self.cluster
        if self.attempt:
            record["attempt"] = self.attempt
        return record

    @property
    def run_and_attempt(self) -> tuple[int, int]:
        """Later runs and in-job restarts of one job compare greater."""
        return self.restart_count, self.attempt


def job_state(job_id: str) -> str:
    """SLURM's state of ``job_id`` (``RUNNING``, ``PENDING``, ``CANCELLED``, ...), or
    :data:`GONE` when SLURM no longer knows it; :class:`SlurmQueryError` when SLURM cannot
    be asked (compute nodes running jobs in a container often have no ``squeue``)."""
    try:
        result = subprocess.run(
            ["squeue", "--noheader", "--states=all", "--jobs", job_id, "--format", "%T"],
            capture_output=True,
            text=True,
            timeout=QUERY_TIMEOUT_S,
        )
    except FileNotFoundError:
        raise SlurmQueryError("squeue is not installed here") from None
    except subprocess.TimeoutExpired:
        raise SlurmQueryError(f"squeue did not answer within {QUERY_TIMEOUT_S} s") from None
    if result.returncode == 0:
        states = result.stdout.split()
        live = [state for state in states if state in LIVE_STATES]
        return (live or states or [GONE])[0]
    if "invalid job id" in result.stderr.lower():
        return GONE
    raise SlurmQueryError("squeue failed: " + (" ".join(result.stderr.split()) or "no message"))
