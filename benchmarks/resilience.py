"""The figures of issue 35: hang detection, in-job recovery, goodput under faults, and a
straggler made by CPU contention. Drives ``megatron-lns train`` as a user would, with the
test-only fault hook (``MEGATRON_LNS_INJECT_FAULT``), and reads the run's log (each line
timestamped as it arrives) and ``megatron-lns status RUN_DIR --json``.

``faults`` (the default) trains a 200-step CPU job on 2 local ranks twice:

- fault-free;
- with three faults, one per attempt: rank 1 hangs in step 45 (``kind=hang``: its main
  thread sleeps for ever, the other rank waits in the gradient sync), rank 1 is killed
  in step 115 of the first restart (``kind=crash``), rank 1 sleeps 0.6 of a fault-free
  step in every step from step 176 of the second restart (``kind=slow``: a straggler).

and prints (i) the time from the hang to the first line naming it (the watchdog's "hang: ...", else
the launcher's restart line "found the run hung") against the step phase's timeout
(``--timeout``: ``rank_heartbeat_timeout``, not learnt: ``calculate_timeouts=false``), goal
at most twice it; (ii) the time from each failure (the hang's detection, the kill) to the
first step trained again in-job, against that attempt's start-up plus checkpoint load (its
``began`` record in ``run_progress``) plus 10 s; (iii) both runs' goodput as ``megatron-lns
status`` accounts it (productive steps over wall time), the faulted run's over its wall time
less the hang itself (injection to detection), and that as a share of the fault-free run's,
goal at least 90%; and the straggler report's lines of the last attempt.

The hang needs the rank-side watchdog and the restarts the local in-job restart (issue
35); where either is missing from this build, the benchmark stops with one line naming it,
the ranks killed.

``contention``: two ranks, each pinned to a core of its own (``taskset``; needs 2 cores),
and a busy loop on rank 1's core for the middle third of the run; prints the straggler
report's lines (which reports named whom).

    .venv/bin/python benchmarks/resilience.py [faults|contention] [--out DIR] [--output FILE.json]

``faults`` takes about 4 minutes on two cores, ``contention`` about 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from tiny_model import TINY_WIDTH

from megatron_lns.runtime.launcher_env import LAUNCHER_VARIABLES
from megatron_lns.runtime.progress_file import read_events
from megatron_lns.training.goodput import attempts_of

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200
# The demo model cut to 4 layers: steps of about a tenth of a second on 2 CPU ranks.
MODEL = [
    "model.num_layers=4",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=100",
    "trainer.limit_val_batches=1",
    "exp_manager.checkpoint_callback_params.every_n_train_steps=10",
    "exp_manager.create_tensorboard_logger=false",
    "trainer.devices=2",
]
# Each fault half a checkpoint interval after a checkpoint (the expected loss); the slow
# rank is slow for the last straggler report's 25 steps.
HANG_STEP, CRASH_STEP, SLOW_STEP = 45, 115, 176
STEP_LINE = re.compile(r"\] step +(\d+)  loss ")
DETECTION = re.compile(r"(^|\] )hang: |\bhung\b")
RESTART = re.compile(r"in-job restart (\d+) of")
STRAGGLERS = re.compile(r"stragglers over steps|straggler report")


# The runs still going: killed, with their ranks, if the benchmark stops early.
RUNNING: list[Training] = []


class Missing(SystemExit):
    """What the benchmark needs and this build lacks (one line)."""


@dataclass
class Line:
    at: float
    text: str


@dataclass
class Training:
    """A ``megatron-lns train`` process in a session of its own, its output timestamped
    line by line (and copied to ``log``)."""

    command: list[str]
    env: dict[str, str]
    log: Path
    lines: list[Line] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started = time.time()
        self.process = subprocess.Popen(
            self.command,
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        RUNNING.append(self)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with self.log.open("w") as log:
            for text in self.process.stdout:
                now = time.time()
                self.lines.append(Line(now, text.rstrip("\n")))
                log.write(f"{now - self.started:9.3f} {text}")
                log.flush()

    def await_line(
        self, pattern: re.Pattern[str] | str, after: int, timeout_s: float, missing: str
    ) -> tuple[int, Line, re.Match[str]]:
        """The first line from index ``after`` on matching ``pattern``; ``missing`` ends
        the benchmark (the ranks killed) when none comes within ``timeout_s``."""
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout_s
        index = after
        while True:
            while index < len(self.lines):
                if match := pattern.search(self.lines[index].text):
                    return index, self.lines[index], match
                index += 1
            ended = self.process.poll() is not None and not self.reader.is_alive()
            if ended or time.monotonic() > deadline:
                self.kill()
                why = (
                    f"the run ended (status {self.process.returncode})"
                    if ended
                    else (f"none within {timeout_s:.0f} s")
                )
                raise Missing(f"{missing} ({why}; log: {self.log})")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> float:
        """Wait for a clean end; its wall time."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise SystemExit(
                f"the run did not end within {timeout_s:.0f} s (log: {self.log})"
            ) from None
        self.reader.join()
        if self.process.returncode != 0:
            raise SystemExit(f"the run failed with status {self.process.returncode}: {self.log}")
        return time.time() - self.started

    def kill(self) -> None:
        """Every process of the run's session (the launcher, its ranks, their helpers)."""
        session = self.process.pid
        for pid in _session_members(session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


def _session_members(session: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == session:  # the session id, after state, ppid and pgrp
            members.append(int(entry.name))
    return members


def _train(exp_dir: Path, log: Path, *extra: str, faults: str = "") -> Training:
    # A launcher's variables inherited from this shell would make the run join its world.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MEGATRON_LNS_INJECT_FAULT", None)
    if faults:
        env["MEGATRON_LNS_INJECT_FAULT"] = faults
    command = [sys.executable, "-m", "megatron_lns.cli", "train", "tiny_cpu_demo", *MODEL]
    command += [*extra, f"exp_manager.exp_dir={exp_dir}"]
    return Training(command, env, log)


def _status(run_dir: Path) -> dict:
    output = subprocess.run(
        [sys.executable, "-m", "megatron_lns.cli", "status", str(run_dir), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(output)


def _began_records(run_dir: Path) -> list[dict[str, float]]:
    """Each attempt's start-up and checkpoint-load seconds, in order (one per attempt of a
    fresh run directory), as the run's records (``run_progress``) account them."""
    return [
        {"startup_s": a.startup_s, "load_s": a.load_s} for a in attempts_of(read_events(run_dir))
    ]


def _goodput(status: dict) -> dict[str, float]:
    return {
        "wall_s": status["wall_s"],
        "productive_s": status["seconds"]["productive_steps"],
        "goodput": status["goodput"],
        "attempts": status["attempts"],
    }


def faults(out: Path, timeout_s: float, slow_fraction: float, hang_kind: str = "hang") -> dict:
    common = [
        f"trainer.max_steps={STEPS}",
        "exp_manager.fault_tolerance.calculate_timeouts=false",
        f"exp_manager.fault_tolerance.rank_heartbeat_timeout={timeout_s}",
        "exp_manager.straggler_detection_params.report_every_n_steps=25",
    ]
    print(f"fault-free run of {STEPS} steps ...", flush=True)
    clean = _train(out / "clean", out / "clean.log", *common)
    clean_wall = clean.finish(900)
    clean_report = _status(out / "clean" / "lns")
    clean_status, step_s = _goodput(clean_report), clean_report["step_s"]
    slow_s = round(slow_fraction * step_s, 3)
    print(f"  {clean_wall:.1f} s, {step_s:.3f} s/step, goodput {clean_status['goodput']:.1%}")

    injected = ";".join(
        [
            f"kind={hang_kind},rank=1,step={HANG_STEP},attempt=0",
            f"kind=crash,rank=1,step={CRASH_STEP},attempt=1",
            f"kind=slow,rank=1,step={SLOW_STEP},attempt=2,seconds={slow_s}",
        ]
    )
    print(f"run with faults: {injected} ...", flush=True)
    run = _train(out / "faults", out / "faults.log", *common, faults=injected)
    i, hang, _ = run.await_line(
        f"fault injection: {hang_kind} on rank 1 at step {HANG_STEP}",
        0,
        600,
        "the hang was not injected",
    )
    i, detected, _ = run.await_line(
        DETECTION,
        i + 1,
        2 * timeout_s + 60,
        "no line named the hung rank: the rank-side watchdog (issue 35: heartbeats, phase "
        "timeouts, exit 75) is missing from this build",
    )
    restart_missing = (
        "no in-job restart line ('in-job restart N of M'): the local in-job restart "
        "(issue 35, runtime/restarts.py) is missing from this build"
    )
    i, _, _ = run.await_line(RESTART, i, 60, restart_missing)
    i, first_after_hang, _ = run.await_line(STEP_LINE, i + 1, 300, "no step after the restart")
    i, crash, _ = run.await_line(
        f"fault injection: crash on rank 1 at step {CRASH_STEP}",
        i,
        600,
        "the crash was not injected",
    )
    i, _, _ = run.await_line(RESTART, i + 1, 60, restart_missing)
    i, first_after_crash, _ = run.await_line(STEP_LINE, i + 1, 300, "no step after the restart")
    restart2_index = i
    run.finish(900)
    run_dir = out / "faults" / "lns"
    status = _goodput(_status(run_dir))
    began = _began_records(run_dir)

    hang_s = detected.at - hang.at
    detection = {
        "detect_s": round(hang_s, 2),
        "timeout_s": timeout_s,
        "within_twice_timeout": hang_s <= 2 * timeout_s,
        "line": detected.text,
    }
    # A fresh start's start-up (the run's first attempt): what the requeue path pays
    # again, besides its wait in the queue.
    fresh_startup_s = began[0]["startup_s"]
    recoveries = {}
    for restart, failed_at, first in (
        (1, detected, first_after_hang),
        (2, crash, first_after_crash),
    ):
        nothing = {"startup_s": float("nan"), "load_s": float("nan")}
        record = began[restart] if restart < len(began) else nothing
        goal_s = fresh_startup_s + record["load_s"] + 10.0
        recover_s = first.at - failed_at.at
        recoveries[f"restart_{restart}"] = {
            "failure": "hang detected" if restart == 1 else "rank killed",
            "recover_s": round(recover_s, 2),
            "restart_startup_s": record["startup_s"],
            "load_s": record["load_s"],
            "fresh_startup_s": fresh_startup_s,
            "goal_s": round(goal_s, 2),
            "within_goal": recover_s <= goal_s,
        }
    clean_startup_s = _began_records(out / "clean" / "lns")[0]["startup_s"]
    # Goodput after the first start-up (the same with or without faults, and the noisiest
    # part of a short job on a shared machine), the hang itself left out; each run's own
    # productive share, so that a machine busier during one run than the other cancels.
    clean_after = clean_status["productive_s"] / (clean_status["wall_s"] - clean_startup_s)
    faults_after = status["productive_s"] / (status["wall_s"] - fresh_startup_s - hang_s)
    goodput = {
        "fault_free": {**clean_status, "startup_s": clean_startup_s},
        "faults": {**status, "startup_s": fresh_startup_s},
        "hang_s": round(hang_s, 2),
        "status_goodput_excluding_hangs": round(
            status["productive_s"] / (status["wall_s"] - hang_s), 4
        ),
        "fault_free_goodput_after_startup": round(clean_after, 4),
        "faults_goodput_after_startup_excluding_hangs": round(faults_after, 4),
        "goodput_vs_fault_free": round(faults_after / clean_after, 4),
    }
    goodput["at_least_90_percent"] = goodput["goodput_vs_fault_free"] >= 0.9
    straggler_lines = [
        line.text for line in run.lines[restart2_index:] if STRAGGLERS.search(line.text)
    ]
    return {
        "steps": STEPS,
        "faults": injected,
        "fault_free_step_s": step_s,
        "hang_detection": detection,
        "in_job_recovery": recoveries,
        "goodput": goodput,
        "straggler_lines_last_attempt": straggler_lines,
    }


def _ranks(launcher: int) -> dict[int, int]:
    """Rank -> pid of a 2-rank local run: rank 0 is the one holding ``metrics.jsonl``
    open (only rank 0 writes metrics), rank 1 its sibling."""
    members = [p for p in _session_members(launcher) if p != launcher]
    for pid in members:
        try:
            fds = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        if any(fd.endswith("metrics.jsonl") for fd in fds):
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            siblings = [
                p
                for p in members
                if p != pid
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == parent
                and "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_text()
            ]
            if len(siblings) == 1:
                return {0: pid, 1: siblings[0]}
    return {}


# Busy loops pinned to rank 1's core: the scheduler favours a rank that sleeps often
# (waiting for the other) over one loop, which then hardly slows it.
BUSY_LOOPS = 4


def contention(out: Path, steps: int = 1200, every: int = 100) -> dict:
    if os.cpu_count() < 2:
        raise Missing("contention needs 2 cores (each rank pinned to one)")
    tiny = [
        *TINY_WIDTH,
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        f"exp_manager.straggler_detection_params.report_every_n_steps={every}",
        "trainer.log_every_n_steps=1",
    ]
    run = _train(out / "contention", out / "contention.log", *tiny)
    first, last = steps // 3, 2 * steps // 3
    i, _, _ = run.await_line(STEP_LINE, 0, 300, "the run logged no step")
    ranks = _ranks(run.process.pid)
    if not ranks:
        run.kill()
        raise SystemExit("could not tell the two ranks' processes apart")
    for rank, pid in ranks.items():
        subprocess.run(
            ["taskset", "-a", "-p", "-c", str(rank), str(pid)], check=True, capture_output=True
        )
    i, _, _ = run.await_line(rf"\] step +{first}  loss ", i, 600, f"no step {first}")
    busy = [
        subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
        for _ in range(BUSY_LOOPS)
    ]
    try:
        i, _, _ = run.await_line(rf"\] step +{last}  loss ", i, 600, f"no step {last}")
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    run.finish(600)
    lines = [line.text for line in run.lines if STRAGGLERS.search(line.text)]
    return {
        "steps": steps,
        "report_every_n_steps": every,
        "busy_loops_on_rank_1_core": f"{BUSY_LOOPS} in steps {first + 1}-{last}",
        "straggler_lines": lines,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("figure", nargs="?", choices=("faults", "contention"), default="faults")
    parser.add_argument("--out", type=Path, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--output", type=Path, help="also write the results here as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="the step phase's timeout, s")
    parser.add_argument(
        "--hang",
        choices=("hang", "stop"),
        default="hang",
        help="how rank 1 hangs: its main thread sleeps (hang) or the process is stopped (stop)",
    )
    parser.add_argument(
        "--slow-fraction",
        type=float,
        default=0.6,
        help="the slow rank's delay per step, as a fraction of the fault-free step time",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        try:
            if args.figure == "faults":
                results = faults(out, args.timeout, args.slow_fraction, args.hang)
            else:
                results = contention(out)
        finally:
            for run in RUNNING:
                if run.process.poll() is None:
                    run.kill()
    print(json.dumps(results, indent=2))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
