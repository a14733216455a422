"""Child processes that end with their parent, however the parent ends."""

from __future__ import annotations

import ctypes
import os
import select
import sys
import threading

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int, parent: int) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux;
    nothing elsewhere). A SIGKILLed parent runs no cleanup, so without this its workers
    would go on alone, and block forever writing to a pipe nobody reads.

    The request covers only a parent alive when it is made: ``parent`` is the process
    that started this one, and if it is already gone (a spawned worker spends seconds
    importing before it gets here) ``signum`` comes at once."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def own_pidfd() -> int | None:
    """A pidfd of this process (Linux >= 5.3) for :func:`end_with_process`; None elsewhere
    (``os.pidfd_open`` exists on older Linux kernels too, and fails there)."""
    try:
        return os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return None


def end_with_process(pidfd: int | None, signum: int) -> None:
    """Send ``signum`` to this process once the process of ``pidfd`` has ended (at once if
    it has already), whether or not that process is the parent.

    For a process started on another's behalf by a server: a rank forked by
    multiprocessing's forkserver has the server as its parent, and the server does not
    end with the launcher that asked for the rank (each process it forks keeps the
    server's liveness pipe open), so the parent-death signal never comes. A daemon thread
    waits for the pidfd to become readable, which it does when its process ends."""
    if pidfd is None:
        return

    def wait_then_signal() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait_then_signal, name="end-with-launcher", daemon=True).start()
