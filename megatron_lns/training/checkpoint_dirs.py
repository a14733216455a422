"""Where checkpoints live and which of them count.

Layout under the experiment directory::

    checkpoints/iter_0000100/           a complete checkpoint
        (dist_checkpointing shards)     model, optimizer, scheduler, RNG, data position
        config.yaml                     the resolved experiment config
        complete.json                   written last: the commit marker, with the
                                        identity of the data trained on (``DATA``)
    checkpoints/iter_0000200.partial/   a save in progress (or one that was killed)

Only a directory with the marker counts (``checkpoint_io.commit`` writes it last), so a
killed save is never resumed from. Torch-free: listing checkpoints needs no model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lns.base.errors import UserError

CHECKPOINT_DIR_RE = re.compile(r"^iter_(\d{7})$")
COMPLETE_MARKER = "complete.json"
# Set in the marker of a checkpoint that holds model weights only (``import-hf`` writes
# them): training starts from it with a fresh optimizer and schedule.
WEIGHTS_ONLY = "weights_only"
# The marker's record of the data a run trained on: ``model.data.data_prefix`` entry ->
# ``data.metadata.dataset_identity`` of its files (``data_change.py``).
DATA = "data"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, partial, or does not fit this run."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint whose tensors are not this model's (one more or one less)."""


class ArchitectureMismatchError(CheckpointMismatchError):
    """A checkpoint of another architecture (GPT, hybrid, another hybrid pattern); the
    message says which setting to change."""


class MarkerError(CheckpointError):
    """A commit marker that cannot be read as the JSON object it is; ``problem`` says
    why in a few words (``is not valid JSON (...)``), the message names the file too."""

    def __init__(self, marker: Path, problem: str) -> None:
        super().__init__(f"{marker} {problem}")
        self.problem = problem


@dataclass
class TrainingState:
    """What a checkpoint restores besides weights and optimizer."""

    iteration: int = 0
    consumed_samples: int = 0
    # The identity of the files of each data_prefix entry the run reads (the marker's
    # ``DATA``); empty where none is known (a weights-only checkpoint, a fresh state).
    data: dict[str, str] = field(default_factory=dict)


def checkpoint_path(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


# What megatron's torch_dist format reads before any shard: its own record of the
# format (metadata.json) and torch's index of the shards (.metadata).
DIST_CHECKPOINT_FILES = ("metadata.json", ".metadata")


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a checkpoint that can be loaded, in a few words; None if it is.
    Every command that loads a checkpoint (resume, ``analyze``, ``export-hf``) asks this
    first, so what one refuses no other uses."""
    if not path.is_dir():
        return "does not exist" if not path.exists() else "is a file, not a directory"
    if not (path / COMPLETE_MARKER).is_file():
        if is_checkpoint_dir(path):
            return f"has no {COMPLETE_MARKER}: its save never finished"
        return holds_checkpoints(path) or (
            f"is not a checkpoint (an iter_NNNNNNN directory with {COMPLETE_MARKER})"
        )
    if CHECKPOINT_DIR_RE.match(path.name) is None:
        return "is not an iter_NNNNNNN directory"
    missing = [name for name in DIST_CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        return f"is damaged: {' and '.join(missing)} missing"
    try:
        read_marker(path)
    except MarkerError as err:
        return f"is damaged: {COMPLETE_MARKER} {err.problem}"
    return None


def read_marker(checkpoint: Path) -> dict:
    """The record in ``checkpoint``'s commit marker: its step, data position, data and id.
    Every reader of a marker reads it here, so each takes the same file for damaged; a
    :class:`MarkerError` where it cannot be read. Every version wrote a JSON object, so an
    empty marker is damage too (a file system that lost what a crash had not flushed)."""
    marker = checkpoint / COMPLETE_MARKER
    try:
        text = marker.read_text()
        if not text:
            raise MarkerError(marker, "is empty")
        record = json.loads(text)
    except OSError as err:
        raise MarkerError(marker, f"cannot be read ({err.strerror or err})") from err
    except ValueError as err:  # UnicodeDecodeError too
        raise MarkerError(marker, f"is not valid JSON ({str(err).splitlines()[0]})") from err
    if not isinstance(record, dict):
        raise MarkerError(marker, "is not a JSON object")
    return record


def holds_checkpoints(path: Path) -> str | None:
    """What ``path``, a directory given for one checkpoint, is instead: a run directory or
    its ``checkpoints/``, and which of its checkpoints to give; None for anything else."""
    try:
        entries = [p.name.removesuffix(".partial") for p in path.iterdir()]
    except OSError:
        return None
    if (path / "checkpoints").is_dir():
        what, checkpoints = "a run directory", path / "checkpoints"
    elif any(CHECKPOINT_DIR_RE.match(name) for name in entries):
        what, checkpoints = "a directory of checkpoints", path
    else:
        return None
    newest = latest_complete_checkpoint(checkpoints)
    which = f"the newest complete one is {newest}" if newest else "none is complete"
    return (
        f"is {what}, not a checkpoint: give one of the iter_NNNNNNN directories in "
        f"{checkpoints} ({which})"
    )


def is_complete(path: Path) -> bool:
    return checkpoint_problem(path) is None


def checkpoint_step(path: Path) -> int:
    """The step an ``iter_NNNNNNN`` directory holds."""
    return int(CHECKPOINT_DIR_RE.match(path.name).group(1))


def is_checkpoint_dir(path: Path) -> bool:
    """A checkpoint, complete or not (``iter_NNNNNNN``, ``iter_NNNNNNN.partial``, or a
    directory with the commit marker under another name)."""
    name = path.name.removesuffix(".partial")
    return CHECKPOINT_DIR_RE.match(name) is not None or (path / COMPLETE_MARKER).is_file()


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The committed checkpoints under ``root`` (with ``complete.json``), newest first;
    partial ones never appear.

    A committed checkpoint that was damaged afterwards (a file deleted) is listed too:
    passing over it would resume from an older one without a word, and the run's next
    save of that step would delete it. Loading it names what it lacks.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    candidates = sorted(
        (p for p in root.iterdir() if p.is_dir() and CHECKPOINT_DIR_RE.match(p.name)),
        key=checkpoint_step,
        reverse=True,
    )
    return [p for p in candidates if (p / COMPLETE_MARKER).is_file()]


def latest_complete_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``; partial ones are never chosen."""
    found = complete_checkpoints(root)
    return found[0] if found else None


def newest_checkpoint_step(root: str | Path) -> int:
    """The step of the newest complete checkpoint under ``root`` (0: none): how far a
    restart resumes from."""
    newest = latest_complete_checkpoint(root)
    return checkpoint_step(newest) if newest else 0
