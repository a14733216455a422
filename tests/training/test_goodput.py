"""The accounting of a run's wall time from the lines its attempts append to
``run_progress`` (training/goodput.py), read from synthetic record files: a clean run, a
run stopped and resumed, a crash past the last checkpoint (lost work), a requeue (queue
wait); and the recorder that writes them."""

from __future__ import annotations

import pytest

from megatron_lns.runtime.job import LocalJob
from megatron_lns.runtime.progress_file import RUN_PROGRESS_FILE, read_events
from megatron_lns.training.attempt_recorder import AttemptRecorder
from megatron_lns.training.goodput import account, duration, goodput_table


def _write(tmp_path, *lines: str):
    (tmp_path / RUN_PROGRESS_FILE).write_text("".join(line + "\n" for line in lines))
    return read_events(tmp_path)


def _goodput(tmp_path, *lines: str, resumable_step: int | None = 100):
    """The accounting of a run whose record file holds ``lines``, a next attempt resuming
    from ``resumable_step`` (by default 100, where these runs end)."""
    return account(_write(tmp_path, *lines), resumable_step=resumable_step)


def _totals(steps, train, save=0.0, evals=0.0, samples=0):
    return f"steps={steps} train_s={train} save_s={save} eval_s={evals} samples={samples}"


# A first attempt of a local run: started at t=1000, first step at t=1030 after 30 s of
# start-up (no checkpoint to load), 100 steps in 80 s, 6 s of saves, 4 of evaluation.
FIRST = [
    "local 0 began 0 at=1030 startup_s=30 load_s=0 samples=0",
    f"local 0 trained 50 at=1075 {_totals(50, 40, 3, 2, 200)}",
]
FIRST_FINISHED = [*FIRST, f"local 0 ended 100 at=1125 how=finished {_totals(100, 80, 6, 4, 400)}"]


def test_a_clean_run_divides_its_wall_time(tmp_path):
    goodput = _goodput(tmp_path, *FIRST_FINISHED)
    assert goodput.rows == pytest.approx(
        {
            "productive steps": 80,
            "start-up": 30,
            "checkpoint load": 0,
            "checkpoint saves": 6,
            "evaluation": 4,
            "lost work": 0,
            "restarts, queue wait": 0,
            "other": 5,  # 125 s of wall time, 120 of them accounted
        }
    )
    assert goodput.wall_s == pytest.approx(125)
    assert goodput.fraction == pytest.approx(80 / 125)
    (attempt,) = goodput.attempts
    assert (attempt.first_step, attempt.last_step, attempt.how) == (0, 100, "finished")
    assert attempt.step_s == pytest.approx(95 / 100)  # wall per step since the first step


def test_a_run_stopped_and_resumed_loses_nothing_and_the_time_between_is_not_its(tmp_path):
    goodput = _goodput(
        tmp_path,
        *FIRST,
        f"local 0 ended 60 at=1090 how=stopped {_totals(60, 48, 5, 2, 240)}",
        # Resumed by hand an hour later: 20 s of start-up, 5 of them loading step 60.
        "local 0 began 60 at=4620 startup_s=20 load_s=5 samples=240",
        f"local 0 ended 100 at=4660 how=finished {_totals(40, 32, 2, 2, 400)}",
    )
    assert [a.how for a in goodput.attempts] == ["stopped", "finished"]
    rows = goodput.rows
    assert rows["lost work"] == 0 and rows["restarts, queue wait"] == 0
    assert rows["productive steps"] == pytest.approx(48 + 32)
    assert rows["start-up"] == pytest.approx(30 + 15)
    assert rows["checkpoint load"] == pytest.approx(5)
    assert goodput.wall_s == pytest.approx(90 + 60)  # each attempt's, not the hour between


def test_steps_past_the_last_checkpoint_of_a_crashed_attempt_are_lost_work(tmp_path):
    goodput = _goodput(
        tmp_path,
        *FIRST,  # trained to step 50, then killed: no end; its last checkpoint was step 40
        "local 0 began 40 at=2000 startup_s=25 load_s=5 samples=160",
        f"local 0 ended 100 at=2070 how=finished {_totals(60, 48, 4, 2, 400)}",
    )
    crashed, resumed = goodput.attempts
    assert crashed.how is None and crashed.lost_steps == 10
    assert crashed.lost_s == pytest.approx(10 * 40 / 50)  # at its mean step time
    assert resumed.lost_steps == 0
    assert goodput.rows["lost work"] == pytest.approx(8)
    assert goodput.rows["productive steps"] == pytest.approx(40 - 8 + 48)
    # The crashed attempt ended at its last record (t=1075): 75 s of wall time.
    assert crashed.wall_s == pytest.approx(75)
    assert goodput.wall_s == pytest.approx(75 + 95)
    assert min(goodput.rows.values()) >= 0


def test_the_last_attempt_loses_nothing_while_it_may_still_run(tmp_path):
    events = _write(tmp_path, *FIRST)
    assert account(events, resumable_step=None).rows["lost work"] == 0
    # Ended without a record and no longer running: back to the newest checkpoint (40).
    assert account(events, resumable_step=40).attempts[0].lost_steps == 10


