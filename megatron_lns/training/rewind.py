"""Setting aside the checkpoints of an abandoned branch when a run resumes from an older one.

A run with ``iter_2``, ``iter_4`` and ``iter_6`` that resumes from ``iter_2`` (with
``exp_manager.resume_from_checkpoint``, or past an unreadable newest one) trains a new
branch. Left in place, the old ``iter_4`` and ``iter_6`` would be overwritten one by one
by the new branch's saves, or, where the new branch saves at other steps or stops early,
picked by the next plain resume: a run mixing two branches. So before the new branch
writes anything, every checkpoint newer than the resumed step (and any ``.partial`` save
newer than it) moves into ``checkpoints/abandoned-<time>-from-iter_0000002/``, which no
resume, export or batch script looks into, and nothing ever deletes.

The move is crash-safe by a journal: ``moving.json`` (written atomically inside the new
directory) lists what is to move before anything moves, and is removed once everything
has. A run that starts while a journal exists (the previous one died mid-move) finishes
the move before it chooses its checkpoint (:func:`finish_interrupted_moves`), so a resume
never sees half of an abandoned branch. Renames within ``checkpoints/`` are atomic, and a
rename already done is skipped, so finishing twice is harmless. A disk too full for the
journal or the record undoes the rewind whole before anything moves (one line, a
``DiskFullError``): the same command sets the checkpoints aside once space is freed.

Checkpoints are told apart by content, never by path or modification time, which a copy
of the run directory (``cp -r`` without ``-p``, to another place) changes: each one's
``complete.json`` holds an ``id`` drawn when it was committed (:data:`CHECKPOINT_ID`).

A rewind asked for with ``exp_manager.resume_from_checkpoint`` starts its branch once.
The setting stays in the command, so a SLURM requeue or a rerun after a crash asks for
the same rewind again; done again, it would set the branch's own progress aside and
restart from the same step every time. So rank 0 records each run started from
``resume_from_checkpoint`` in ``checkpoints/rewind.json`` (:class:`RewindRecord`: the
checkpoint, resolved, and its id, the abandoned directory, the time, and the complete
checkpoints newer than it that were there, which the rewind moves aside), written
atomically before anything moves. A later run asked for the same checkpoint (the same id;
the same path for one without), in a run directory that has complete checkpoints newer
than it that the record does not list (the branch's), continues from the newest of them
as a plain resume does
(:func:`branch_to_continue`), and says so in one line naming the record; to rewind to the
same checkpoint again, remove the record. Only the latest explicit start is recorded, so
a rewind to another checkpoint is never taken for a requeue, and a checkpoint of another
run directory is matched by its resolved path like any other. A fork from another run
(nothing to move) or from this run's newest checkpoint is recorded too: its requeue
would otherwise set its own branch aside the same way.

Rank 0 alone writes and moves (the trainer makes the other ranks wait); every rank reads
the record and lists the checkpoints before any rank writes, so all choose the same
checkpoint. Nothing here needs torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.base.disk import WriteError, disk_full_reported, write_text_atomically
from megatron_lns.base.errors import UserError
from megatron_lns.training.checkpoint_dirs import COMPLETE_MARKER, MarkerError, read_marker

ABANDONED_PREFIX = "abandoned-"
JOURNAL = "moving.json"
RECORD = "rewind.json"
_CHECKPOINT_ENTRY = re.compile(r"^iter_(\d{7})(\.partial)?$")
# The key of a checkpoint's id in its complete.json: drawn at its commit, kept by copies.
CHECKPOINT_ID = "id"


def new_checkpoint_id() -> str:
    return uuid.uuid4().hex


def checkpoint_id(checkpoint: Path) -> str | None:
    """The id in ``checkpoint``'s complete.json; None for one written before ids were."""
    try:
        found = read_marker(checkpoint).get(CHECKPOINT_ID)
    except MarkerError:
        return None
    return found if isinstance(found, str) else None


def newer_checkpoints(checkpoint_dir: Path, resumed_step: int) -> list[str]:
    """The checkpoint directories under ``checkpoint_dir`` newer than ``resumed_step``,
    newest first: complete ones, and the ``.partial`` ones with them (a ``.partial`` one
    alone is an interrupted save of this branch's future, which its save replaces)."""
    if not checkpoint_dir.is_dir():
        return []
    newer = []
    for entry in checkpoint_dir.iterdir():
        match = _CHECKPOINT_ENTRY.match(entry.name)
        if match and entry.is_dir() and int(match.group(1)) > resumed_step:
            newer.append((int(match.group(1)), entry.name))
    if not any(not name.endswith(".partial") for _, name in newer):
        return []
    return [name for _, name in sorted(newer, reverse=True)]


