"""Writing the trainer's checkpoints: synchronously, or in the background, still atomic.

With ``exp_manager.checkpoint_callback_params.async_save`` a save costs the training
loop only the time to take the state (a copy to host memory on GPU; a ``fork`` on
CPU, whose copy-on-write pages freeze it): megatron-core's ``AsyncCallsQueue`` writes
each rank's shards from a forked process while training goes on. The checkpoint
counts only once megatron's finalisation has run, which it does after every rank's
writer has finished (an all-reduce agrees on that); its last step writes
``complete.json`` and renames ``iter_N.partial`` to ``iter_N`` (``checkpoint.py``).
A job killed before that leaves a ``.partial`` directory, which resume never picks.

All ranks call :meth:`CheckpointWriter.poll` at the same points (every step): it
finalises saves whose writers are done on every rank, without waiting. A new save,
the end of a run (normal, a stop request, ``exit_interval``, an error that every rank
raises) and anything that reads checkpoints first :meth:`wait` for the pending one; an
error on one rank abandons it (:meth:`close`).

No process outlives its rank: the writer and the server of the queue it reports
through (a ``multiprocessing`` manager; megatron's writer needs one that a forked
process can fill) ignore stop signals, which their rank acts on, and are killed by the
kernel when their rank dies (``PR_SET_PDEATHSIG``); :meth:`close` ends them otherwise.
megatron's persistent worker (Megatron-LM's ``--use-persistent-ckpt-worker``) is not
used: it needs CUDA in the worker, and on CPU it would share, not copy, the weights
that training goes on updating.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.managers import SyncManager
from pathlib import Path

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lns.base.parent_death import die_with_parent
from megatron_lns.runtime.fault_injection import inject_fault
from megatron_lns.training.checkpoint import save_checkpoint, start_checkpoint_save
from megatron_lns.training.checkpoint_dirs import TrainingState
from megatron_lns.training.checkpoint_io import (
    metadata_write_failures_kept,
    save_strategy,
    write_failure,
)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _follow_rank(rank_pid: int) -> None:
    """In a process forked by a rank: die with it, and leave stop signals to it."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, rank_pid)


def _write_following_rank(rank_pid: int, write, *args, **kwargs) -> None:
    _follow_rank(rank_pid)
    write(*args, **kwargs)


class CheckpointWriter:
    """Saves checkpoints under ``root``; all ranks make the same calls in the same order.

    ``asynchronous``: write in the background (module doc). ``parallel``: spread the
    writing of replicated shards over the data-parallel ranks (``checkpoint.save_strategy``).
    ``on_commit(path, seconds)`` runs once each checkpoint is committed, with the seconds
    from the start of its save (for an asynchronous one, up to the poll that committed it).
    """

    def __init__(
        self,
        root: str | Path,
        asynchronous: bool = False,
        parallel: bool = False,
        on_commit: Callable[[Path, float], None] | None = None,
    ):
        self.root = Path(root)
        self.asynchronous = asynchronous
        self.parallel = parallel
        self.on_commit = on_commit
        self._calls = AsyncCallsQueue(persistent=False) if asynchronous else None
        self._results_server: SyncManager | None = None
        self._results_queue = None
        self._pending: dict[int, Path] = {}  # megatron's call index -> checkpoint
        self._started: dict[int, float] = {}  # megatron's call index -> its save's start

    @property
    def pending(self) -> list[Path]:
        """Checkpoints being written and not yet committed."""
        return list(self._pending.values())

    def save(self, model, optimizer, scheduler, state: TrainingState, config_yaml: str) -> Path:
        """Save the current step; returns the directory it is (or will be) committed as.

        A synchronous save returns once the checkpoint is committed; an asynchronous one
        once the state is taken, after waiting for the previous save to be committed.
        """
        started = time.perf_counter()
        if not self.asynchronous:
            final = save_checkpoint(
                self.root, model, optimizer, scheduler, state, config_yaml,
                save_strategy(self.parallel),
            )  # fmt: skip
            self._committed(final, started)
            return final
        self.wait()
        started = time.perf_counter()  # the previous save's wait is not this save's time
        final, request = start_checkpoint_save(
            self.root, model, optimizer, scheduler, state, config_yaml,
            save_strategy(self.parallel), self._results(),
        )  # fmt: skip
        if request.async_fn is not None:  # None: this rank has nothing to write
            request = request._replace(
                async_fn=partial(_write_following_rank, os.getpid(), request.async_fn)
            )
        index = self._calls.schedule_async_request(request)
        self._pending[index], self._started[index] = final, started
        inject_fault("save", state.iteration)  # being written, not committed: a test's fault
        return final

    def _committed(self, path: Path, started: float) -> None:
        if self.on_commit is not None:
            self.on_commit(path, time.perf_counter() - started)

    def poll(self) -> list[Path]:
        """Commit the saves that every rank has finished writing; never waits."""
        return self._finalize(blocking=False)

    def wait(self) -> list[Path]:
        """Wait until every pending save is written on every rank, and commit it."""
        return self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> list[Path]:
        if not self._pending:
            return []
        try:
            with metadata_write_failures_kept():  # its commit raises them on every rank
                done = self._calls.maybe_finalize_async_calls(blocking=blocking)
        except (Exception, CheckpointException) as err:
            # torch's CheckpointException derives from BaseException.
            failed = next(iter(self._pending.values()))  # the oldest: finalised first
            self._pending.clear()
            self._started.clear()
            partial = failed.with_name(f"{failed.name}.partial")
            raise write_failure(failed, partial, err) from err
        committed = [self._pending.pop(index) for index in done]
        for index, path in zip(done, committed, strict=True):
            self._committed(path, self._started.pop(index))
        return committed

    def _results(self):
        """The queue megatron's forked writer reports through, served by a process that
        follows this rank (module doc); started on first use."""
        if self._results_server is None:
            server = SyncManager(ctx=multiprocessing.get_context("fork"))
            server.start(initializer=_follow_rank, initargs=(os.getpid(),))
            self._results_server, self._results_queue = server, server.Queue()
        return self._results_queue

    def close(self) -> None:
        """End the helper processes (idempotent). A save still pending is abandoned: its
        writer is killed and it stays ``.partial``. Committing it takes :meth:`wait` on
        every rank first, which an error on one rank cannot promise."""
        if self._calls is not None:
            for call in self._calls.async_calls:
                call.async_caller.close(abort=True)
            self._calls.async_calls.clear()
            self._pending.clear()
            self._started.clear()
        if self._results_server is not None:
            with contextlib.suppress(Exception):
                self._results_server.shutdown()
            self._results_server = self._results_queue = None