def test_a_requeue_counts_the_wait_in_the_queue_and_ignores_the_guard_lines(tmp_path):
    goodput = _goodput(
        tmp_path,
        "42 0 start 0",  # the batch script's progress guard: not accounting lines
        "42 0 began 0 at=1030 startup_s=30 load_s=0 samples=0",
        "42 0 resumed 0 startup_s=30 every=50",
        "42 0 saved 50 step_s=0.80 save_s=3.0",
        "42 0 warned - after_s=80",
        f"42 0 ended 55 at=1090 how=stopped {_totals(55, 44, 6, 0, 220)}",
        "42 1 start 55",
        # Requeued: held 140 s in the queue, then 40 s of start-up (5 loading).
        "42 1 began 55 at=1270 startup_s=40 load_s=5 samples=220",
        f"42 1 ended 100 at=1320 how=finished {_totals(45, 36, 3, 0, 400)}",
        # A new job of the same experiment, days later: its wait is nobody's allocation.
        "43 0 began 100 at=99000 startup_s=10 load_s=4 samples=400",
        f"43 0 ended 100 at=99001 how=finished {_totals(0, 0)}",
    )
    assert [(a.job_id, a.restart) for a in goodput.attempts] == [("42", 0), ("42", 1), ("43", 0)]
    assert goodput.rows["restarts, queue wait"] == pytest.approx(1230 - 1090)
    assert goodput.wall_s == pytest.approx(90 + 140 + 90 + 11)
    assert goodput.rows["lost work"] == 0


def test_an_in_job_restart_is_an_attempt_of_its_own_and_its_time_a_restart(tmp_path):
    """A rank killed after step 55 (newest checkpoint 50, last record at step 50); the
    launcher restarts every rank in-job (attempt=1), which drops the metrics rows of
    steps 51-55 (logged_past): those 5 steps are lost work, taken from the time between
    the last record and the restart's start, and the rest of it is the restart's."""
    goodput = _goodput(
        tmp_path,
        *FIRST,
        "local 0 began 50 attempt=1 at=1090 startup_s=6 load_s=2 samples=200 logged_past=55",
        f"local 0 trained 100 attempt=1 at=1120 {_totals(50, 28, 0, 0, 400)}",
        f"local 0 ended 100 attempt=1 at=1130 how=finished {_totals(50, 40, 0, 0, 400)}",
    )
    crashed, restarted = goodput.attempts
    assert [a.in_job_restart for a in goodput.attempts] == [0, 1]
    assert (crashed.how, crashed.last_step, crashed.lost_steps) == (None, 50, 5)
    assert (restarted.first_step, restarted.steps, restarted.how) == (50, 50, "finished")
    rows = goodput.rows
    assert rows["lost work"] == pytest.approx(5 * 40 / 50)  # at the crashed one's step time
    assert rows["restarts, queue wait"] == pytest.approx((1084 - 1075) - 4)
    assert rows["productive steps"] == pytest.approx(40 + 40)
    assert goodput.wall_s == pytest.approx(75 + 9 + 46)  # the gap between is the job's


def test_a_logged_past_no_writer_writes_counts_as_absent(tmp_path):
    """``²`` passes ``str.isdigit`` but not ``int``: it crashed ``status``."""
    goodput = _goodput(
        tmp_path,
        *FIRST,
        "local 0 began 50 attempt=1 at=1090 startup_s=6 load_s=2 samples=200 logged_past=²",
    )
    assert goodput.attempts[1].logged_past is None


def test_a_rerun_by_hand_is_not_a_restart_even_when_it_drops_rows(tmp_path):
    goodput = _goodput(
        tmp_path,
        *FIRST,
        "local 0 began 50 at=5000 startup_s=6 load_s=2 samples=200 logged_past=55",
        f"local 0 ended 100 at=5040 how=finished {_totals(50, 40, 0, 0, 400)}",
    )
    assert goodput.rows["restarts, queue wait"] == 0 and goodput.rows["lost work"] == 0
    assert goodput.attempts[0].lost_steps == 5  # trained again, outside any allocation


def test_no_records_mean_no_goodput_and_the_table_says_so(tmp_path):
    goodput = _goodput(tmp_path, "half a li", resumable_step=0)
    assert goodput.attempts == [] and goodput.fraction is None
    assert goodput_table(goodput)[-1] == "goodput - (productive steps over wall time)"


def test_durations_read_as_a_person_reads_them():
    assert [duration(s) for s in (4.25, 42, 725, 11220, 187200)] == [
        "4.2 s",
        "42 s",
        "12m 05s",
        "3h 07m",
        "2d 04h",
    ]


