"""Setting an abandoned branch's checkpoints aside: what moves, and a move cut short."""

import json
from pathlib import Path

import pytest

from megatron_lns.training import rewind
from megatron_lns.training.rewind import (
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


def test_a_checkpoint_of_another_run_is_never_touched(tmp_path):
    """Resuming run B from run A's iter_2 sets aside B's own newer checkpoints only."""
    a = _run_dir(tmp_path / "a", "iter_0000002", "iter_0000004")
    b = _run_dir(tmp_path / "b", "iter_0000006")
    assert set_aside_newer_checkpoints(b, "iter_0000002", 2) is not None
    assert _listing(a) == ["iter_0000002", "iter_0000004"]
    assert [p.name for p in b.glob("iter_*")] == []
