"""The published files of a dataset: where they go, and how they get there whole.

Everything is written under a temporary name beside the output and renamed into place
at the end, with Ctrl-C and SIGTERM noted and acted on only at safe points.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_lns.data.errors import PreprocessError

OUTPUT_SUFFIXES = (".bin", ".idx", ".json", ".manifest.json")


def parts_directory(output_prefix: Path) -> Path:
    """``PREFIX.parts/``: a run's work in progress (plan, units, receipts, lock) and its
    SLURM submissions, beside the output it becomes."""
    return output_prefix.with_name(f"{output_prefix.name}.parts")


class StopSignals:
    """Ctrl-C and SIGTERM, noted when they arrive and acted on at a safe point.

    Raising from the handler itself could interrupt a queue or a rename halfway, so the
    handler only records the signal and :meth:`check` raises: ``KeyboardInterrupt`` for
    SIGINT, ``SystemExit(128 + signum)`` for SIGTERM; the cleanup runs as for any error.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def check(self) -> None:
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is not None:
            raise SystemExit(128 + self.received)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def publish(temporary: str, output_prefix: Path, suffixes: tuple[str, ...]) -> None:
    """Rename the finished files into place, ``.json`` last, with Ctrl-C and SIGTERM held
    back so a signal cannot leave a new ``.bin`` beside an old ``.idx``."""
    held = {signal.SIGINT, signal.SIGTERM}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        for suffix in suffixes:
            os.replace(f"{temporary}{suffix}", f"{output_prefix}{suffix}")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def check_output_prefix(output_prefix: Path) -> None:
    """Refuse a prefix that names a directory, not the files: ``.``, ``..``, ``/`` or
    empty, whose last part is no file name (``PREFIX.bin`` and ``PREFIX.parts/`` are made
    by adding to that name)."""
    if output_prefix.name in ("", ".."):
        raise PreprocessError(
            f"output prefix {output_prefix} names a directory, not the files (e.g. "
            f"{output_prefix / 'corpus'} writes {output_prefix / 'corpus'}.bin)"
        )


def output_file_finder(output_prefix: Path) -> Callable[[Path], str | None]:
    """``which(path)``: which of the output's files ``path`` is (``PREFIX.json``, a
    temporary file) or lies in (``PREFIX.parts/``), in words; None when it is none of
    them. An input that is one would be overwritten by the run, or read back by the next
    one as a new input. The prefix is located once, for the many files of a directory.

    Paths are compared where they are in the file system: by their directory, resolved,
    and their name (what a rename replaces), and by what they resolve to (a link)."""
    prefix = _location(output_prefix)
    parts = parts_directory(prefix)

    def which(path: Path) -> str | None:
        for place in (_location(path), path.resolve()):
            if place == parts or parts in place.parents:
                return f"in {parts_directory(output_prefix)}/"
            if place.parent != prefix.parent:
                continue
            for suffix in OUTPUT_SUFFIXES:
                if place.name == f"{prefix.name}{suffix}":
                    return f"{output_prefix}{suffix}"
            if place.name.startswith(f"{prefix.name}.tmp-"):
                return f"a temporary file of {output_prefix}"
        return None

    return which


def _location(path: Path) -> Path:
    return path.absolute().parent.resolve() / path.name


def check_output_place(output_prefix: Path, create: bool = True) -> None:
    """Refuse an output the run could not write, before it tokenizes anything. The output's
    directory is made (``create``), or else only found makeable: a job submitted to write
    it makes it itself, and a refused submission leaves nothing behind."""
    check_output_prefix(output_prefix)
    for suffix in OUTPUT_SUFFIXES:
        if Path(f"{output_prefix}{suffix}").is_dir():  # found before tokenizing, not after
            raise PreprocessError(f"cannot write {output_prefix}{suffix}: it is a directory")
    directory = existing = output_prefix.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # where the rest is made
    if not existing.is_dir():
        raise PreprocessError(
            f"cannot write {output_prefix}.bin: {existing} is a file, not a directory"
        )
    if create:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PreprocessError(f"cannot create {directory}: {err.strerror}") from None
        existing = directory
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PreprocessError(f"cannot write to {existing}: permission denied")


def temporary_prefix(output_prefix: Path) -> str:
    # Unique per process and host: concurrent writers of one prefix never share a file.
    return str(output_prefix.with_name(f"{output_prefix.name}.tmp-{uuid.uuid4().hex[:12]}"))


def remove_temporaries(temporary: str) -> None:
    for suffix in (*OUTPUT_SUFFIXES, ".lengths"):
        Path(f"{temporary}{suffix}").unlink(missing_ok=True)
