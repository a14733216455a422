"""A SLURM job: its script and resolved config, written next to the run and handed to sbatch."""

from __future__ import annotations

import contextlib
import copy
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.base.errors import UserError
from megatron_lns.cluster.slurm.render import JobPaths, render_sbatch, unmounted_workdir_warning
from megatron_lns.config import ExperimentConfig, to_yaml
from megatron_lns.config.cluster import job_name
from megatron_lns.config.paths import experiments_directory, run_directory
from megatron_lns.config.submission_layout import JOB_ID_FILE, SCRIPT_FILE, new_submission_dir


class SubmitError(UserError, RuntimeError):
    """sbatch is missing or refused the job; the message is one line."""


@dataclass(frozen=True)
class PreparedJob:
    cfg: ExperimentConfig  # exp_manager.exp_dir made absolute
    paths: JobPaths
    script: str

    @property
    def script_path(self) -> Path:
        return self.paths.config.with_name(SCRIPT_FILE)


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
    job.paths.config.parent.mkdir(parents=True)
    job.paths.log_dir.mkdir(parents=True, exist_ok=True)
    job.paths.config.write_text(to_yaml(job.cfg))
    job.script_path.write_text(job.script)
    job.script_path.chmod(0o755)


def submit_job(job: PreparedJob) -> SubmittedJob:
    """Write ``job`` and sbatch it. A refused submission leaves the run directory as it
    was: its slurm/<time>/ folder, and each directory writing it created, are removed."""
    made = [job.paths.log_dir] if not job.paths.log_dir.exists() else []
    parent = job.paths.config.parent.parent
    while not parent.exists():
        made.append(parent)
        parent = parent.parent
    write_job(job)
    try:
        submitted = sbatch(job)
    except BaseException:
        shutil.rmtree(job.paths.config.parent, ignore_errors=True)
        for directory in made:  # the log folder, then the deepest first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    (job.paths.config.parent / JOB_ID_FILE).write_text(f"{submitted.job_id}\n")
    return submitted


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise SubmitError(
            "sbatch not found on PATH: submit from a SLURM login node (--dry-run prints the "
            "script without submitting)"
        )


def sbatch(job: PreparedJob) -> SubmittedJob:
    """Submit a written job; the job id as sbatch reports it."""
    job_id = run_sbatch(job.script_path, job.paths.workdir)
    name = job_name(job.cfg, job.paths.submission)
    return SubmittedJob(
        job_id=job_id,
        script_path=job.script_path,
        job_log=job.paths.log_dir / f"{name}-{job_id}.log",
        first_run_log=job.paths.log_dir / f"{name}-{job_id}-restart0.log",
    )


def run_sbatch(script_path: Path, workdir: Path) -> str:
    """``sbatch`` a written script from ``workdir``; the job id (a refusal is one line)."""
    result = subprocess.run(
        ["sbatch", "--parsable", str(script_path)],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        message = " ".join(result.stderr.split()) or f"exit status {result.returncode}"
        raise SubmitError(f"sbatch refused {script_path}: {message}")
    return result.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"
