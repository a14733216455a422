"""Cluster backends: how ``megatron-lns submit`` hands a training run to a scheduler, and
what a run inside one of its jobs learns of that job.

:mod:`.executor` is what ``submit`` asks of a backend, :mod:`megatron_lns.runtime.job` what
the trainer asks of the job it runs in; each backend is a subpackage that implements both,
registered in :mod:`.backends`. SLURM (:mod:`.slurm`) is the only one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_lns.cluster.executor import Executor
    from megatron_lns.config import ExperimentConfig
    from megatron_lns.runtime.job import JobEnvironment


def executor_for(cfg: ExperimentConfig) -> Executor[Any]:
    """The backend that submits ``cfg``'s job (:data:`.backends.SUBMITS_TO`)."""
    from megatron_lns.cluster.backends import BACKENDS, SUBMITS_TO

    return BACKENDS[SUBMITS_TO].executor()


def job_of_this_process(env: Mapping[str, str] = os.environ) -> JobEnvironment:
    """The job this process runs in: a registered backend's job where its scheduler
    started the process (SLURM: under ``sbatch`` or ``srun``), else a local run."""
    from megatron_lns.cluster.backends import BACKENDS
    from megatron_lns.runtime.job import LocalJob

    for backend in BACKENDS.values():
        job = backend.job_of_this_process(env)
        if job is not None:
            return job
    return LocalJob()
