"""Setting an abandoned branch's checkpoints aside: what moves, and a move cut short;
a rerun of a rewind continues its branch."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from megatron_lns.training import rewind
from megatron_lns.training.rewind import (
    RewindRecord,
    RewindRecordError,
    branch_to_continue,
    continuing_note,
    finish_interrupted_moves,
    newer_checkpoints,
    set_aside_newer_checkpoints,
)


def _run_dir(root: Path, *names: str) -> Path:
    checkpoints = root / "checkpoints"
    for name in names:
        (checkpoints / name).mkdir(parents=True)
        if not name.endswith(".partial"):
            (checkpoints / name / "complete.json").write_text("{}\n")
    return checkpoints


def _listing(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir())


def test_only_the_checkpoints_newer_than_the_resumed_step_move_and_are_kept(tmp_path):
    checkpoints = _run_dir(tmp_path, "iter_0000002", "iter_0000004", "iter_0000006",
                           "iter_0000005.partial", "iter_0000001.partial")  # fmt: skip
    note = set_aside_newer_checkpoints(checkpoints, "iter_0000002", 2)
    [aside] = checkpoints.glob("abandoned-*-from-iter_0000002")
    assert _listing(checkpoints) == [aside.name, "iter_0000001.partial", "iter_0000002"]
    assert _listing(aside) == ["iter_0000004", "iter_0000005.partial", "iter_0000006"]
    assert (aside / "iter_0000006" / "complete.json").is_file()
    assert note.startswith(
        "resuming from iter_0000002: moved the newer checkpoints iter_0000006, "
        f"iter_0000005.partial, iter_0000004 aside to {aside} (kept"
    )
    # Nothing newer: the newest checkpoint, or only an interrupted save past it.
    assert set_aside_newer_checkpoints(checkpoints, "iter_0000002", 2) is None
    (checkpoints / "iter_0000003.partial").mkdir()
    assert newer_checkpoints(checkpoints, 2) == []
    # A second rewind gets a directory of its own, the first is left as it is.
    assert set_aside_newer_checkpoints(checkpoints, "iter_0000001", 1) is not None
    assert len(list(checkpoints.glob("abandoned-*"))) == 2
    assert _listing(aside) == ["iter_0000004", "iter_0000005.partial", "iter_0000006"]


def test_a_move_cut_short_is_finished_before_the_next_resume_looks(tmp_path, monkeypatch):
    checkpoints = _run_dir(tmp_path, "iter_0000002", "iter_0000004", "iter_0000006")
    renames = []

    def die_after_one(self, target):
        if renames:
            raise KeyboardInterrupt  # the process dies between two moves
        renames.append(self)
        return original(self, target)

    original = Path.rename
    monkeypatch.setattr(Path, "rename", die_after_one)
    with pytest.raises(KeyboardInterrupt):
        set_aside_newer_checkpoints(checkpoints, "iter_0000002", 2)
    monkeypatch.setattr(Path, "rename", original)
    # Half moved: the journal says what is still to go.
    [aside] = checkpoints.glob("abandoned-*")
    assert json.loads((aside / rewind.JOURNAL).read_text()) == {
        "move": ["iter_0000006", "iter_0000004"]
    }
    assert "iter_0000004" in _listing(checkpoints)
    [note] = finish_interrupted_moves(checkpoints)
    assert note.startswith("note: finished moving iter_0000006, iter_0000004 aside to")
    assert _listing(checkpoints) == [aside.name, "iter_0000002"]
    assert _listing(aside) == ["iter_0000004", "iter_0000006"]
    assert finish_interrupted_moves(checkpoints) == []


@pytest.mark.parametrize(
    "journal, problem",
    [
        ("{", r"is not valid JSON \(Expecting property name"),
        ('{"mov": []}', 'has no "move" list'),
        ("[1]", 'has no "move" list'),
        ('{"move": "iter_0000004"}', 'has a "move" that is not a list of checkpoint names'),
        (
            '{"move": ["../../elsewhere"]}',
            r"lists '../../elsewhere' to move, which is no checkpoint",
        ),
    ],
)
def test_a_corrupt_move_journal_is_named_with_what_is_wrong(tmp_path, journal, problem):
    """It was ``cannot finish moving checkpoints aside in ...: 'move'`` (a KeyError's text),
    a TypeError's traceback, or a rename of whatever the journal named."""
    checkpoints = _run_dir(tmp_path, "iter_0000002", "iter_0000004")
    aside = checkpoints / "abandoned-20260101-000000-from-iter_0000002"
    aside.mkdir()
    (aside / rewind.JOURNAL).write_text(journal)
    with pytest.raises(rewind.MoveJournalError) as refused:
        finish_interrupted_moves(checkpoints)
    message = str(refused.value)
    assert message.startswith(f"the journal {aside / rewind.JOURNAL} of an interrupted move ")
    assert re.search(problem, message), message
    assert message.endswith(
        f"move the checkpoints newer than iter_0000002 from {checkpoints} into {aside} "
        "yourself, then remove the journal"
    )
    assert "\n" not in message and _listing(checkpoints) == [
        aside.name,
        "iter_0000002",
        "iter_0000004",
    ]


def test_a_checkpoint_of_another_run_is_never_touched(tmp_path):
    """Resuming run B from run A's iter_2 sets aside B's own newer checkpoints only."""
    a = _run_dir(tmp_path / "a", "iter_0000002", "iter_0000004")
    b = _run_dir(tmp_path / "b", "iter_0000006")
    assert set_aside_newer_checkpoints(b, "iter_0000002", 2) is not None
    assert _listing(a) == ["iter_0000002", "iter_0000004"]
    assert [p.name for p in b.glob("iter_*")] == []


def _rewind(checkpoints: Path, name: str) -> RewindRecord:
    """What the trainer does on a start from ``resume_from_checkpoint=<checkpoints>/name``."""
    record = RewindRecord((checkpoints / name).resolve(), None, "2026-12-02 05:00:00 UTC")
    set_aside_newer_checkpoints(checkpoints, name, int(name[5:]), record)
    return RewindRecord.read(checkpoints)


def _save(checkpoints: Path, name: str, seconds_after_record: float) -> None:
    """A complete checkpoint committed that long after the record was written."""
    (checkpoints / name).mkdir()
    marker = checkpoints / name / "complete.json"
    marker.write_text("{}\n")
    recorded = RewindRecord.path(checkpoints).stat().st_mtime
    os.utime(marker, (recorded + seconds_after_record,) * 2)


def _complete(checkpoints: Path) -> list[Path]:
    return sorted(checkpoints.glob("iter_???????"), reverse=True)


def test_a_rerun_of_a_rewind_continues_its_branch_once_it_has_saved(tmp_path):
    checkpoints = _run_dir(tmp_path, "iter_0000002", "iter_0000004", "iter_0000006")
    record = _rewind(checkpoints, "iter_0000002")
    [aside] = checkpoints.glob("abandoned-*")
    assert record.checkpoint == (checkpoints / "iter_0000002").resolve()
    assert record.abandoned == aside
    requested = checkpoints / "iter_0000002"
    # Killed before the branch's first save: resuming from iter_2 again is right.
    assert branch_to_continue(checkpoints, requested, _complete(checkpoints)) == []
    _save(checkpoints, "iter_0000003", 5)
    _save(checkpoints, "iter_0000005", 10)
    assert branch_to_continue(checkpoints, requested, _complete(checkpoints)) == [
        checkpoints / "iter_0000005",
        checkpoints / "iter_0000003",
    ]
    # The same checkpoint named another way is the same rewind.
    relative = Path(os.path.relpath(requested))
    assert branch_to_continue(checkpoints, relative, _complete(checkpoints))[0].name == (
        "iter_0000005"
    )
    assert continuing_note(checkpoints, checkpoints / "iter_0000005") == (
        "the rewind to iter_0000002 was already done at 2026-12-02 05:00:00 UTC (abandoned "
        f"checkpoints in {aside}): continuing its branch from iter_0000005; to rewind to "
        f"iter_0000002 again, remove {checkpoints / 'rewind.json'}"
    )
    # A rerun that moves nothing keeps the record of the branch's start.
    assert set_aside_newer_checkpoints(checkpoints, "iter_0000005", 5, record) is None
    assert RewindRecord.read(checkpoints) == record


def test_a_record_never_turns_another_rewind_into_a_continuation(tmp_path):
    checkpoints = _run_dir(tmp_path / "b", "iter_0000002", "iter_0000004", "iter_0000006")
    _rewind(checkpoints, "iter_0000004")
    _save(checkpoints, "iter_0000005", 5)
    # Another checkpoint of this run: a new rewind, which then replaces the record.
    assert (
        branch_to_continue(checkpoints, checkpoints / "iter_0000002", _complete(checkpoints)) == []
    )
    # A checkpoint of the same name in another run directory is another checkpoint.
    other = _run_dir(tmp_path / "a", "iter_0000004")
    assert branch_to_continue(checkpoints, other / "iter_0000004", _complete(checkpoints)) == []
    # The same one once the record is removed: a new rewind.
    RewindRecord.path(checkpoints).unlink()
    assert (
        branch_to_continue(checkpoints, checkpoints / "iter_0000004", _complete(checkpoints)) == []
    )


def test_checkpoints_older_than_the_record_are_not_the_branch(tmp_path):
    """Killed after writing the record, before the move: the old branch is still there."""
    checkpoints = _run_dir(tmp_path, "iter_0000002", "iter_0000004")
    record = RewindRecord((checkpoints / "iter_0000002").resolve(), None, "then")
    record.write(checkpoints)
    os.utime(checkpoints / "iter_0000004" / "complete.json", (1, 1))
    assert (
        branch_to_continue(checkpoints, checkpoints / "iter_0000002", _complete(checkpoints)) == []
    )


def test_a_rewind_from_another_run_is_recorded_and_continued_like_one_of_this_run(tmp_path):
    """A fork (nothing to move) starts its branch once too; its requeue continues it."""
    a = _run_dir(tmp_path / "a", "iter_0000002", "iter_0000004")
    b = tmp_path / "b" / "checkpoints"
    b.mkdir(parents=True)
    record = RewindRecord((a / "iter_0000002").resolve(), None, "then")
    assert set_aside_newer_checkpoints(b, "iter_0000002", 2, record) is None
    assert RewindRecord.read(b) == record
    _save(b, "iter_0000003", 5)
    assert branch_to_continue(b, a / "iter_0000002", _complete(b)) == [b / "iter_0000003"]
    assert _listing(a) == ["iter_0000002", "iter_0000004"]


def test_an_unreadable_record_is_named(tmp_path):
    checkpoints = _run_dir(tmp_path, "iter_0000002")
    RewindRecord.path(checkpoints).write_text("{")
    with pytest.raises(RewindRecordError, match=r"cannot read the rewind record .*rewind\.json"):
        branch_to_continue(checkpoints, checkpoints / "iter_0000002", _complete(checkpoints))


@pytest.mark.parametrize("full", ["space", "inodes"])
def test_a_rewind_the_full_disk_refuses_is_one_line_and_leaves_nothing_of_it(tmp_path, full):
    """No abandoned directory half made, no journal a later run would finish, no record
    of a rewind that did not happen; once space is freed the same rewind is done."""
    from helpers import fill_leaving, small_filesystem

    from megatron_lns.base.disk import DiskFullError

    with small_filesystem(tmp_path / "disk", 128, inodes=64) as disk:
        checkpoints = _run_dir(disk, "iter_0000002", "iter_0000004", "iter_0000006")
        earlier = RewindRecord((checkpoints / "iter_0000004").resolve(), None, "then")
        earlier.write(checkpoints)
        before = sorted(p.relative_to(disk) for p in disk.rglob("*"))
        (disk / "fillers").mkdir()
        if full == "space":
            fill_leaving(disk / "fillers", 0)
        else:  # every inode taken: not even the abandoned directory can be made
            with pytest.raises(OSError, match="No space left"):
                for i in range(64):
                    (disk / "fillers" / str(i)).touch()
        record = RewindRecord((checkpoints / "iter_0000002").resolve(), None, "now")
        with pytest.raises(DiskFullError) as info:
            set_aside_newer_checkpoints(checkpoints, "iter_0000002", 2, record)
        written = "/moving.json" if full == "space" else ""
        assert re.fullmatch(
            rf"cannot write {re.escape(str(checkpoints))}/abandoned-[-0-9]+-from-iter_0000002"
            rf"{written}: no space left on device \(.*\); nothing was moved, a rerun sets the "
            "newer checkpoints aside once space is freed",
            str(info.value),
        )
        after = sorted(p.relative_to(disk) for p in disk.rglob("*") if p.parent.name != "fillers")
        assert after == [*before, Path("fillers")]
        assert RewindRecord.read(checkpoints) == earlier

        shutil.rmtree(disk / "fillers")
        assert set_aside_newer_checkpoints(checkpoints, "iter_0000002", 2, record) is not None
        [aside] = checkpoints.glob("abandoned-*")
        assert _listing(aside) == ["iter_0000004", "iter_0000006"]
        assert RewindRecord.read(checkpoints).abandoned == aside


def _committed(checkpoints: Path, name: str) -> Path:
    """A complete checkpoint as a save commits it: its marker carries a fresh id."""
    (checkpoints / name).mkdir(parents=True)
    marker = {"iteration": int(name[5:]), rewind.CHECKPOINT_ID: rewind.new_checkpoint_id()}
    (checkpoints / name / "complete.json").write_text(json.dumps(marker) + "\n")
    return checkpoints / name


def test_a_copy_without_its_times_still_continues_the_branch(tmp_path):
    """``cp -r`` without ``-p``, to another place: new paths, the record's mtime newer
    than every checkpoint's. The record names its checkpoint and what predated the
    rewind by content, so the copy continues the branch and skips an old checkpoint."""
    checkpoints = tmp_path / "run" / "checkpoints"
    for name in ("iter_0000002", "iter_0000004", "iter_0000006"):
        _committed(checkpoints, name)
    record = RewindRecord.new(checkpoints / "iter_0000002", checkpoints, "then")
    set_aside_newer_checkpoints(checkpoints, "iter_0000002", 2, record)
    _committed(checkpoints, "iter_0000003")  # the branch's first save
    # A checkpoint that predates the record but was not moved (killed before the move).
    kept = RewindRecord.new(checkpoints / "iter_0000002", checkpoints, "then")
    _committed(checkpoints, "iter_0000005")
    copy = tmp_path / "copy" / "checkpoints"
    shutil.copytree(checkpoints, copy, copy_function=shutil.copy)  # no times kept
    os.utime(RewindRecord.path(copy), (4e9, 4e9))  # copied last: the newest file
    assert branch_to_continue(copy, copy / "iter_0000002", _complete(copy)) == [
        copy / "iter_0000005",
        copy / "iter_0000003",
    ]
    kept.write(copy)
    assert branch_to_continue(copy, copy / "iter_0000002", _complete(copy)) == [
        copy / "iter_0000005"
    ]
    # Another checkpoint of the same step (another run's) is another rewind.
    other = _committed(tmp_path / "other" / "checkpoints", "iter_0000002")
    assert branch_to_continue(copy, other, _complete(copy)) == []
