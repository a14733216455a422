"""The trainer's part of the progress guard: the lines it records for the batch script,
and the warnings about time slices that cannot make progress."""

import os
import subprocess

from megatron_lns.cluster.slurm.job import SlurmJob
from megatron_lns.cluster.slurm.progress import (
    RUN_PROGRESS_FILE,
    ProgressRecorder,
    append_event,
    coverage_warnings,
    read_events,
)

BATCH = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "3", "MEGATRON_LNS_BATCH_START": "1000"}


def test_lines_are_plain_words_that_bash_reads(tmp_path):
    append_event(tmp_path, SlurmJob("42", 3), "resumed", 120, startup_s="95", every=50)
    append_event(tmp_path, SlurmJob("42", 3), "warned", None, after_s=7)
    with (tmp_path / RUN_PROGRESS_FILE).open("a") as f:
        f.write("half a line\n")  # ignored by readers
    text = (tmp_path / RUN_PROGRESS_FILE).read_text()
    assert text.splitlines()[:2] == [
        "42 3 resumed 120 startup_s=95 every=50",
        "42 3 warned - after_s=7",
    ]
    read = subprocess.run(
        ["bash", "-c", 'read -r job run event step rest; echo "$job|$run|$event|$step|$rest"'],
        input=text, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert read.stdout == "42|3|resumed|120|startup_s=95 every=50\n"
    events = read_events(tmp_path)
    assert [(e.event, e.step, e.fields) for e in events] == [
        ("resumed", 120, {"startup_s": "95", "every": "50"}),
        ("warned", None, {"after_s": "7"}),
    ]


def test_a_lead_time_too_short_for_one_step_and_one_save_is_warned():
    (line,) = coverage_warnings(60, None, 100, step_s=2.0, save_s=70.0, every=50, async_save=False)
    assert line.startswith(
        "cluster.preemption_signal_lead_s=60 s cannot cover one step (2.0 s) plus one save "
        "(70.0 s each): a warned stop is killed at the time limit before its checkpoint is "
        "committed"
    )
    assert coverage_warnings(80, None, 100, 2.0, 70.0, 50, async_save=False) == []
    # An asynchronous stop first finishes the periodic save being written: two saves.
    (line,) = coverage_warnings(80, None, 100, 2.0, 70.0, 50, async_save=True)
    assert "plus two saves (async_save) (70.0 s each)" in line


def test_a_time_limit_that_cannot_cover_the_start_up_or_a_save_interval_is_warned():
    (never,) = coverage_warnings(300, 900, 650, 2.0, 30.0, 50, False)
    assert never.startswith(
        "the time limit (900 s) minus cluster.preemption_signal_lead_s (300 s) is shorter "
        "than the start-up (650 s): the warning comes while the ranks are still starting, "
        "and the job never advances"
    )
    (interval,) = coverage_warnings(300, 3600, 650, 2.0, 30.0, 1500, False)
    assert "cannot cover one checkpoint interval (every_n_train_steps=1500 x 2.0 s" in interval
    assert coverage_warnings(300, 3600, 650, 2.0, 30.0, 500, False) == []


def test_the_recorder_runs_only_under_the_batch_script_and_warns_once(tmp_path, monkeypatch):
    assert ProgressRecorder.for_this_run(tmp_path, 60, 3600, 50, False, env={}) is None
    no_batch = {"SLURM_JOB_ID": "42"}  # srun by hand in an allocation: no requeue protocol
    assert ProgressRecorder.for_this_run(tmp_path, 60, 3600, 50, False, env=no_batch) is None
    # SLURM's end time (where SLURM sets it) wins over cluster.time_limit.
    env = {**BATCH, "SLURM_JOB_END_TIME": "1900"}
    recorder = ProgressRecorder.for_this_run(tmp_path, 60, 3600, 50, False, env=env)
    assert recorder.time_limit_s == 900
    monkeypatch.setattr("time.time", lambda: 1095.0)
    assert recorder.resumed(120) == []
    recorder.step_done(1.0)
    recorder.step_done(3.0)
    first = recorder.committed(121, 70.0)
    assert len(first) == 1 and "preemption_signal_lead_s=60 s" in first[0]
    assert recorder.committed(122, 70.0) == []
    lines = (tmp_path / RUN_PROGRESS_FILE).read_text().splitlines()
    assert lines == [
        "42 3 resumed 120 startup_s=95 every=50",
        "42 3 saved 121 step_s=2.00 save_s=70.0",
        f"42 3 warning - {first[0]}",  # the batch script repeats it in the job log
        "42 3 saved 122 step_s=2.00 save_s=70.0",
    ]
    assert read_events(tmp_path)[2].text == first[0]


def test_a_run_directory_that_cannot_be_written_costs_one_line_not_the_run(tmp_path):
    recorder = ProgressRecorder.for_this_run(tmp_path / "gone", 600, None, 50, False, env=BATCH)
    (line,) = recorder.resumed(0)
    assert line.startswith(f"cannot append to {tmp_path / 'gone' / RUN_PROGRESS_FILE}: ")
    assert recorder.committed(1, 1.0) == []
    assert not os.path.exists(tmp_path / "gone")
