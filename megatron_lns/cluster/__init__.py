"""Cluster backends: how ``megatron-lns submit`` hands a training run to a scheduler.

:mod:`.executor` is what ``submit`` asks of a backend; each backend is a subpackage that
implements it. SLURM (:mod:`.slurm`) is the only one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_lns.cluster.executor import Executor
    from megatron_lns.config import ExperimentConfig


def executor_for(cfg: ExperimentConfig) -> Executor[Any]:
    """The backend that submits ``cfg``'s job: SLURM, the only one. A second backend
    would be chosen here, by a ``cluster.*`` key of its own."""
    from megatron_lns.cluster.slurm.executor import SlurmExecutor

    return SlurmExecutor()
