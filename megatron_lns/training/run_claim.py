"""A start's hold on its run directory, until resume has accepted it.

A start replaces the run directory's ``config.yaml`` (with its own config) and removes
its ``run_status`` as soon as it holds the lock; but resume may yet refuse it (another
precision, a damaged checkpoint, a changed LR schedule), or its data, or a Ctrl-C, may
end it first. Those two files must go on describing the run that last trained there
(``megatron-lns status``, ``train RUN_DIR``), so rank 0 keeps what they held
(:class:`LastRunFiles`) and, if the start ends before it is committed
(:meth:`RunClaim.commit`, once resume has chosen its checkpoint or found none), puts
them back before it releases the lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.base.disk import WriteError, write_text_atomically
from megatron_lns.training.run_dir import REPLACED_RUN_FILES, RunDirLock


@dataclass(frozen=True)
class LastRunFiles:
    """The bytes of each of the run files a start replaces (``run_dir.REPLACED_RUN_FILES``)
    that the last run left and could be read; a file absent (a new run: its config stays,
    as a record of what was tried) or unreadable is not put back."""

    contents: dict[str, bytes]

    @classmethod
    def read(cls, run_dir: Path) -> LastRunFiles:
        """What ``run_dir`` holds now; read holding the lock, before the start writes."""
        contents = {}
        for name in REPLACED_RUN_FILES:
            try:
                contents[name] = (run_dir / name).read_bytes()
            except OSError:  # absent, or unreadable: nothing to put back
                continue
        return cls(contents)

    def put_back(self, run_dir: Path, say: Callable[[str], None]) -> None:
        """Write each file back as it was read. A write refused is a warning, not an
        error: the start is failing already, and its own error is the news."""
        for name, content in self.contents.items():
            if _holds(run_dir / name, content):  # the start failed before replacing it
                continue
            try:
                write_text_atomically(run_dir / name, content)
            except WriteError as err:
                say(f"warning: {run_dir / name} could not be put back as it was: {err}")


def _holds(path: Path, content: bytes) -> bool:
    try:
        return path.read_bytes() == content
    except OSError:
        return False


@dataclass
class RunClaim:
    """The lock on a run directory (rank 0's) and what the last run left there, put back
    by :meth:`release` unless :meth:`commit` came first; ``say``: where a warning goes."""

    lock: RunDirLock
    run_dir: Path
    last: LastRunFiles
    say: Callable[[str], None]
    committed: bool = False

    def commit(self) -> None:
        """The start got past resume: its config and the absent ``run_status`` now
        describe the run, whatever ends it."""
        self.committed = True

    def release(self) -> None:
        """Put back what the last run left (for a start that was not committed), then
        release the lock; idempotent."""
        if not self.lock.held:
            return
        try:
            if not self.committed:
                self.last.put_back(self.run_dir, self.say)
        finally:
            self.lock.release()
