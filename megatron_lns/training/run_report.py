"""Where a run is, and its goodput, read from its run directory alone.

What ``megatron-lns status RUN_DIR`` prints and the trainer prints at the end of each
attempt: the step against ``trainer.max_steps`` (from the run's ``config.yaml``), the
tokens trained, the newest complete checkpoint, the attempts and what ended them, the
time to ``max_steps`` at the rate the last attempt measured, and the accounting of the
wall time (:mod:`.goodput`). Read-only and torch-free: it runs on a login node while the
run trains.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_lns.base.errors import UserError
from megatron_lns.base.processes import pid_alive
from megatron_lns.base.timestamps import local_time
from megatron_lns.config.sources import RUN_CONFIG, runs_inside_hint
from megatron_lns.runtime.progress_file import RUN_PROGRESS_FILE, ProgressEvent, read_progress
from megatron_lns.training.checkpoint_dirs import (
    MarkerError,
    checkpoint_problem,
    checkpoint_step,
    complete_checkpoints,
    is_checkpoint_dir,
    latest_complete_checkpoint,
    read_marker,
)
from megatron_lns.training.goodput import Goodput, account, duration, goodput_table
from megatron_lns.training.run_dir import LOCK_NAME, read_lock
from megatron_lns.training.run_status import RUN_STATUS_FILE, read_run_status


def _rounded(value: float | None, digits: int = 2) -> float | None:
    """As the records hold it (10 ms), not with a sum's float noise."""
    return None if value is None else round(value, digits)


class NotARunDirectory(UserError):
    """The directory given is not a run's (``<exp_manager.exp_dir>/<exp_manager.name>``)."""


class RunFileError(UserError):
    """A file of the run directory that is there but cannot be read (no permission, an
    I/O error, a config that is no YAML)."""


