"""What ``megatron-lns submit`` needs from a cluster backend, and nothing more.

A backend turns a validated config into a job (:meth:`Executor.prepare`: everything
rendered, nothing written), shows that job for ``--dry-run``
(:meth:`Executor.dry_run_text`) and hands it to its scheduler (:meth:`Executor.submit`:
check the scheduler's tools, write the job's files, submit), which returns what the
command prints. The job runs every rank as ``megatron-lns train`` would, through
:func:`megatron_lns.training.entry_point.train`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from megatron_lns.config import ExperimentConfig


class Submission(Protocol):
    """A job that the scheduler accepted."""

    @property
    def job_id(self) -> str: ...

    def report(self) -> list[str]:
        """The lines ``submit`` prints: the job id, its script, where its logs go."""
        ...


class Executor[Job](ABC):
    """One cluster backend; ``Job`` is its prepared, not yet submitted, job."""

    @abstractmethod
    def prepare(self, cfg: ExperimentConfig, workdir: Path, python: str) -> Job:
        """The job of ``cfg`` (validated as ``train`` validates it, except what only the
        compute node can check), run in ``workdir`` by ``python``; nothing is written."""

    @abstractmethod
    def dry_run_text(self, job: Job) -> str:
        """What ``submit --dry-run`` prints: the job as the scheduler would get it."""

    @abstractmethod
    def submit(self, job: Job) -> Submission:
        """Write the job's files and submit it. A missing scheduler tool or a refused job
        is a :class:`~megatron_lns.base.errors.UserError` with a one-line message."""
