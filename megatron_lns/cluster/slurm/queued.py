"""A run submitted to SLURM that has not started: its run directory holds only what
``submit`` wrote (``slurm/<time>/job.sbatch``, its ``job_id``), no ``config.yaml`` or
``run_progress`` yet. Torch-free: ``megatron-lns status`` reads it on a login node."""

from __future__ import annotations

from pathlib import Path

from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.config.submission_layout import JOB_ID_FILE, submission_scripts
from megatron_lns.runtime.progress_file import RUN_PROGRESS_FILE


def queued_submission(run_dir: Path) -> tuple[Path, str | None] | None:
    """The newest submission's batch script and job id (None where none was recorded) of
    a run submitted but not started; None for any other run. One reading for both of
    ``status``'s forms, so the JSON names the job the text names."""
    if any((run_dir / name).exists() for name in (RUN_CONFIG, RUN_PROGRESS_FILE)):
        return None
    scripts = submission_scripts(run_dir)
    if not scripts:
        return None
    newest = scripts[-1]
    try:
        return newest, (newest.parent / JOB_ID_FILE).read_text().split()[0]
    except (OSError, ValueError, IndexError):  # ValueError: not UTF-8, not written by sbatch
        return newest, None


def not_started_line(run_dir: Path, script: Path, job_id: str | None) -> str:
    """What ``status`` says of a run submitted but not started (:func:`queued_submission`
    gives its ``script`` and ``job_id``)."""
    job = f"SLURM job {job_id}" if job_id else "a SLURM job whose id was not recorded"
    return (
        f"{run_dir}: submitted as {job} ({script}), not started yet "
        "(queued or held: squeue says which)"
    )
