"""The ranks' rendezvous: rank 0's TCP store, which every rank joins, with a time limit.

torch waits for missing peers for its process-group timeout (30 minutes and more), in
C++ where Python's signal handlers do not run: a rank whose peers never come (a stale
``RANK``/``WORLD_SIZE``, a peer that died while starting) looked hung and ignored
SIGTERM. Here the store is made in a helper thread while the main thread waits, so

* after ``timeout_s`` (``trainer.rendezvous_timeout_s``) the rank ends with one line
  saying which rank waited for whom at which address, and why that usually happens;
* SIGTERM or SIGINT during the wait ends the process at once, with one line;
* a wait longer than a few seconds is announced, so a quiet terminal is explained;
* torch's own log of a failed wait (a C++ stack trace on stderr) is held back and
  replaced by that one line; after a success, whatever it wrote is passed on.

The store then gets torch's usual timeout back: only the first meeting is bounded here,
not the collectives or later store operations (a NCCL communicator made lazily).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import IO, Any

import torch.distributed as dist

from megatron_lns.base.errors import UserError, debug_enabled
from megatron_lns.runtime.launcher_env import LauncherEnvironment

DEFAULT_TIMEOUT_S = 600.0
# A wait longer than this is announced on stderr.
ANNOUNCE_AFTER_S = 5.0
TIMEOUT_KEY = "trainer.rendezvous_timeout_s"


class RendezvousError(UserError, RuntimeError):
    """The ranks did not meet: a peer never came, or the wait was interrupted."""


def _whom(launch: LauncherEnvironment) -> str:
    address = f"{launch.master_addr}:{launch.master_port}"
    if launch.rank == 0:
        return (
            f"rank 0 of {launch.world_size} waited for the other {launch.world_size - 1} "
            f"rank(s) at {address}"
        )
    return f"rank {launch.rank} of {launch.world_size} waited for rank 0's store at {address}"


def _cause(launch: LauncherEnvironment) -> str:
    return (
        f"the launcher environment ({launch.describe()}) names ranks that were not started "
        "(left over from another launch? unset those variables to let megatron-lns start "
        "trainer.devices processes itself), a peer failed before joining (see its output), "
        "or MASTER_ADDR:MASTER_PORT is not reachable from every rank"
    )


def _make_store(launch: LauncherEnvironment, timeout_s: float, result: dict[str, Any]) -> None:
    try:
        rendezvous = dist.rendezvous(
            "env://",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result["store"] = next(rendezvous)[0]
    except BaseException as err:  # handed to the main thread
        result["error"] = err


@contextlib.contextmanager
def _stderr_held() -> Iterator[IO[str]]:
    """File descriptor 2 goes to a temporary file meanwhile (torch's C++ logs write
    there); yields the real stderr for this module's own lines. What was held is passed
    on unless the block raised (under MEGATRON_LNS_DEBUG it is passed on always)."""
    sys.stderr.flush()
    real = os.dup(2)
    with tempfile.TemporaryFile() as held, os.fdopen(os.dup(real), "w") as ours:
        os.dup2(held.fileno(), 2)
        failed = True
        try:
            yield ours
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(real, 2)
            os.close(real)
            if not failed or debug_enabled():
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))
                sys.stderr.flush()


class _Failed(Exception):
    """The store could not be made (the error is in the result): torch's log is dropped."""


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def rendezvous_store(launch: LauncherEnvironment, timeout_s: float) -> dist.Store:
    """The store every rank of ``launch`` has joined, within ``timeout_s`` seconds, for
    ``dist.init_process_group(store=...)``; :class:`RendezvousError` otherwise."""
    result: dict[str, Any] = {}
    worker = threading.Thread(
        target=_make_store, args=(launch, timeout_s, result), name="rendezvous", daemon=True
    )
    start = time.monotonic()

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, interrupt)
    try:
        with _stderr_held() as stderr:
            worker.start()
            worker.join(ANNOUNCE_AFTER_S)
            # A timeout shorter than the announcement's delay ends in the error line itself
            # (a loaded machine can take longer than the timeout to report it).
            if worker.is_alive() and timeout_s > ANNOUNCE_AFTER_S:
                print(
                    f"{_whom(launch).replace('waited', 'is waiting')} (up to {timeout_s:g} s, "
                    f"{TIMEOUT_KEY})",
                    file=stderr,
                    flush=True,
                )
            while worker.is_alive():
                worker.join(0.5)
            if "error" in result:
                raise _Failed
    except _Failed:
        pass
    except _Interrupted as stop:
        # The helper thread is left blocked in torch; the process is about to exit.
        raise RendezvousError(
            f"stopped by {signal.Signals(stop.signum).name} after {time.monotonic() - start:.0f}"
            f" s while {_whom(launch)}; nothing was started"
        ) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    error = result.get("error")
    if isinstance(error, dist.DistError):
        waited = time.monotonic() - start
        torch_says = (str(error).strip() or type(error).__name__).splitlines()[0]
        outcome = "and gave up" if waited >= 0.9 * timeout_s else "and failed"
        raise RendezvousError(
            f"{_whom(launch)} for {waited:.0f} s {outcome} ({TIMEOUT_KEY}={timeout_s:g}; "
            f"torch: {torch_says}). Likely cause: {_cause(launch)}"
        ) from None
    if error is not None:
        raise error
    store = result["store"]
    store.set_timeout(dist.default_pg_timeout)
    return store
