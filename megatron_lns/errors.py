"""The one base class of every error that is the user's to fix.

A :class:`UserError` is a problem with the input (config, data, checkpoint, run
directory), not a bug: the command line prints its message as one line and exits
with code 2, without a traceback (set ``MEGATRON_LNS_DEBUG=1`` to see one). Each
package raises its own subclass (``ConfigError``, ``DataMismatchError``,
``CheckpointError``, ...); anything else that escapes is a bug and keeps its
traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

DEBUG_ENV = "MEGATRON_LNS_DEBUG"
USER_ERROR_EXIT_CODE = 2
# Set by the local launcher: the file whose creation claims the right to report.
REPORT_MARKER_ENV = "MEGATRON_LNS_ERROR_MARKER"


class UserError(Exception):
    """An input problem; the message is one line that names the key, file or path."""


class DiskFullError(UserError):
    """A write that failed because its filesystem is full, over quota or read-only;
    ``needed``: the bytes it needed, where known."""

    def __init__(self, message: str, needed: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed

    def __reduce__(self):  # pickled between ranks with what it needed
        return type(self), (str(self), self.needed)


# What a write fails with when the disk, not the program, is the problem.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def is_disk_full(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (or of
    its nearest existing parent); None when that cannot be told."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def byte_size(count: int) -> str:
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):  # the unit reached is kept
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"


def disk_full_error(
    path: str | Path, err: OSError | None = None, needed: int | None = None, then: str = ""
) -> DiskFullError:
    """The one line for a write to ``path`` that the disk refused: why (``err``'s reason,
    or a full disk when the writer lost it), what is free and, where known, ``needed``;
    ``then``: what became of the output."""
    reason = os.strerror(err.errno) if err is not None else os.strerror(errno.ENOSPC)
    free = free_bytes(path)
    space = [] if free is None else [f"{byte_size(free)} free there"]
    if needed is not None:
        space.append(f"about {byte_size(needed)} needed")
    detail = f" ({', '.join(space)})" if space and (err is None or err.errno != errno.EROFS) else ""
    return DiskFullError(f"cannot write {path}: {reason.lower()}{detail}{then}", needed)


@contextlib.contextmanager
def disk_full_reported(
    path: str | Path, needed: int | None = None, then: str = ""
) -> Iterator[None]:
    """Turn a write's full-disk ``OSError`` (:data:`DISK_FULL_ERRNOS`) in the block into a
    :class:`DiskFullError` naming ``path``; any other error passes unchanged."""
    try:
        yield
    except OSError as err:
        if not is_disk_full(err):
            raise
        raise disk_full_error(path, err, needed, then) from err


def as_user_error(err: BaseException) -> UserError | None:
    """``err`` as the user's to fix, or None for a bug: the last resort of every entry
    point, for a full disk no writer turned into a :class:`DiskFullError` itself."""
    if isinstance(err, UserError):
        return err
    if is_disk_full(err):
        return disk_full_error(err.filename or "a file", err)
    return None


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false")


def _report_marker() -> Path | None:
    """The file that the first reporting rank of this run creates, or None for a run of
    one process. Ranks of one launch on one node share a parent (the local launcher,
    torchrun's agent, slurmstepd) and a rendezvous port."""
    if explicit := os.environ.get(REPORT_MARKER_ENV):
        return Path(explicit)
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) <= 1:  # not a number: launcher_env refuses it
        return None
    key = f"{os.getppid()}-{os.environ.get('MASTER_PORT', '')}"
    return Path(tempfile.gettempdir()) / f"megatron-lns-error-{key}"


def report_user_error_once(err: UserError) -> None:
    """Print ``error: ...`` to stderr unless another rank of this run already did."""
    marker = _report_marker()
    if marker is not None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    print(f"error: {err}", file=sys.stderr, flush=True)


class RankFailed(Exception):
    """A rank of a local multi-process run exited with an error (``runtime.local_ranks``)."""

    def __init__(self, rank: int, exit_code: int) -> None:
        super().__init__(f"rank {rank} exited with code {exit_code}")
        self.rank = rank
        self.exit_code = exit_code