@dataclass
class RunReport:
    run_dir: Path
    max_steps: int | None
    seq_length: int | None
    step: int
    samples: int | None
    newest_checkpoint: Path | None
    # What a resume would refuse the newest checkpoint for (``checkpoint_problem``).
    newest_checkpoint_damage: str | None
    state: str  # finished / stopped / running / ended without a record
    goodput: Goodput
    last_record_at: float | None
    # The phase timeouts the hang watchdog learnt in the last attempt that recorded them.
    hang_timeouts: dict[str, float] = field(default_factory=dict)
    # The lines of run_progress that hold no record (torn or edited), left out.
    unreadable_progress_lines: list[int] = field(default_factory=list)
    # (samples, tokens) through the newest checkpoint the run is past, each stretch between
    # checkpoints at the sequence length it was trained at (:func:`_checkpointed_tokens`).
    checkpointed: tuple[int, int] = (0, 0)

    @property
    def tokens(self) -> int | None:
        """Tokens trained: those through the newest checkpoint, the rest at ``seq_length``."""
        if self.samples is None or self.seq_length is None:
            return None
        samples, tokens = self.checkpointed
        return tokens + (self.samples - samples) * self.seq_length

    @property
    def step_s(self) -> float | None:
        """Wall seconds per step of the last attempt that trained (saves and evaluation
        included, start-up not)."""
        rates = [a.step_s for a in self.goodput.attempts if a.step_s]
        return rates[-1] if rates else None

    @property
    def time_to_max_steps_s(self) -> float | None:
        if self.max_steps is None or self.step_s is None:
            return None
        return max(0, self.max_steps - self.step) * self.step_s

    @property
    def in_job_restarts(self) -> int:
        """The attempts that the launcher restarted inside the job after a dead or hung
        rank (``runtime/restarts.py``), not the scheduler or a person."""
        return sum(1 for a in self.goodput.attempts if a.in_job_restart > 0)

    @property
    def lost_steps(self) -> int:
        """Steps trained again after failures, over every attempt."""
        return sum(a.lost_steps for a in self.goodput.attempts)

    def endings(self) -> list[str]:
        """How each attempt ended: as recorded, else ``running`` (the last one, while the
        run directory's lock is held) or ``killed or crashed`` (no end recorded)."""
        attempts = self.goodput.attempts
        running = self.state.startswith("running")
        return [
            a.how or ("running" if running and a is attempts[-1] else "killed or crashed")
            for a in attempts
        ]

    def to_json(self) -> dict[str, Any]:
        g = self.goodput
        return {
            "run_dir": str(self.run_dir),
            "state": self.state,
            "step": self.step,
            "max_steps": self.max_steps,
            "samples": self.samples,
            "tokens": self.tokens,
            "newest_checkpoint": None if self.newest_checkpoint is None else str(
                self.newest_checkpoint
            ),
            "newest_checkpoint_damage": self.newest_checkpoint_damage,
            "attempts": len(g.attempts),
            "restarts": max(0, len(g.attempts) - 1),
            "in_job_restarts": self.in_job_restarts,
            "lost_steps": self.lost_steps,
            "step_s": _rounded(self.step_s, 4),
            "time_to_max_steps_s": _rounded(self.time_to_max_steps_s),
            "last_record_at": self.last_record_at,
            "hang_timeouts_s": self.hang_timeouts,
            "unreadable_progress_lines": self.unreadable_progress_lines,
            "wall_s": _rounded(g.wall_s),
            "goodput": _rounded(g.fraction, 4),
            "seconds": {name.replace(", ", "_").replace(" ", "_").replace("-", "_"): _rounded(value)
                        for name, value in g.rows.items()},
            "attempt_list": [
                {
                    "job_id": a.job_id, "restart": a.restart, "in_job_restart": a.in_job_restart,
                    "start": _rounded(a.start),
                    "wall_s": _rounded(a.wall_s), "from_step": a.first_step, "to_step": a.last_step,
                    "steps": a.steps, "ended": ended, "lost_steps": a.lost_steps,
                }
                for a, ended in zip(g.attempts, self.endings(), strict=True)
            ],
        }  # fmt: skip

    def lines(self) -> list[str]:
        g = self.goodput
        of = f" of {self.max_steps}" if self.max_steps is not None else ""
        tokens = f", {self.tokens:,} tokens" if self.tokens is not None else ""
        lines = [f"run {self.run_dir}: {self.state}", f"step {self.step}{of}{tokens}"]
        newest = self.newest_checkpoint
        lines.append(f"newest complete checkpoint: {newest.name if newest else 'none yet'}")
        if self.newest_checkpoint_damage:
            lines[-1] += (
                f", which {self.newest_checkpoint_damage}: a resume refuses it unless "
                "exp_manager.resume_past_unreadable=true"
            )
        ends = self.endings()
        said = ", ".join(f"{ends.count(e)} {e}" for e in dict.fromkeys(ends))
        restarts = max(0, len(g.attempts) - 1)
        in_job = f" ({self.in_job_restarts} in-job)" if self.in_job_restarts else ""
        lost = self.lost_steps
        recomputed = f"; {lost} step(s) trained again after failures" if lost else ""
        lines.append(
            f"attempts: {len(g.attempts)} ({said}); restarts: {restarts}{in_job}{recomputed}"
        )
        if self.time_to_max_steps_s:  # none for a finished run
            lines.append(
                f"time to max_steps: {duration(self.time_to_max_steps_s)} at "
                f"{self.step_s:.3g} s per step (the last attempt's rate, saves and "
                "evaluation included)"
            )
        if skipped := self.unreadable_progress_lines:
            lines.append(_unreadable_lines_note(self.run_dir / RUN_PROGRESS_FILE, skipped))
        if self.hang_timeouts:
            learnt = ", ".join(f"{phase} {s:g} s" for phase, s in self.hang_timeouts.items())
            lines.append(f"hang timeouts learnt (last attempt): {learnt}")
        if self.last_record_at is not None:  # a time (progress_file's reader checked it)
            at = local_time(self.last_record_at)
            lines.append(f"wall time accounted up to the last record, {at}:")
        return lines + goodput_table(g)