# What a rewind that the disk refused leaves (``set_aside_newer_checkpoints``).
_NOTHING_MOVED = "; nothing was moved, a rerun sets the newer checkpoints aside once space is freed"


def _new_abandoned_dir(checkpoint_dir: Path, resumed_name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        suffix = f"-{attempt}" if attempt else ""
        path = checkpoint_dir / f"{ABANDONED_PREFIX}{stamp}-from-{resumed_name}{suffix}"
        try:
            with disk_full_reported(path, then=_NOTHING_MOVED):
                path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name for {path}")


def _write_journal(abandoned: Path, names: list[str]) -> None:
    write_text_atomically(abandoned / JOURNAL, json.dumps({"move": names}) + "\n", _NOTHING_MOVED)


class MoveJournalError(UserError, ValueError):
    """A ``moving.json`` that does not say what to move."""


def _read_journal(journal: Path) -> list[str]:
    """The checkpoint names ``journal`` lists (``{"move": ["iter_NNNNNNN", ...]}``); a
    :class:`MoveJournalError` naming it and what is wrong with it otherwise."""
    try:
        names = json.loads(journal.read_text())["move"]
        problem = None
        if not isinstance(names, list):
            problem = 'has a "move" that is not a list of checkpoint names'
        elif bad := [n for n in names if not isinstance(n, str) or not _CHECKPOINT_ENTRY.match(n)]:
            problem = f"lists {bad[0]!r} to move, which is no checkpoint name (iter_NNNNNNN)"
    except OSError as err:
        problem = f"cannot be read ({err.strerror or err})"
    except ValueError as err:  # UnicodeDecodeError too
        problem = f"is not valid JSON ({str(err).splitlines()[0]})"
    except (KeyError, TypeError):
        problem = 'has no "move" list'
    if problem is None:
        return names
    resumed = re.search(r"-from-(iter_\d{7})", journal.parent.name)
    step = resumed.group(1) if resumed else "the checkpoint resumed from"
    raise MoveJournalError(
        f"the journal {journal} of an interrupted move of checkpoints {problem}: move the "
        f"checkpoints newer than {step} from {journal.parent.parent} into {journal.parent} "
        "yourself, then remove the journal"
    )


def _move(checkpoint_dir: Path, abandoned: Path, names: list[str]) -> None:
    """Move what the journal lists (what is still there), then end the journal."""
    for name in names:
        source = checkpoint_dir / name
        if source.exists():
            source.rename(abandoned / name)
    (abandoned / JOURNAL).unlink()


class RewindRecordError(UserError):
    """``rewind.json`` cannot be read."""


@dataclass(frozen=True)
class RewindRecord:
    """The latest run of this run directory started from ``resume_from_checkpoint``."""

    checkpoint: Path  # resolved
    abandoned: Path | None  # where the newer checkpoints went; None when none moved
    time: str  # UTC, for people
    checkpoint_id: str | None = None  # ``checkpoint``'s (None: one without, matched by path)
    # (name, id) of the complete checkpoints newer than ``checkpoint`` there when recorded;
    # None in a record of an older version, whose mtime then says what came after it.
    predating: tuple[tuple[str, str | None], ...] | None = None

    @classmethod
    def new(cls, checkpoint: Path, checkpoint_dir: Path, when: str) -> RewindRecord:
        """The record of a start from ``checkpoint`` in ``checkpoint_dir``, now."""
        step = _step(checkpoint) or 0
        newer = [
            entry
            for entry in (sorted(checkpoint_dir.iterdir()) if checkpoint_dir.is_dir() else [])
            if (_step(entry) or -1) > step and (entry / COMPLETE_MARKER).is_file()
        ]
        return cls(
            checkpoint.resolve(),
            None,
            when,
            checkpoint_id(checkpoint),
            tuple((entry.name, checkpoint_id(entry)) for entry in newer),
        )

    def names(self, requested: Path) -> bool:
        """Whether ``requested`` is the recorded checkpoint: the same id, wherever it
        lies now; the same path for a checkpoint without one."""
        if self.checkpoint_id is not None:
            return checkpoint_id(requested) == self.checkpoint_id
        return self.checkpoint == requested.resolve()

    @staticmethod
    def path(checkpoint_dir: Path) -> Path:
        return checkpoint_dir / RECORD

    @classmethod
    def read(cls, checkpoint_dir: Path) -> RewindRecord | None:
        path = cls.path(checkpoint_dir)
        if not path.is_file():
            return None
        try:
            fields = json.loads(path.read_text())
            abandoned, predating = fields["abandoned"], fields.get("predating")
            return cls(
                Path(fields["checkpoint"]),
                Path(abandoned) if abandoned else None,
                fields["time"],
                fields.get("checkpoint_id"),
                None if predating is None else tuple((name, id_) for name, id_ in predating),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise RewindRecordError(
                f"cannot read the rewind record {path} ({type(err).__name__}: {err}); remove it "
                "to resume from exp_manager.resume_from_checkpoint as a new rewind"
            ) from None

    def write(self, checkpoint_dir: Path, then: str = "") -> None:
        """Atomically: a reader sees the previous record or this one, never half of one
        (a refused write: :class:`WriteError`, ``then`` saying what that left)."""
        fields = {
            "checkpoint": str(self.checkpoint),
            "abandoned": str(self.abandoned) if self.abandoned else None,
            "time": self.time,
            "checkpoint_id": self.checkpoint_id,
            "predating": None if self.predating is None else [list(p) for p in self.predating],
        }
        write_text_atomically(self.path(checkpoint_dir), json.dumps(fields) + "\n", then)


def _step(checkpoint: Path) -> int | None:
    match = _CHECKPOINT_ENTRY.match(checkpoint.name)
    return int(match.group(1)) if match and not match.group(2) else None


def branch_to_continue(checkpoint_dir: Path, requested: Path, complete: list[Path]) -> list[Path]:
    """The checkpoints of the branch an earlier run started from ``requested`` (module
    doc), newest first, from ``complete`` (this run's complete checkpoints, newest
    first); empty when ``requested`` is to be resumed from (the rewind is new, or its
    branch saved nothing yet)."""
    record = RewindRecord.read(checkpoint_dir)
    step = _step(requested)
    if record is None or step is None or not record.names(requested):
        return []
    newer = [path for path in complete if (_step(path) or -1) > step]
    if record.predating is None:  # a record of an older version: its time tells
        recorded_ns = RewindRecord.path(checkpoint_dir).stat().st_mtime_ns
        return [p for p in newer if (p / COMPLETE_MARKER).stat().st_mtime_ns >= recorded_ns]
    predating = set(record.predating)
    return [p for p in newer if (p.name, checkpoint_id(p)) not in predating]


def continuing_note(checkpoint_dir: Path, resumed: Path) -> str:
    """The line of a run that continues a branch instead of rewinding again."""
    record = RewindRecord.read(checkpoint_dir)
    moved = f" (abandoned checkpoints in {record.abandoned})" if record.abandoned else ""
    return (
        f"the rewind to {record.checkpoint.name} was already done at {record.time}{moved}: "
        f"continuing its branch from {resumed.name}; to rewind to {record.checkpoint.name} "
        f"again, remove {RewindRecord.path(checkpoint_dir)}"
    )


def set_aside_newer_checkpoints(
    checkpoint_dir: Path, resumed_name: str, resumed_step: int, record: RewindRecord | None = None
) -> str | None:
    """Move the checkpoints newer than ``resumed_step`` aside (module doc); one line
    saying which and where, or None when there are none. A run started from
    ``resume_from_checkpoint`` passes its ``record``, written (naming the abandoned
    directory) before anything moves: a run killed before the move ends repeats the
    rewind, since no checkpoint is newer than the record yet. With nothing to move, a
    record of the same checkpoint is kept as it is (the branch's start; a rerun of it
    whose branch saved nothing yet)."""
    names = newer_checkpoints(checkpoint_dir, resumed_step)
    if not names:
        previous = RewindRecord.read(checkpoint_dir) if record is not None else None
        if record is not None and (previous is None or not previous.names(record.checkpoint)):
            record.write(checkpoint_dir)
        return None
    abandoned = _new_abandoned_dir(checkpoint_dir, resumed_name)
    try:  # the record last: none may name a directory that a failure here removes
        _write_journal(abandoned, names)
        if record is not None:
            dataclasses.replace(record, abandoned=abandoned).write(checkpoint_dir, _NOTHING_MOVED)
    except WriteError:
        shutil.rmtree(abandoned)  # its journal at most: the rewind is undone whole
        raise
    _move(checkpoint_dir, abandoned, names)
    return (
        f"resuming from {resumed_name}: moved the newer checkpoints {', '.join(names)} "
        f"aside to {abandoned} (kept, never deleted; no resume picks them)"
    )


def finish_interrupted_moves(checkpoint_dir: Path) -> list[str]:
    """Finish every move a killed run left half done (a journal still there); one line
    for each."""
    if not checkpoint_dir.is_dir():
        return []
    notes = []
    for abandoned in sorted(checkpoint_dir.glob(ABANDONED_PREFIX + "*")):
        journal = abandoned / JOURNAL
        if not journal.is_file():
            continue
        names = _read_journal(journal)
        _move(checkpoint_dir, abandoned, names)
        notes.append(
            f"note: finished moving {', '.join(names)} aside to {abandoned} (the run that "
            "started the move was stopped during it)"
        )
    return notes
