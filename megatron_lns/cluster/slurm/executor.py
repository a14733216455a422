"""SLURM as a cluster backend: an sbatch script, written next to the run and submitted."""

from __future__ import annotations

from pathlib import Path

from megatron_lns.cluster.executor import Executor
from megatron_lns.cluster.slurm.submit import (
    PreparedJob,
    SubmittedJob,
    prepare_job,
    submit_job,
)
from megatron_lns.config import ExperimentConfig


class SlurmExecutor(Executor[PreparedJob]):
    def prepare(self, cfg: ExperimentConfig, workdir: Path, python: str) -> PreparedJob:
        return prepare_job(cfg, workdir, python)

    def dry_run_text(self, job: PreparedJob) -> str:
        return job.script

    def submit(self, job: PreparedJob) -> SubmittedJob:
        return submit_job(job)