# The unreadable lines of run_progress that the report names; the rest are counted.
_LINES_NAMED = 5


def _unreadable_lines_note(path: Path, numbers: list[int]) -> str:
    """The report's line on the lines of ``path`` that hold no record."""
    named = ", ".join(map(str, numbers[:_LINES_NAMED]))
    if len(numbers) > _LINES_NAMED:
        named += f" and {len(numbers) - _LINES_NAMED} more"
    which = f"line {named} holds" if len(numbers) == 1 else f"lines {named} hold"
    return (
        f"note: {path}: {which} no record (torn by a kill, or edited); left out of the accounting"
    )


def _read(path: Path, reader: Callable[[], Any]) -> Any:
    """What ``reader`` reads of ``path``; :class:`RunFileError` naming ``path`` when the
    file is there but cannot be read, or is not the text or YAML it should be (the
    readers of the record files take whatever text they find)."""
    try:
        return reader()
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise RunFileError(f"cannot read {path}: {err}".splitlines()[0]) from None


def _is_run_dir(path: Path) -> bool:
    """What ``train`` leaves in every run directory it starts: ``checkpoints/`` (made
    first) and the config, or the records of its attempts; a checkpoint is none."""
    started = (path / "checkpoints").is_dir() and (path / RUN_CONFIG).is_file()
    return (started or (path / RUN_PROGRESS_FILE).is_file()) and not is_checkpoint_dir(path)


# How far above a checkpoint its run directory may be: checkpoints/abandoned-*/iter_*.
_LEVELS_TO_THE_RUN = 3


def _run_around(path: Path) -> Path | None:
    """The run directory that ``path`` lies inside (a checkpoint, ``checkpoints/``,
    ``tensorboard/``), if any, as the path was given (relative stays relative)."""
    absolute = Path(os.path.abspath(path))
    for parent in absolute.parents[:_LEVELS_TO_THE_RUN]:
        if _is_run_dir(parent):
            return parent if path.is_absolute() else Path(os.path.relpath(parent))
    return None


def _config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        return {}
    config = _read(path, lambda: yaml.safe_load(path.read_text()))
    return config if isinstance(config, dict) else {}


def _seq_length(config: dict[str, Any]) -> int | None:
    return _setting(config, "model", "encoder_seq_length") or _setting(
        config, "model", "data", "seq_length"
    )


def _checkpointed_tokens(checkpoints: Path, samples: int | None) -> tuple[int, int]:
    """(samples, tokens) through the newest complete checkpoint at or before ``samples``:
    the stretch before each checkpoint at the sequence length of its ``config.yaml`` (the
    run that wrote it trained every step since the one before: a resume with another
    sequence length, ``exp_manager.resume_with_changed_data``, cuts other samples). A
    checkpoint whose records cannot be read adds nothing (its stretch counts with the
    next)."""
    counted = (0, 0)
    # Each distinct config.yaml parsed once (~10 ms a parse): a run's checkpoints mostly
    # keep the same one, and a long run keeps every one it saved.
    lengths: dict[str, int | None] = {}
    for checkpoint in reversed(complete_checkpoints(checkpoints)):  # oldest first
        try:
            at = read_marker(checkpoint)["consumed_samples"]
            config = (checkpoint / RUN_CONFIG).read_text()
            if config not in lengths:
                lengths[config] = _seq_length(yaml.safe_load(config))
            length = lengths[config]
        except (MarkerError, OSError, ValueError, KeyError, yaml.YAMLError):
            continue
        if not isinstance(at, int) or length is None or samples is None or at > samples:
            break
        counted = (at, counted[1] + (at - counted[0]) * length)
    return counted


