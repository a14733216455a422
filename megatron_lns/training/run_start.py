"""What rank 0 does to the run directory before a run writes into it, every rank agreeing.

It locks the directory for the run's job and stores the resolved config
(:func:`claim_run_directory`; the last run's config and status are put back should the
start fail before resume accepts it, ``run_claim.py``), finishes moving checkpoints
aside that a killed run began to move, and, once resume has chosen a checkpoint, sets
aside the checkpoints newer than it (:func:`set_abandoned_branch_aside`, ``rewind.py``).
A failure on rank 0 is raised on every rank, with rank 0's message, so that no rank
waits for the others forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lns.base.disk import WriteError, write_text_atomically
from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.runtime.job import JobEnvironment
from megatron_lns.training.rewind import (
    RewindRecord,
    RewindRecordError,
    continuing_note,
    finish_interrupted_moves,
    set_aside_newer_checkpoints,
)
from megatron_lns.training.run_claim import LastRunFiles, RunClaim
from megatron_lns.training.run_dir import (
    ELSEWHERE,
    RunDirError,
    RunDirLock,
    forget_how_the_last_run_ended,
    lock_run_dir,
)


def _raise_on_every_rank(error: str | None, device: torch.device) -> None:
    shared = [error]
    dist.broadcast_object_list(shared, src=0, device=device)
    if shared[0] is not None:
        raise RunDirError(shared[0])


def claim_run_directory(
    run_dir: Path,
    resume_if_exists: bool,
    config_yaml: str,
    job: JobEnvironment,
    device: torch.device,
    say: Callable[[str], None],
    elsewhere: str = ELSEWHERE,
) -> RunClaim | None:
    """Rank 0 locks ``run_dir`` for ``job`` (None elsewhere); every rank raises the same
    error if it cannot. Whatever fails here releases the lock: one left behind would
    refuse every later run. The claim puts back what the last run left unless it is
    committed once resume has accepted the start (``run_claim.py``)."""
    lock, claim, error = None, None, None
    if dist.get_rank() == 0:
        try:
            lock = RunDirLock(run_dir, job, elsewhere)
            lock_run_dir(lock, resume_if_exists)  # released by it where it refuses
            claim = RunClaim(lock, run_dir, LastRunFiles.read(run_dir), say)
            forget_how_the_last_run_ended(run_dir)
            _prepare_run_dir(run_dir, config_yaml, say)
        except BaseException as err:
            if claim is not None:
                claim.release()  # puts back what the start replaced
            elif lock is not None:
                lock.release()
            claim = None
            if not isinstance(err, (RunDirError, WriteError)):
                raise
            error = str(err)  # raised on every rank, not rank 0 alone
    _raise_on_every_rank(error, device)
    return claim


def _prepare_run_dir(run_dir: Path, config_yaml: str, say: Callable[[str], None]) -> None:
    """Store the config, and finish a move of checkpoints that a killed run began (before
    any rank lists them)."""
    write_text_atomically(run_dir / RUN_CONFIG, config_yaml)
    checkpoint_dir = run_dir / "checkpoints"
    try:
        for note in finish_interrupted_moves(checkpoint_dir):
            say(note)
    except (OSError, ValueError, KeyError) as err:
        raise RunDirError(
            f"cannot finish moving checkpoints aside in {checkpoint_dir}: {err}"
        ) from None


def set_abandoned_branch_aside(
    checkpoint_dir: Path,
    resumed_path: Path | None,
    iteration: int,
    requested: str | None,
    device: torch.device,
    say: Callable[[str], None],
) -> None:
    """Rank 0 moves the checkpoints newer than the resumed one out of resume's way
    (``rewind.py``) before this branch writes anything, and records a start from
    ``requested`` (``resume_from_checkpoint``) so that a rerun continues the branch; the
    other ranks wait."""
    if resumed_path is None:
        return
    record = None
    if requested and Path(requested).resolve() == resumed_path.resolve():
        now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        record = RewindRecord.new(resumed_path, checkpoint_dir, now)
    error = None
    if dist.get_rank() == 0:
        try:
            if requested and record is None:  # continuing the branch of an earlier start
                say(continuing_note(checkpoint_dir, resumed_path))
            note = set_aside_newer_checkpoints(checkpoint_dir, resumed_path.name, iteration, record)
        except (RewindRecordError, WriteError) as err:
            error = str(err)
        except OSError as err:
            error = f"cannot move the checkpoints newer than {resumed_path} aside: {err}"
        else:
            if note is not None:
                say(note)
    _raise_on_every_rank(error, device)
