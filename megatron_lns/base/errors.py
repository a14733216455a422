"""The one base class of every error that is the user's to fix.

A :class:`UserError` is a problem with the input (config, data, checkpoint, run
directory), not a bug: the command line prints its message as one line and exits
with code 2, without a traceback (set ``MEGATRON_LNS_DEBUG=1`` to see one). Each
package raises its own subclass (``ConfigError``, ``DataMismatchError``,
``CheckpointError``, ...); anything else that escapes is a bug and keeps its
traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

DEBUG_ENV = "MEGATRON_LNS_DEBUG"
USER_ERROR_EXIT_CODE = 2
# A rank whose watchdog found the run hung ends with this (EX_TEMPFAIL: try again): the
# launcher restarts the attempt in-job (see restartable_exit).
HUNG_EXIT_CODE = 75
# What a launcher sees of a rank interrupted by the user (Ctrl-C) or stopped by SIGTERM.
_INTERRUPTED_EXIT_CODES = (130, 143, -2, -15)
# Set by the local launcher: the file whose creation claims the right to report.
REPORT_MARKER_ENV = "MEGATRON_LNS_ERROR_MARKER"


class UserError(Exception):
    """An input problem; the message is one line that names the key, file or path."""


def last_line(err: BaseException) -> str:
    """The last line of ``err``'s message (its type's name when it has none): what a
    library's error that carries a traceback in its text (torch's
    ``CheckpointException``) says of the cause, for a one-line message."""
    text = str(err).strip()
    return text.splitlines()[-1] if text else type(err).__name__


def restartable_exit(exit_code: int) -> bool:
    """Whether a rank that ended with ``exit_code`` (negative: killed by that signal, as
    Python's subprocess reports it; 128 + N: as a shell or srun does) ends an attempt that
    the launcher may restart in-job: a crash, a kill or a hang, but not a success, an input
    error (which a restart would only repeat) or the user's interrupt or SIGTERM."""
    return exit_code not in (0, USER_ERROR_EXIT_CODE, *_INTERRUPTED_EXIT_CODES)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false")


MARKER_PREFIX = "megatron-lns-error-"


def _report_marker() -> Path | None:
    """The file that the first reporting rank of this run creates, or None for a run of
    one process. Ranks of one launch on one node share a parent (the local launcher,
    torchrun's agent, slurmstepd) and a rendezvous port; the parent's start time tells
    it from a later process given the same pid."""
    if explicit := os.environ.get(REPORT_MARKER_ENV):
        return Path(explicit)
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) <= 1:  # not a number: launcher_env refuses it
        return None
    parent = os.getppid()
    key = f"{parent}-{_start_time(parent)}-{os.environ.get('MASTER_PORT', '')}"
    return Path(tempfile.gettempdir()) / f"{MARKER_PREFIX}{key}"


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name in () may hold spaces


def _remove_markers_of_ended_launches() -> None:
    """An external launcher's ranks cannot tell when the last of them has reported, so
    their marker stays; it is removed here, by a later launch, once its parent is gone."""
    for marker in Path(tempfile.gettempdir()).glob(f"{MARKER_PREFIX}*"):
        pid, _, rest = marker.name[len(MARKER_PREFIX) :].partition("-")
        start = rest.partition("-")[0]
        if pid.isdigit() and _start_time(int(pid)) != start:
            marker.unlink(missing_ok=True)


def report_user_error_once(err: UserError) -> None:
    """Print ``error: ...`` to stderr unless another rank of this run already did."""
    marker = _report_marker()
    if marker is not None:
        if os.environ.get(REPORT_MARKER_ENV) is None:
            _remove_markers_of_ended_launches()
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    print(f"error: {err}", file=sys.stderr, flush=True)


def rank_ended(rank: int, exit_code: int, raised: bool = False) -> str:
    """How a rank of a local run ended, in the words of every line that says it:
    ``rank 1 was killed by SIGKILL``, ``rank 0 raised an error (its traceback above)``,
    ``rank 2 exited with code 3``. ``exit_code`` is negative for a signal (Python's way)."""
    if exit_code < 0:
        try:
            return f"rank {rank} was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"rank {rank} was killed by signal {-exit_code}"
    if raised:
        return f"rank {rank} raised an error (its traceback above)"
    return f"rank {rank} exited with code {exit_code}"


class RankFailed(Exception):
    """A rank of a local multi-process run exited with an error (``runtime.local_ranks``)."""

    explained = False  # whether the message says all (else the rank's output says why)
    status = 1  # the launcher's exit status

    def __init__(self, rank: int, exit_code: int, raised: bool = False) -> None:
        super().__init__(rank_ended(rank, exit_code, raised))
        self.rank = rank
        self.exit_code = exit_code
        # A signal says why itself: a rank killed from outside printed nothing.
        self.explained = self.explained or exit_code < 0 or raised


class RanksStopped(RankFailed):
    """The user's stop signals to the launcher (``signals``, in order) ended its ranks
    before they could stop cleanly at a step boundary: before any had started (``rank``
    None), or one of them ended by the signal (it was starting) or by the SIGKILL that a
    second stop sends. The launcher exits with 128 + the first signal, as a shell does."""

    explained = True

    def __init__(
        self, signals: list[int], rank: int | None = None, exit_code: int = 0, raised: bool = False
    ) -> None:
        super().__init__(-1 if rank is None else rank, exit_code, raised)
        names = " then ".join(signal.Signals(s).name for s in signals)
        if rank is None:
            said = f"stopped by {names} before the ranks started"
        else:
            ended = rank_ended(rank, exit_code, raised)
            why = " (a second stop kills the ranks)" if len(signals) > 1 else ""
            said = f"stopped by {names}: {ended} before it could stop at a step{why}"
        self.args = (f"{said}; rerun to resume",)
        self.status = 128 + signals[0]