def _setting(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config if isinstance(config, int) and not isinstance(config, bool) else None


def _lock_holder(run_dir: Path) -> str | None:
    """Who holds the run directory's lock (``process P on HOST``; ``""`` when its record
    names none readably), or None when no run does: no lock, or one left on this host by
    a process that is gone (a killed run; the next run takes it over)."""
    holder = read_lock(run_dir / LOCK_NAME)
    if holder is None:
        return None
    if not holder.named:
        return ""
    if holder.host == socket.gethostname() and not pid_alive(holder.pid):
        return None
    return f"process {holder.pid} on {holder.host}"


def _state(run_dir: Path, goodput: Goodput, holder: str | None) -> str:
    if holder is not None:
        return f"running ({holder})" if holder else "running"
    last = goodput.attempts[-1].how if goodput.attempts else None
    if last is not None:
        return last
    status = _read(run_dir / RUN_STATUS_FILE, lambda: read_run_status(run_dir))
    if status is not None:
        return status[0]
    return "ended without a record (killed or crashed)" if goodput.attempts else "not started"


def run_report(run_dir: str | Path) -> RunReport:
    """Read ``run_dir`` (module doc); :class:`NotARunDirectory` when it is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        if run_dir.exists():
            raise NotARunDirectory(
                f"{run_dir} is a file, not a run directory: give "
                "<exp_manager.exp_dir>/<exp_manager.name>"
            )
        raise NotARunDirectory(f"{run_dir}: no such directory")
    if is_checkpoint_dir(run_dir):  # it holds a config.yaml too
        run = _run_around(run_dir)
        give = f"its run directory {run}" if run else "the run directory that holds it"
        raise NotARunDirectory(f"{run_dir} is a checkpoint, not a run directory: give {give}")
    if not any((run_dir / name).exists() for name in (RUN_CONFIG, RUN_PROGRESS_FILE)):
        run = _run_around(run_dir)
        hint = f"; it lies inside the run directory {run}: give that one" if run else ""
        raise NotARunDirectory(
            f"{run_dir} is not a run directory (no {RUN_CONFIG} or {RUN_PROGRESS_FILE}): give "
            f"<exp_manager.exp_dir>/<exp_manager.name>{hint or runs_inside_hint(run_dir)}"
        )
    config = _config(run_dir)  # one that cannot be read is named first
    if not _is_run_dir(run_dir):
        raise NotARunDirectory(
            f"{run_dir} is not a run directory (a {RUN_CONFIG}, but no checkpoints/ or "
            f"{RUN_PROGRESS_FILE}): give <exp_manager.exp_dir>/<exp_manager.name>"
        )
    newest = latest_complete_checkpoint(run_dir / "checkpoints")
    newest_step = checkpoint_step(newest) if newest else 0
    holder = _lock_holder(run_dir)
    progress = _read(run_dir / RUN_PROGRESS_FILE, lambda: read_progress(run_dir))
    events = progress.events
    goodput = account(events, None if holder is not None else newest_step)
    attempts = goodput.attempts
    last = attempts[-1] if attempts else None
    samples = last.samples if last else None
    return RunReport(
        run_dir=run_dir,
        max_steps=_setting(config, "trainer", "max_steps"),
        seq_length=_seq_length(config),
        step=max(last.last_step if last else 0, newest_step),
        samples=samples,
        newest_checkpoint=newest,
        newest_checkpoint_damage=checkpoint_problem(newest) if newest else None,
        state=_state(run_dir, goodput, holder),
        goodput=goodput,
        last_record_at=max((a.last_at for a in attempts), default=None),
        hang_timeouts=_hang_timeouts(events),
        unreadable_progress_lines=progress.unreadable,
        checkpointed=_checkpointed_tokens(run_dir / "checkpoints", samples),
    )


def _hang_timeouts(events: list[ProgressEvent]) -> dict[str, float]:
    """``{phase: seconds}`` of the last ``timeouts`` line (``attempt_recorder.py``)."""
    last = next((e for e in reversed(events) if e.event == "timeouts"), None)
    if last is None:
        return {}
    suffix = "_timeout_s"
    return {
        key.removesuffix(suffix): last.number(key) for key in last.fields if key.endswith(suffix)
    }
