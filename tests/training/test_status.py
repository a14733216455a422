"""``megatron-lns status RUN_DIR``: where a run is and its goodput, from a synthetic run
directory (text and ``--json``), one-line errors for what is no run directory, and the
numbers of a real tiny run."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys

import pytest
from helpers import cli_error_of

from megatron_lns.cli import main
from megatron_lns.runtime.progress_file import RUN_PROGRESS_FILE
from megatron_lns.training.run_report import run_report

CONFIG = "trainer:\n  max_steps: 100\nmodel:\n  encoder_seq_length: 128\n"


def _totals(steps, train, save, samples):
    return f"steps={steps} train_s={train} save_s={save} eval_s=0 samples={samples}"


def _run_dir(tmp_path, *checkpoints: int):
    """A run that crashed at step 50 (newest checkpoint then: 40), was resumed, and stopped
    at step 60 with a checkpoint: 60 of 100 steps, 4 sequences a step."""
    run = tmp_path / "lns"
    run.mkdir()
    (run / "config.yaml").write_text(CONFIG)
    (run / RUN_PROGRESS_FILE).write_text(
        "local 0 began 0 at=1030 startup_s=30 load_s=0 samples=0\n"
        f"local 0 trained 50 at=1080 {_totals(50, 40, 2, 200)}\n"
        "local 0 began 40 at=2020 startup_s=20 load_s=4 samples=160\n"
        f"local 0 ended 60 at=2050 how=stopped {_totals(20, 16, 6, 240)}\n"
    )
    for step in checkpoints:
        checkpoint = run / "checkpoints" / f"iter_{step:07d}"
        checkpoint.mkdir(parents=True)
        for name in ("complete.json", "metadata.json", ".metadata"):  # whole, as status sees
            (checkpoint / name).write_text("{}")
    return run


def test_status_says_where_the_run_is_and_its_goodput(tmp_path, capsys):
    run = _run_dir(tmp_path, 40, 60)
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [
        f"run {run}: stopped",
        "step 60 of 100, 30,720 tokens",  # 240 sequences of 128 tokens
        "newest complete checkpoint: iter_0000060",
        "attempts: 2 (1 killed or crashed, 1 stopped); restarts: 1; 10 step(s) trained "
        "again after failures",
    ]
    # 40 steps left at 30 s / 20 steps since the last attempt's first step.
    assert out[4].startswith("time to max_steps: 1m 00s at 1.5 s per step")
    table = {line[:22].strip(): line[22:].split() for line in out[6:-1]}
    assert table["lost work"] == ["8.0", "8.0", "s", "6.2%"]  # 10 steps at 0.8 s
    assert table["wall time"] == ["130.0", "2m", "10s", "100.0%"]  # 80 s + 50 s
    assert out[-1] == "goodput 36.9% (productive steps over wall time)"  # (32 + 16) / 130


def test_status_json_is_for_machines(tmp_path, capsys):
    assert main(["status", str(_run_dir(tmp_path, 40, 60)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["step"], report["max_steps"], report["tokens"]) == (60, 100, 30720)
    assert (report["attempts"], report["restarts"], report["state"]) == (2, 1, "stopped")
    assert report["newest_checkpoint"].endswith("iter_0000060")
    assert report["time_to_max_steps_s"] == pytest.approx(60)
    assert report["seconds"]["lost_work"] == pytest.approx(8)
    assert report["seconds"]["restarts_queue_wait"] == 0  # a local run: no queue
    assert report["goodput"] == round(48 / 130, 4)
    assert report["wall_s"] == pytest.approx(sum(report["seconds"].values()), abs=0.05)
    assert [a["lost_steps"] for a in report["attempt_list"]] == [10, 0]


def test_a_run_that_is_running_has_lost_nothing_yet(tmp_path):
    run = _run_dir(tmp_path, 40)
    (run / RUN_PROGRESS_FILE).write_text(
        "local 0 began 0 at=1030 startup_s=30 load_s=0 samples=0\n"
        f"local 0 trained 50 at=1080 {_totals(50, 40, 2, 200)}\n"
    )
    (run / ".lock").write_text(json.dumps({"pid": 123, "host": "node7"}))
    report = run_report(run)
    assert report.state == "running (process 123 on node7)"
    assert report.goodput.rows["lost work"] == 0
    # The lock of a process that is gone, on this host: killed; back to step 40.
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    (run / ".lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    report = run_report(run)
    assert report.state == "ended without a record (killed or crashed)"
    assert report.goodput.rows["lost work"] == pytest.approx(8)
    assert report.endings() == ["killed or crashed"]


def test_what_is_no_run_directory_is_said_in_one_line(tmp_path, capsys):
    assert cli_error_of(capsys, "status", str(tmp_path / "nope")) == (
        f"error: {tmp_path / 'nope'}: no such directory"
    )
    assert cli_error_of(capsys, "status", str(tmp_path)) == (
        f"error: {tmp_path} is not a run directory (no config.yaml or run_progress): give "
        "<exp_manager.exp_dir>/<exp_manager.name>"
    )
    (tmp_path / "run.yaml").write_text("trainer: {}\n")  # was "no such directory"
    assert cli_error_of(capsys, "status", str(tmp_path / "run.yaml")) == (
        f"error: {tmp_path / 'run.yaml'} is a file, not a run directory: give "
        "<exp_manager.exp_dir>/<exp_manager.name>"
    )
    (tmp_path / "config.yaml").write_text("trainer: [unclosed\n")
    assert cli_error_of(capsys, "status", str(tmp_path)).startswith(
        f"error: cannot read {tmp_path / 'config.yaml'}: "
    )


def test_a_damaged_newest_checkpoint_is_said_as_a_resume_would_refuse_it(
    tmp_path, straight_tiny_run, capsys
):
    """status named a checkpoint whose complete.json train refuses as the newest complete
    one, without a word."""
    run = tmp_path / "lns"
    shutil.copytree(straight_tiny_run["run_dir"], run)
    (run / "checkpoints" / "iter_0000006" / "complete.json").write_text("[1]")
    assert main(["status", str(run)]) == 0
    assert (
        "newest complete checkpoint: iter_0000006, which is damaged: complete.json is not a "
        "JSON object: a resume refuses it unless exp_manager.resume_past_unreadable=true"
    ) in capsys.readouterr().out.splitlines()
    assert run_report(run).to_json()["newest_checkpoint_damage"] == (
        "is damaged: complete.json is not a JSON object"
    )
    # An empty marker was read as {}: train resumed from it without its data check.
    (run / "checkpoints" / "iter_0000006" / "complete.json").write_text("")
    assert run_report(run).newest_checkpoint_damage == "is damaged: complete.json is empty"
    assert run_report(straight_tiny_run["run_dir"]).newest_checkpoint_damage is None


def test_a_real_tiny_run_accounts_its_wall_time(straight_tiny_run):
    """The six-step tiny run (checkpoints at steps 3 and 6), trained straight through."""
    report = run_report(straight_tiny_run["run_dir"])
    assert (report.state, report.step, report.max_steps) == ("finished", 6, 6)
    assert report.newest_checkpoint.name == "iter_0000006"
    assert report.tokens == 6 * 4 * 32  # 6 steps of 4 sequences of 32 tokens
    assert report.time_to_max_steps_s == 0
    (attempt,) = report.goodput.attempts
    assert (attempt.first_step, attempt.last_step, attempt.steps) == (0, 6, 6)
    rows, wall = report.goodput.rows, report.goodput.wall_s
    assert min(rows.values()) >= 0 and rows["lost work"] == rows["restarts, queue wait"] == 0
    assert rows["productive steps"] > 0 and rows["checkpoint saves"] > 0
    assert rows["evaluation"] > 0 and rows["start-up"] > 0
    # What the attempt measured covers its wall time, but for what is neither a step, nor
    # start-up, a save or an evaluation (logging, the end of the run): a few seconds.
    assert wall == pytest.approx(attempt.wall_s)
    assert rows["other"] < max(5.0, 0.2 * wall), report.lines()
    # The hang watchdog's timeouts learnt from its steps, evaluations and saves: the floor.
    assert report.hang_timeouts == {"step": 30, "eval": 30, "save": 30}
    assert "hang timeouts learnt (last attempt): step 30 s, eval 30 s, save 30 s" in report.lines()


# Lines no writer writes: a time that is not a number or past the calendar's end, a
# restart or step that str.isdigit takes but int refuses, a torn line.
CORRUPT_LINES = [
    "local 0 trained 55 at=nan steps=5 train_s=4 save_s=0 eval_s=0 samples=20",
    "local 0 trained 55 at=1e30 steps=5 train_s=4 save_s=0 eval_s=0 samples=20",
    "local ² began 0 at=1030",
    "local 0 trained ² at=1060",
    "local 0 tra",
]


def test_corrupt_progress_lines_are_left_out_and_named(tmp_path, capsys):
    for name in ("clean", "corrupt"):
        (tmp_path / name).mkdir()
    clean = run_report(_run_dir(tmp_path / "clean", 40, 60)).to_json()
    run = _run_dir(tmp_path / "corrupt", 40, 60)
    lines = (run / RUN_PROGRESS_FILE).read_text().splitlines()
    (run / RUN_PROGRESS_FILE).write_text("\n".join([*lines[:2], *CORRUPT_LINES, *lines[2:]]))
    report = run_report(run)
    assert report.unreadable_progress_lines == [3, 4, 5, 6, 7]
    corrupt = report.to_json()
    assert corrupt.pop("unreadable_progress_lines") == [3, 4, 5, 6, 7]
    clean.pop("unreadable_progress_lines")
    paths = {"run_dir": None, "newest_checkpoint": None}
    assert {**corrupt, **paths} == {**clean, **paths}
    assert main(["status", str(run)]) == 0
    assert (
        f"note: {run / RUN_PROGRESS_FILE}: lines 3, 4, 5, 6, 7 hold no record (torn by a "
        "kill, or edited); left out of the accounting"
    ) in capsys.readouterr().out.splitlines()


def test_numbers_no_writer_writes_count_as_absent(tmp_path):
    run = _run_dir(tmp_path, 40, 60)
    with (run / RUN_PROGRESS_FILE).open("a") as f:
        f.write(f"local 0 trained 60 at=2050 {_totals('nan', 'inf', '-inf', 240)}\n")
    report = run_report(run)
    assert report.unreadable_progress_lines == []
    attempt = report.goodput.attempts[-1]
    assert (attempt.steps, attempt.train_s, attempt.save_s) == (20, 16, 6)  # as they were
    assert all(math.isfinite(value) for value in report.goodput.rows.values())


def test_run_files_that_are_no_text_are_one_line_or_ignored(tmp_path, capsys):
    run = tmp_path / "lns"
    run.mkdir()
    (run / RUN_PROGRESS_FILE).write_text("")
    (run / "run_status").write_bytes(b"\xff\n")  # says nothing a run wrote: ignored
    assert run_report(run).state == "not started"
    (run / "run_status").write_text("finished 6\n")
    assert run_report(run).state == "finished"
    (run / "config.yaml").write_bytes(b"name: \xff\n")
    assert cli_error_of(capsys, "status", str(run)).startswith(
        f"error: cannot read {run / 'config.yaml'}: 'utf-8' codec can't decode byte 0xff"
    )


@pytest.mark.parametrize(
    "record", ['{"pid": 99999999999999999999, "host": "HOST"}', '{"pid": 1', "[1]"]
)
def test_a_lock_that_names_no_process_says_running(tmp_path, record):
    run = _run_dir(tmp_path, 40)
    (run / ".lock").write_text(record.replace("HOST", socket.gethostname()))
    assert run_report(run).state == "running"


def test_a_checkpoint_or_a_part_of_a_run_is_refused_naming_the_run(tmp_path, capsys):
    """A checkpoint holds a config.yaml too: it was reported as a run 'not started'."""
    run = _run_dir(tmp_path, 40, 60)
    (run / "checkpoints" / "iter_0000080.partial").mkdir()
    for checkpoint in ("iter_0000060", "iter_0000080.partial"):
        path = run / "checkpoints" / checkpoint
        (path / "config.yaml").write_text(CONFIG)
        assert cli_error_of(capsys, "status", str(path)) == (
            f"error: {path} is a checkpoint, not a run directory: give its run directory {run}"
        )
    assert cli_error_of(capsys, "status", str(run / "checkpoints")).endswith(
        f"; it lies inside the run directory {run}: give that one"
    )
    assert cli_error_of(capsys, "status", str(tmp_path)).endswith(
        f"; {tmp_path} is no run directory but holds the run {run}: give that one"
    )


def test_a_directory_with_only_a_config_is_no_run(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(CONFIG)
    assert cli_error_of(capsys, "status", str(tmp_path)) == (
        f"error: {tmp_path} is not a run directory (a config.yaml, but no checkpoints/ or "
        "run_progress): give <exp_manager.exp_dir>/<exp_manager.name>"
    )
    (tmp_path / "checkpoints").mkdir()  # what train makes before it writes the config
    assert run_report(tmp_path).state == "not started"
