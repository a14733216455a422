"""Write a directory all at once: into a hidden sibling, renamed into place at the end.

A conversion that fails, is interrupted or terminated (SIGTERM) half-way leaves OUT_DIR
as it was (absent or untouched); only a hidden ``.NAME.partial-HOST-PID`` sibling can remain
after a SIGKILL, and the next conversion into OUT_DIR on that host removes it once its
process is gone. The host is in the name because on a shared file system a pid says
nothing of another machine's processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from megatron_lns.base.disk import DiskFullError, disk_full_error, give_plain_modes, is_disk_full
from megatron_lns.base.processes import pid_alive
from megatron_lns.convert.errors import ConversionError


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty OUT_DIR unless ``overwrite``; refuse a file; refuse
    the current directory (``.``) and those above it: OUT_DIR is written as a sibling and
    renamed into place, which for these would leave the shell in a deleted directory (and
    ``.`` has no name to make the sibling's from)."""
    where, here = Path(os.path.abspath(out_dir)).resolve(), Path.cwd().resolve()
    if where == here or where in here.parents:
        what = "the current directory" if where == here else "a parent of the current directory"
        raise ConversionError(
            f"output directory {out_dir} is {what}, which the output would replace: name a "
            f"directory to write (e.g. {Path(out_dir) / 'out'})"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(
            f"output directory {out_dir} is not empty; pass --overwrite to replace it"
        )


def check_apart(out_dir: Path, source: Path, within: Path | None = None) -> None:
    """Refuse an OUT_DIR that is the input or holds it (--overwrite would delete it), or
    that lies inside ``within`` (a directory being read: a checkpoint, a model), which
    writing OUT_DIR would change."""
    out, src = out_dir.resolve(), source.resolve()
    if out == src or out in src.parents:
        raise ConversionError(f"output directory {out_dir} contains the input {source}")
    if within is not None and within.resolve() in out.parents:
        raise ConversionError(
            f"output directory {out_dir} is inside the input {within}: name a directory outside it"
        )


@contextlib.contextmanager
def staged_output_dir(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh staging directory that becomes ``out_dir`` if the block succeeds,
    every file in it with the mode a plain ``open()`` gives (``disk.give_plain_modes``).

    A full disk (anything written in the block, or the staging directory itself) is one
    :class:`~megatron_lns.base.errors.DiskFullError` naming ``out_dir``, after the staging
    directory is removed (its space given back)."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    then = f"; {out_dir} left as it was" if out_dir.exists() else f"; no {out_dir} written"
    place = Path(os.path.abspath(out_dir))  # 'x/..' has no name of its own: its place has
    staging = _staging_name(place, "partial", os.getpid())
    try:
        with _terminate_as_exit():
            with _unwritable(out_dir, then):
                place.parent.mkdir(parents=True, exist_ok=True)
                _remove_dead_stagings(place)
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir()
            yield staging
            # Ctrl-C and SIGTERM held back until the old OUT_DIR is gone: between the two
            # renames below there is no OUT_DIR, and before the removal a hidden old one.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if is_disk_full(err) or isinstance(err, DiskFullError):
            reason = err if isinstance(err, OSError) else None  # a writer's own error
            needed = getattr(err, "needed", None)
            raise disk_full_error(out_dir, reason, needed, then) from err
        raise
    previous = _staging_name(place, "replaced", os.getpid())
    try:
        with _unwritable(out_dir, then, cleanup=staging):
            give_plain_modes(staging)  # the umask's, not a writer's 0600 (safetensors)
            if place.exists():
                place.rename(previous)
            staging.rename(place)
        shutil.rmtree(previous, ignore_errors=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


PID_MAX_LIMIT = 2**22  # Linux's ceiling on /proc/sys/kernel/pid_max


def _staging_name(place: Path, kind: str, pid: int) -> Path:
    return place.with_name(f".{place.name}.{kind}-{socket.gethostname()}-{pid}")


def _remove_dead_stagings(place: Path) -> None:
    """Remove the staging directories that SIGKILLed conversions into ``place`` left on
    this host (their process is gone, so nothing writes them any more)."""
    if not place.parent.is_dir():
        return
    prefix = _staging_name(place, "partial", 0).name.removesuffix("0")
    for sibling in place.parent.iterdir():
        pid = sibling.name.removeprefix(prefix)
        ours = sibling.name.startswith(prefix) and pid.isascii() and pid.isdigit()
        if ours and 0 < int(pid) <= PID_MAX_LIMIT and not pid_alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM (kill, timeout, scancel) raised as ``SystemExit(143)`` in the block, so that
    the staging directory is removed as on Ctrl-C: by the default action the process died
    at once and left its staging directory behind. Only where SIGTERM has the default
    action, in the main thread (where Python runs handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous != signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _unwritable(out_dir: Path, then: str, cleanup: Path | None = None) -> Iterator[None]:
    """An OSError (a foreign directory) as one line naming OUT_DIR, worded as a full or
    read-only disk is (``disk.disk_full_error``), which is left to the caller; the staging
    directory ``cleanup`` is removed first."""
    try:
        yield
    except OSError as err:
        if is_disk_full(err):
            raise
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        reason = (err.strerror or str(err)).lower()
        raise ConversionError(f"cannot write {out_dir}: {reason}{then}") from None
