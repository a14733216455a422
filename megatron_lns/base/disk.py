"""Writes that the disk refuses: one line naming what could not be written.

A full disk, an exhausted quota or a read-only filesystem is the user's to fix, not a
bug; every writer of the package (checkpoints, conversions, ``preprocess``, the run's
records) reports it as a :class:`DiskFullError` naming its output, the space free and,
where known, the space needed, and leaves nothing that a later command would take as
complete. :func:`as_user_error` is the last resort of the entry points, for a write
that no writer reported itself. The small files replaced whole
(:func:`write_text_atomically`: a run's config and status, records, receipts) report
any refused write so (:class:`WriteError`): a directory or an immutable file where one
goes is the user's to move too.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_lns.base.errors import UserError


class WriteError(UserError):
    """A write that the filesystem refused, naming its output: a directory where the file
    goes, a file that may not be replaced, a full disk (:class:`DiskFullError`)."""


class DiskFullError(WriteError):
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


def plain_file_mode() -> int:
    """The mode ``open()`` gives a new file in this process: 0o666 less the umask."""
    try:  # Linux says it without changing it (os.umask would, for a moment, every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def give_plain_modes(directory: str | Path) -> None:
    """Give every file under ``directory`` the mode :func:`plain_file_mode`: some writers
    (safetensors' ``save_file``) create theirs 0600, readable by their owner alone,
    which a published model or dataset must not be."""
    mode = plain_file_mode()
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def byte_size(count: int) -> str:
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):  # the unit reached is kept
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"


def disk_full_error(
    path: str | Path,
    err: OSError | None = None,
    needed: int | None = None,
    then: str = "",
    free: int | None = None,
) -> DiskFullError:
    """The one line for a write to ``path`` that the disk refused: why (``err``'s reason,
    or a full disk when the writer lost it), what is free (``free``, measured when the
    write failed, else now) and, where known, ``needed``; ``then``: what became of the
    output."""
    reason = os.strerror(err.errno) if err is not None else os.strerror(errno.ENOSPC)
    free = free_bytes(path) if free is None else free
    space = [] if free is None else [f"{byte_size(free)} free there"]
    if needed is not None:
        space.append(f"about {byte_size(needed)} needed")
    detail = f" ({', '.join(space)})" if space and (err is None or err.errno != errno.EROFS) else ""
    return DiskFullError(f"cannot write {path}: {reason.lower()}{detail}{then}", needed)


@contextlib.contextmanager
def disk_full_reported(
    path: str | Path,
    needed: int | None = None,
    then: str = "",
    cleanup: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Turn a write's full-disk ``OSError`` (:data:`DISK_FULL_ERRNOS`) in the block into a
    :class:`DiskFullError` naming ``path``; any other error passes unchanged.

    ``cleanup`` (removing what the failed write left) runs on any error, before the space
    free is measured: the line says what ``df`` shows once the command has ended."""
    try:
        yield
    except OSError as err:
        if cleanup is not None:
            cleanup()
        if not is_disk_full(err):
            raise
        raise disk_full_error(path, err, needed, then) from err
    except BaseException:
        if cleanup is not None:
            cleanup()
        raise


def as_user_error(err: BaseException) -> UserError | None:
    """``err`` as the user's to fix, or None for a bug: the last resort of every entry
    point, for a full disk no writer turned into a :class:`DiskFullError` itself."""
    if isinstance(err, UserError):
        return err
    if is_disk_full(err):
        return disk_full_error(err.filename or "a file", err)
    return None


def write_text_atomically(
    path: str | Path, text: str | bytes, then: str = "", temporary: Path | None = None
) -> None:
    """Replace ``path`` with ``text`` whole or not at all: a write the filesystem refuses
    leaves the old file (no truncated one) and no temporary file, and raises
    :class:`DiskFullError` for a full disk, else :class:`WriteError` (``then``: what that
    means for the reader of ``path``). ``temporary``: the name written first (default
    ``PATH.tmp-PID``). Bytes are written as they are: a file put back as it was read,
    whatever its encoding."""
    path = Path(path)
    temporary = temporary or path.with_name(f"{path.name}.tmp-{os.getpid()}")

    def remove_temporary() -> None:  # what the write left, if it could; its error is the news
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)

    with disk_full_reported(path, then=then, cleanup=remove_temporary):
        try:
            if isinstance(text, bytes):
                temporary.write_bytes(text)
            else:
                temporary.write_text(text)
            os.replace(temporary, path)
        except OSError as err:
            if is_disk_full(err):
                raise  # with the space free, by disk_full_reported
            reason = (err.strerror or str(err)).lower()
            raise WriteError(f"cannot write {path}: {reason}{then}") from err
