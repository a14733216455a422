"""Where a SLURM submission keeps its files: ``<home>/slurm/<time>/job.sbatch``, and
beside the script the ``job_id`` sbatch gave it.

The home is a training run's directory or preprocessing's ``PREFIX.parts/``. The
submitters write this layout (``cluster/slurm/submit.py``, ``preprocess_job.py``) and
readers find it (``status`` of a run queued but not started, ``cluster/slurm/queued.py``;
:func:`megatron_lns.config.sources.runs_inside`, which counts such a run as one). It is
spelt here once, in the lowest layer that reads it, so that they cannot disagree.
"""

from __future__ import annotations

from pathlib import Path

# The folder of a home's submissions, one folder per submission below it.
SUBMISSIONS_DIR = "slurm"
SCRIPT_FILE = "job.sbatch"
# The job id sbatch gave a submission, written once sbatch accepted it.
JOB_ID_FILE = "job_id"


def new_submission_dir(home: Path, stamp: str) -> Path:
    """``home/slurm/<stamp>``, or ``<stamp>.2``, ``.3``, ... when taken: resubmitting
    within the same second never overwrites an earlier submission's script."""
    folder = home / SUBMISSIONS_DIR / stamp
    suffix = 1
    while folder.exists():
        suffix += 1
        folder = folder.with_name(f"{stamp}.{suffix}")
    return folder


def submission_scripts(home: Path) -> list[Path]:
    """The batch script of each of ``home``'s submissions, oldest first (the folders are
    named by their time)."""
    return sorted((home / SUBMISSIONS_DIR).glob(f"*/{SCRIPT_FILE}"))
