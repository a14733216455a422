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
rename already done is skipped, so finishing twice is harmless.

Rank 0 alone moves (the trainer makes the other ranks wait); nothing here needs torch.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

ABANDONED_PREFIX = "abandoned-"
JOURNAL = "moving.json"
_CHECKPOINT_ENTRY = re.compile(r"^iter_(\d{7})(\.partial)?$")


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


def _new_abandoned_dir(checkpoint_dir: Path, resumed_name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        suffix = f"-{attempt}" if attempt else ""
        path = checkpoint_dir / f"{ABANDONED_PREFIX}{stamp}-from-{resumed_name}{suffix}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name for {path}")


def _write_journal(abandoned: Path, names: list[str]) -> None:
    temporary = abandoned / (JOURNAL + ".tmp")
    temporary.write_text(json.dumps({"move": names}) + "\n")
    os.replace(temporary, abandoned / JOURNAL)


def _move(checkpoint_dir: Path, abandoned: Path, names: list[str]) -> None:
    """Move what the journal lists (what is still there), then end the journal."""
    for name in names:
        source = checkpoint_dir / name
        if source.exists():
            source.rename(abandoned / name)
    (abandoned / JOURNAL).unlink()


def set_aside_newer_checkpoints(
    checkpoint_dir: Path, resumed_name: str, resumed_step: int
) -> str | None:
    """Move the checkpoints newer than ``resumed_step`` aside (module doc); one line
    saying which and where, or None when there are none."""
    names = newer_checkpoints(checkpoint_dir, resumed_step)
    if not names:
        return None
    abandoned = _new_abandoned_dir(checkpoint_dir, resumed_name)
    _write_journal(abandoned, names)
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
        names = json.loads(journal.read_text())["move"]
        _move(checkpoint_dir, abandoned, names)
        notes.append(
            f"note: finished moving {', '.join(names)} aside to {abandoned} (the run that "
            "started the move was stopped during it)"
        )
    return notes
