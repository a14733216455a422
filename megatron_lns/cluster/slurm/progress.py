"""What each run of a SLURM job did for its experiment, for the batch script's progress guard.

A job split into time slices makes no progress when a slice is shorter than start-up
plus one step plus one save: it requeues until its retries run out. The batch script
(``slurm/sbatch.template``, outside any container, hence bash and awk) stops requeueing
after two runs in a row that did not advance the newest complete checkpoint, and says
why in the numbers the runs recorded here. ``<run_dir>/run_progress`` holds one
plain-text line per event, appended across runs and jobs::

    JOB_ID RESTART EVENT STEP [KEY=VALUE ...]

The batch script writes ``start C`` (C: the newest complete checkpoint's step, 0 for
none), ``warned``/``termed`` (``after_s``: seconds from its start to the signal) and
``guard`` (it stopped the job). Rank 0 of the trainer writes ``resumed R`` (the step it
resumed from, 0 for a fresh start; ``startup_s``: from the batch script's start to the
first step, the container's start and the checkpoint's load included; ``every``: the
checkpoint interval) and, once each checkpoint is committed (as ``run_status``: after
the rename), ``saved S`` (``step_s``: mean seconds per training step of this run;
``save_s``: from the save's start to its commit). Each line is one ``write`` to a file
opened with ``O_APPEND``, so lines never interleave. The format is
:mod:`megatron_lns.runtime.progress_file`'s; the trainer's accounting of every run's wall
time (``began``, ``trained``, ``ended``: ``training/goodput.py``) shares the file.

At its first commit the trainer also checks that the time it is given can make progress
(:func:`coverage_warnings`) and warns once when it cannot: in its own output (the run's
log) and as ``warning - TEXT`` lines, which the batch script repeats in the job log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from megatron_lns.cluster.slurm.job import SlurmJob
from megatron_lns.runtime.job import ProgressSettings
from megatron_lns.runtime.progress_file import RUN_PROGRESS_FILE, append_line
from megatron_lns.runtime.progress_file import read_events as read_events  # the guard's reader

# Exported by the batch script (epoch seconds of its start): the trainer records only
# under it, and measures start-up from it (the container's start included).
BATCH_START_ENV = "MEGATRON_LNS_BATCH_START"


def append_event(
    run_dir: Path, job: SlurmJob, event: str, step: int | None, text: str = "", **fields
) -> None:
    """Append one line for ``job`` (:func:`~megatron_lns.runtime.progress_file.append_line`)."""
    append_line(run_dir, job.job_id, job.restart_count, event, step, text, **fields)


def _epoch(env: Mapping[str, str], name: str) -> float | None:
    value = env.get(name, "").strip()
    return float(value) if value.isdigit() else None


def time_limit(configured_s: float | None, env: Mapping[str, str] = os.environ) -> float | None:
    """The seconds a run of the batch script is given: from its start to SLURM's end time
    (``SLURM_JOB_END_TIME``, where SLURM sets it), else ``configured_s``."""
    batch_start, end = _epoch(env, BATCH_START_ENV), _epoch(env, "SLURM_JOB_END_TIME")
    return end - batch_start if batch_start is not None and end is not None else configured_s


def coverage_warnings(
    lead_s: float,
    time_limit_s: float | None,
    startup_s: float,
    step_s: float,
    save_s: float,
    every: int,
    async_save: bool,
) -> list[str]:
    """Why this job's time slices cannot make progress, if they cannot (docs/cluster.md).

    After the warning, ``lead_s`` must cover one step and one save (two with async_save:
    a periodic save still being written is finished first); the ranks must have started
    before the warning comes; and without a warning (SLURM's TERM, a kill) only periodic
    checkpoints keep progress, so one interval of them should fit in a slice.
    """
    saves = 2 if async_save else 1
    need = step_s + saves * save_s
    warnings = []
    if lead_s < need:
        what = "two saves (async_save)" if async_save else "one save"
        warnings.append(
            f"cluster.preemption_signal_lead_s={lead_s:.0f} s cannot cover one step "
            f"({step_s:.1f} s) plus {what} ({save_s:.1f} s each): a warned stop is killed at "
            f"the time limit before its checkpoint is committed; raise it well above "
            f"{need:.0f} s"
        )
    if time_limit_s is None:
        return warnings
    if time_limit_s - lead_s <= startup_s:
        warnings.append(
            f"the time limit ({time_limit_s:.0f} s) minus cluster.preemption_signal_lead_s "
            f"({lead_s:.0f} s) is shorter than the start-up ({startup_s:.0f} s): the warning "
            "comes while the ranks are still starting, and the job never advances; raise "
            "cluster.time_limit"
        )
    elif time_limit_s - startup_s < every * step_s + save_s:
        warnings.append(
            f"the time limit ({time_limit_s:.0f} s) minus start-up ({startup_s:.0f} s) cannot "
            f"cover one checkpoint interval (every_n_train_steps={every} x {step_s:.1f} s + "
            f"one save of {save_s:.1f} s): only the stop on SLURM's warning saves progress, "
            "and a slice ended without it (TERM past GraceTime, a kill) is lost; lower "
            "exp_manager.checkpoint_callback_params.every_n_train_steps"
        )
    return warnings


class ProgressRecorder:
    """Rank 0's part of the progress guard under the batch script (None elsewhere: see
    :meth:`for_this_run`): records resume and commits, and warns once on the first commit.
    SLURM's :class:`~megatron_lns.runtime.job.ProgressRecords`."""

    def __init__(
        self,
        run_dir: Path,
        job: SlurmJob,
        started_at: float,
        lead_s: float,
        time_limit_s: float | None,
        every: int,
        async_save: bool,
    ) -> None:
        self.run_dir, self.job = Path(run_dir), job
        self.started_at, self.lead_s, self.time_limit_s = started_at, lead_s, time_limit_s
        self.every, self.async_save = every, async_save
        self.startup_s: float | None = None
        self.step_seconds, self.steps = 0.0, 0
        self.warned = False
        self.write_failed = False

    def _append(self, event: str, step: int | None, text: str = "", **fields) -> list[str]:
        """Append a line; a failure is reported once and does not stop training (the
        guard then sees only the batch script's lines)."""
        try:
            append_event(self.run_dir, self.job, event, step, text, **fields)
        except OSError as err:
            if not self.write_failed:
                self.write_failed = True
                return [f"cannot append to {self.run_dir / RUN_PROGRESS_FILE}: {err}"]
        return []

    @classmethod
    def for_this_run(
        cls,
        run_dir: Path,
        lead_s: float,
        time_limit_s: float | None,
        every: int,
        async_save: bool,
        env: Mapping[str, str] = os.environ,
    ) -> ProgressRecorder | None:
        """A recorder when the batch script started this run, else None."""
        job = SlurmJob.of_this_process(env)
        settings = ProgressSettings(lead_s, time_limit(time_limit_s, env), every, async_save)
        return None if job is None else cls.for_job(job, run_dir, settings, env)

    @classmethod
    def for_job(
        cls,
        job: SlurmJob,
        run_dir: Path,
        settings: ProgressSettings,
        env: Mapping[str, str] = os.environ,
    ) -> ProgressRecorder | None:
        """A recorder of this run of ``job`` when the batch script started it, else None."""
        batch_start = _epoch(env, BATCH_START_ENV)
        if batch_start is None:
            return None
        s = settings
        return cls(run_dir, job, batch_start, s.lead_s, s.time_limit_s, s.every, s.async_save)

    def resumed(self, step: int) -> list[str]:
        """The first step is about to start, from ``step`` (0: a fresh start)."""
        self.startup_s = max(0.0, time.time() - self.started_at)
        return self._append("resumed", step, startup_s=f"{self.startup_s:.0f}", every=self.every)

    def step_done(self, seconds: float) -> None:
        self.step_seconds += seconds
        self.steps += 1

    def committed(self, step: int, save_s: float) -> list[str]:
        """Record a committed checkpoint; the first one of the run returns the warnings."""
        step_s = self.step_seconds / self.steps if self.steps else 0.0
        lines = self._append("saved", step, step_s=f"{step_s:.2f}", save_s=f"{save_s:.1f}")
        if self.warned:
            return lines
        self.warned = True
        warnings = coverage_warnings(
            self.lead_s, self.time_limit_s, self.startup_s or 0.0, step_s, save_s,
            self.every, self.async_save,
        )  # fmt: skip
        for warning in warnings:  # for the job log, where the batch script repeats them
            lines += self._append("warning", None, warning)
        return lines + warnings
