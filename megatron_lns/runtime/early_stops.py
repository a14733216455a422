"""Stop signals that come before the code that acts on them is ready.

``train`` and ``compare`` spend their first seconds importing torch and megatron-core and
building the run before the launcher or the trainer takes over the stop signals
(:data:`~megatron_lns.runtime.job.STOP_SIGNALS`). A stop sent then was lost or silent:
SIGTERM and SIGUSR1 ended the process by their default action, with no line, and a
SIGINT's KeyboardInterrupt raised inside a library's catch-all ``except`` around an
optional import was swallowed, so the run went on to train as if never asked.

Inside :func:`early_stops_recorded`, which those commands enter first, a stop signal is
recorded instead, and whatever takes the signals over takes the recorded ones with them
(:func:`take_early_stops`): the launcher then starts no rank, and the trainer stops at
its first step, as for any stop. One that nothing took (it came after the run, while the
command wound down) is raised again once the command's work is done.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from megatron_lns.base.signal_handlers import handled
from megatron_lns.runtime.job import STOP_SIGNALS

_recorded: list[int] = []


def _record(signum: int, frame: Any) -> None:
    _recorded.append(signum)


def take_early_stops() -> list[int]:
    """The stop signals recorded so far, which the caller now acts on (none are left)."""
    taken = list(_recorded)
    _recorded.clear()
    return taken


@contextlib.contextmanager
def early_stops_recorded() -> Iterator[None]:
    """Record stop signals while inside (module doc); restore the handlers on the way out
    and raise again the first stop nothing took."""
    try:
        with handled(STOP_SIGNALS, _record):
            yield
    finally:
        if untaken := take_early_stops():
            signal.raise_signal(untaken[0])
