"""Child processes that end with their parent, however the parent ends."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux;
    nothing elsewhere). A SIGKILLed parent runs no cleanup, so without this its workers
    would go on alone, and block forever writing to a pipe nobody reads."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
