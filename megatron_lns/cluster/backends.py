"""The cluster backends, by name: how each submits a job, and how a process knows it runs in one.

A backend is a subpackage of :mod:`megatron_lns.cluster` with an
:class:`~megatron_lns.cluster.executor.Executor` (what ``submit`` asks of it) and a
:class:`~megatron_lns.runtime.job.JobEnvironment` (what the trainer asks of the job it
runs in), registered here (``docs/design.md``, "The cluster-backend seam").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_lns.cluster.executor import Executor
from megatron_lns.cluster.slurm.environment import SlurmEnvironment
from megatron_lns.cluster.slurm.executor import SlurmExecutor
from megatron_lns.runtime.job import JobEnvironment


@dataclass(frozen=True)
class Backend:
    executor: Callable[[], Executor[Any]]
    # The job this process runs in, read from the environment its scheduler sets (None:
    # no job of this backend's).
    job_of_this_process: Callable[[Mapping[str, str]], JobEnvironment | None]


BACKENDS: dict[str, Backend] = {
    "slurm": Backend(executor=SlurmExecutor, job_of_this_process=SlurmEnvironment.of_this_process),
}

# The backend ``submit`` hands jobs to: the config's ``cluster:`` section holds its
# settings. A second backend that ``submit`` can use adds a config key choosing it.
SUBMITS_TO = "slurm"
