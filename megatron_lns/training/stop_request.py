"""A request to stop training cleanly: a checkpoint, then an exit at the next step boundary.

The job environment names the signals that ask for it
(:meth:`~megatron_lns.runtime.job.JobEnvironment.stop_signals`: TERM, a scheduler's
pre-emption warning USR1, INT); a second SIGINT interrupts at once. Every rank stops at the
same step, whichever rank the signal reached.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_lns.runtime.early_stops import take_early_stops


class StopRequest:
    """Installs its handler for ``signals`` until :meth:`restore`."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self.requested = False
        self.previous = {}
        for sig in signals:
            # Only the main thread may install handlers (not so under some runners).
            with contextlib.suppress(ValueError):
                self.previous[sig] = signal.signal(sig, self._handle)
        # A stop sent while the command started counts as one sent now (early_stops.py).
        self.requested = bool(take_early_stops())

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop: every rank stops at the same step."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
