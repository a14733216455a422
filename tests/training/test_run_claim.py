"""A start that fails before resume accepts it leaves the run directory's config.yaml and
run_status as the last run left them; one committed replaces them for good."""

import pytest

from megatron_lns.runtime.job import LocalJob
from megatron_lns.training.run_dir import LOCK_NAME

LAST_CONFIG = b"trainer:\n  precision: 32\n"
LAST_STATUS = b"finished 2\n"


def _claim(run_dir):
    import torch

    from megatron_lns.training.run_start import claim_run_directory

    notes = []
    claim = claim_run_directory(
        run_dir, True, "trainer:\n  precision: bf16\n", LocalJob(), torch.device("cpu"),
        notes.append)  # fmt: skip
    return claim, notes


@pytest.fixture()
def last_run(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_bytes(LAST_CONFIG)
    (run_dir / "run_status").write_bytes(LAST_STATUS)
    return run_dir


def test_a_start_released_before_its_commit_puts_back_the_last_runs_files(
    last_run, megatron_world1
):
    claim, notes = _claim(last_run)
    assert (last_run / "config.yaml").read_text() == "trainer:\n  precision: bf16\n"
    assert not (last_run / "run_status").exists()
    claim.release()  # as a refused resume's close() does
    assert (last_run / "config.yaml").read_bytes() == LAST_CONFIG
    assert (last_run / "run_status").read_bytes() == LAST_STATUS
    assert not (last_run / LOCK_NAME).exists() and notes == []
    claim.release()  # idempotent: the claim is no longer held, nothing is written again


def test_a_committed_start_keeps_its_config_and_no_run_status(last_run, megatron_world1):
    claim, _ = _claim(last_run)
    claim.commit()
    claim.release()
    assert (last_run / "config.yaml").read_text() == "trainer:\n  precision: bf16\n"
    assert not (last_run / "run_status").exists()


def test_a_new_run_that_fails_to_start_keeps_its_config(tmp_path, megatron_world1):
    """Nothing to put back: the config stays, as before, a record of what was tried."""
    claim, _ = _claim(tmp_path / "run")
    claim.release()
    assert (tmp_path / "run" / "config.yaml").read_text() == "trainer:\n  precision: bf16\n"
    assert not (tmp_path / "run" / "run_status").exists()


def test_a_hand_edited_run_status_is_put_back_byte_for_byte(last_run, megatron_world1):
    (last_run / "run_status").write_bytes(b"\xff done\n")  # no UTF-8
    _claim(last_run)[0].release()
    assert (last_run / "run_status").read_bytes() == b"\xff done\n"


def test_a_file_that_cannot_be_put_back_is_a_warning(last_run, megatron_world1):
    """The start is failing already: its own error is the news, and the lock goes."""
    import os

    claim, notes = _claim(last_run)
    (last_run / f"run_status.tmp-{os.getpid()}").mkdir()  # where the write goes first
    claim.release()
    assert (last_run / "config.yaml").read_bytes() == LAST_CONFIG
    assert len(notes) == 1 and notes[0].startswith(
        f"warning: {last_run / 'run_status'} could not be put back as it was: cannot write"
    )
    assert not (last_run / LOCK_NAME).exists()
