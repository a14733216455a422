"""A SLURM job: its script and resolved config, written next to the run and handed to sbatch."""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.cluster.slurm.render import JobPaths, render_sbatch, unmounted_workdir_warning
from megatron_lns.cluster.slurm.sbatch import submit_script, write_script
from megatron_lns.config import ExperimentConfig, to_yaml
from megatron_lns.config.cluster import job_name
from megatron_lns.config.paths import experiments_directory, run_directory
from megatron_lns.config.submission_layout import SCRIPT_FILE, new_submission_dir


@dataclass(frozen=True)
class PreparedJob:
    cfg: ExperimentConfig  # exp_manager.exp_dir made absolute
    paths: JobPaths
    script: str

    @property
    def folder(self) -> Path:
        """This submission's own: ``<run_dir>/slurm/<time>/``."""
        return self.paths.config.parent

    @property
    def script_path(self) -> Path:
        return self.folder / SCRIPT_FILE

    @property
    def beside_script(self) -> dict[str, str]:
        """The files written next to the script, by name: the config every task loads."""
        return {self.paths.config.name: to_yaml(self.cfg)}


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    script_path: Path
    job_log: Path  # SLURM's messages and one line per run, across requeues
    first_run_log: Path  # the first run's full output (requeues: -restart1, -restart2, ...)

    def report(self) -> list[str]:
        return [
            f"submitted job {self.job_id}: {self.script_path}",
            f"job log: {self.job_log}",
            f"run log: {self.first_run_log} (requeues: -restart1, -restart2, ...)",
        ]


def prepare_job(
    cfg: ExperimentConfig, workdir: Path, python: str, stamp: str | None = None
) -> PreparedJob:
    """The script and where everything goes, for a config validated as ``train`` does.

    The job runs in ``workdir`` (so relative paths in the config mean what they meant at
    submit time); exp_manager.exp_dir is made absolute so the logs have a fixed place.
    """
    cfg = copy.deepcopy(cfg)
    workdir = workdir.resolve()
    cfg.exp_manager.exp_dir = str(workdir / experiments_directory(cfg))
    run_dir = run_directory(cfg)
    submit_dir = new_submission_dir(run_dir, stamp or time.strftime("%Y%m%d-%H%M%S"))
    paths = JobPaths(workdir=workdir, run_dir=run_dir, config=submit_dir / "config.yaml")
    if cfg.cluster.container_image:
        python = "python"  # the container's interpreter, with megatron-lns installed
    job = PreparedJob(cfg, paths, render_sbatch(cfg, paths, python))
    if warning := unmounted_workdir_warning(cfg, paths):
        print(f"warning: {warning}", file=sys.stderr)
    return job


def write_job(job: PreparedJob) -> None:
    """What :func:`submit_job` writes, without submitting it."""
    write_script(job.folder, job.script, job.paths.log_dir, job.beside_script)


def submit_job(job: PreparedJob) -> SubmittedJob:
    """Write ``job`` and sbatch it. A refused submission leaves the run directory as it
    was (:func:`~megatron_lns.cluster.slurm.sbatch.submit_script`)."""
    job_id = submit_script(
        job.folder, job.script, job.paths.workdir, job.paths.log_dir, job.beside_script
    )
    name = job_name(job.cfg, job.paths.submission)
    return SubmittedJob(
        job_id=job_id,
        script_path=job.script_path,
        job_log=job.paths.log_dir / f"{name}-{job_id}.log",
        first_run_log=job.paths.log_dir / f"{name}-{job_id}-restart0.log",
    )