def test_the_recorder_writes_what_the_accounting_reads(tmp_path, monkeypatch):
    clock = {"now": 1000.0}
    monkeypatch.setattr("time.time", lambda: clock["now"])
    warnings = []
    recorder = AttemptRecorder(tmp_path, LocalJob(started_at=970.0), warnings.append, True)
    recorder.load_s = 4.0
    recorder.began(10, 40)
    for step in range(11, 21):
        clock["now"] += 1.0
        recorder.step_done(step, 0.8, step * 4)
    clock["now"] += 2.0
    recorder.save_s += 2.0
    recorder.committed()
    assert recorder.time_to(40) == "24 s"  # 20 steps at 12 s / 10 steps
    recorder.ended("finished")
    lines = (tmp_path / RUN_PROGRESS_FILE).read_text().splitlines()
    assert lines[0] == "local 0 began 10 at=1000.00 startup_s=30.00 load_s=4.00 samples=40"
    assert [line.split()[2] for line in lines] == ["began", "trained", "ended"]
    (attempt,) = account(read_events(tmp_path), resumable_step=20).attempts
    assert (attempt.first_step, attempt.last_step, attempt.steps) == (10, 20, 10)
    assert attempt.train_s == pytest.approx(8) and attempt.save_s == pytest.approx(2)
    assert attempt.wall_s == pytest.approx(42) and attempt.how == "finished"
    assert warnings == []


def test_a_run_directory_that_cannot_be_written_costs_one_warning_not_the_run(tmp_path):
    warnings = []
    recorder = AttemptRecorder(tmp_path / "gone", LocalJob(), warnings.append, True)
    recorder.began(0, 0)
    recorder.ended("finished")
    (line,) = warnings
    assert line.startswith(f"warning: cannot append to {tmp_path / 'gone' / RUN_PROGRESS_FILE}")


def test_only_rank_0_writes(tmp_path):
    recorder = AttemptRecorder(tmp_path, LocalJob(), print, active=False)
    recorder.began(0, 0)
    recorder.ended("finished")
    assert not (tmp_path / RUN_PROGRESS_FILE).exists()


def test_log_lines_are_recorded_unless_the_last_record_is_seconds_old(tmp_path, monkeypatch):
    """A crash loses the record of what it trained since the last line: a line goes with
    each console log line (not one per fast step), and at least every half minute."""
    clock = {"now": 0.0}
    monkeypatch.setattr("time.monotonic", lambda: clock["now"])
    recorder = AttemptRecorder(tmp_path, LocalJob(), print, True)
    recorder.began(0, 0)
    recorder.step_done(1, 1.0, 4)
    recorder.logged()  # the record of `began` is a moment old: no line
    clock["now"] = 6.0
    recorder.step_done(2, 1.0, 8)
    recorder.logged()
    clock["now"] = 40.0
    recorder.step_done(3, 1.0, 12)  # not logged, but 34 s after the last line
    lines = (tmp_path / RUN_PROGRESS_FILE).read_text().splitlines()
    assert [line.split()[2:4] for line in lines] == [
        ["began", "0"],
        ["trained", "2"],
        ["trained", "3"],
    ]


def test_an_in_job_restart_says_which_one_in_its_lines_and_starts_with_its_process(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MEGATRON_LNS_ATTEMPT", "2")
    job = LocalJob(started_at=5.0)  # the launcher's start: the first attempt's only
    assert job.in_job_restart == 2 and job.attempt_started_at() > 5.0
    recorder = AttemptRecorder(tmp_path, job, print, True)
    recorder.began(4, 16, logged_past=6)
    recorder.ended("finished")
    lines = (tmp_path / RUN_PROGRESS_FILE).read_text().splitlines()
    assert lines[0].startswith("local 0 began 4 attempt=2 at=")
    assert lines[0].endswith(" samples=16 logged_past=6")
    assert lines[1].startswith("local 0 ended 4 attempt=2 how=finished")
    (attempt,) = account(read_events(tmp_path), resumable_step=4).attempts
    assert (attempt.in_job_restart, attempt.logged_past, attempt.how) == (2, 6, "finished")


def test_a_local_attempt_starts_when_its_process_did():
    """Start-up counts from the process's start, its imports included: a process that
    waits a second before it asks says it started a second ago."""
    import subprocess
    import sys
    import time

    code = (
        "import time; time.sleep(1.0)\n"
        "from megatron_lns.runtime.job import LocalJob\n"
        "print(LocalJob().attempt_started_at(), time.time())"
    )
    before = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    started, asked = (float(word) for word in done.stdout.split())
    assert before - 0.1 <= started <= before + 2.0  # forked at once, even on a busy machine
    assert asked - started >= 1.0


def test_an_attempt_ends_once_the_first_record_winning(tmp_path):
    """The watchdog's thread records a hang; the main thread, failing because of it (an
    asynchronous save's writer killed), must not record the attempt a second time, as
    failed: `status` would count two attempts."""
    import threading

    recorder = AttemptRecorder(tmp_path, LocalJob(), print, True)
    recorder.began(40, 160)
    watchdog = threading.Thread(target=recorder.hung, args=("hang: rank 1 ...",))
    watchdog.start()
    watchdog.join()
    recorder.ended("failed")
    ended = [e for e in read_events(tmp_path) if e.event == "ended"]
    assert [e.fields["how"] for e in ended] == ["hung"]
    (attempt,) = account(read_events(tmp_path), resumable_step=40).attempts
    assert attempt.how == "hung"
