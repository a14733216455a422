"""Handing a batch script to sbatch: the one step of every submission (training's
``submit``, ``preprocess ... --submit``), so that what a refused one leaves behind cannot
differ between them. It leaves nothing: the submission's folder and every directory
written for it are removed, and the user reads one line with what sbatch said. A
SIGTERM or SIGHUP (a closed terminal) while sbatch runs takes the submission back as
Ctrl-C does, then ends the command as the signal would have."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_lns.base.errors import UserError
from megatron_lns.base.signal_handlers import handled
from megatron_lns.config.submission_layout import JOB_ID_FILE, SCRIPT_FILE


class SubmitError(UserError, RuntimeError):
    """sbatch is missing or refused the job; the message is one line."""


class _Stopped(BaseException):
    """A stop signal during the submission, raised so that the rollback runs first."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise SubmitError(
            "sbatch not found on PATH: submit from a SLURM login node (--dry-run prints the "
            "script without submitting)"
        )


def submit_script(
    folder: Path,
    script: str,
    workdir: Path,
    log_dir: Path,
    beside: Mapping[str, str] | None = None,
) -> str:
    """Write ``script`` as ``folder/job.sbatch`` (with the files ``beside`` it, by name),
    make ``log_dir`` for SLURM's output, and sbatch it from ``workdir``; the job id, which
    is kept in ``folder/job_id``. ``folder`` is this submission's own, so must not exist
    (:func:`~megatron_lns.config.submission_layout.new_submission_dir` names one).

    If anything fails before sbatch accepts the job (above all sbatch refusing it), the
    disk is left as it was: ``folder``, once this call has made it, and each directory
    made above it or for the logs, are removed, and the error goes on. A ``folder`` that
    is there already (a submission of the same second) is another's, and stays."""
    require_sbatch()
    # Not one the user has ignored (nohup ignores SIGHUP).
    stops = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN]
    try:
        with handled(stops, _stop):
            return _submit(folder, script, workdir, log_dir, beside)
    except _Stopped as stop:  # rolled back; now what the signal does by default
        signal.raise_signal(stop.signum)
        name = signal.Signals(stop.signum).name
        raise SubmitError(f"{name} while sbatch ran: the submission was taken back") from None


def _submit(
    folder: Path, script: str, workdir: Path, log_dir: Path, beside: Mapping[str, str] | None
) -> str:
    made = _missing_directories(folder.parent, log_dir)
    owned = False
    try:
        try:
            folder.mkdir(parents=True)  # FileExistsError where another submission made it
            owned = True
            _write_files(folder, script, log_dir, beside)
        except OSError as err:
            raise SubmitError(f"cannot write {folder}: {err.strerror or err}") from err
        printed = _sbatch(folder / SCRIPT_FILE, workdir)
    except BaseException:
        if owned:
            shutil.rmtree(folder, ignore_errors=True)
        for directory in made:  # the deepest first; one something else wrote to stays
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    if (job_id := _job_id(printed)) is None:  # accepted: what it wrote stays for the job
        shown = " ".join(printed.split())[:200] or "nothing"
        raise SubmitError(
            f"sbatch accepted {folder / SCRIPT_FILE} but printed no job id ({shown}): squeue "
            "shows whether the job is queued"
        )
    (folder / JOB_ID_FILE).write_text(f"{job_id}\n")
    return job_id


def write_script(
    folder: Path, script: str, log_dir: Path, beside: Mapping[str, str] | None = None
) -> None:
    """What :func:`submit_script` writes before it runs sbatch (the tests read it)."""
    folder.mkdir(parents=True)
    _write_files(folder, script, log_dir, beside)


def _write_files(
    folder: Path, script: str, log_dir: Path, beside: Mapping[str, str] | None
) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (beside or {}).items():
        (folder / name).write_text(text)
    path = folder / SCRIPT_FILE
    path.write_text(script)
    path.chmod(0o755)


def _missing_directories(*paths: Path) -> list[Path]:
    """Each of ``paths`` and its parents that does not exist yet, the deepest first."""
    missing = set()
    for path in paths:
        while not path.exists():
            missing.add(path)
            path = path.parent
    return sorted(missing, key=lambda path: len(path.parts), reverse=True)


def _sbatch(script_path: Path, workdir: Path) -> str:
    """``sbatch`` a written script from ``workdir``; what it printed (a refusal is one
    line)."""
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
    return result.stdout


def _job_id(printed: str) -> str | None:
    """The id on sbatch --parsable's last line (``<id>`` or ``<id>;<cluster>``), which a
    site's wrapper of sbatch may precede with lines of its own; None without one."""
    lines = printed.strip().splitlines()
    job_id = lines[-1].split(";")[0].strip() if lines else ""
    return job_id if job_id.isdigit() else None
