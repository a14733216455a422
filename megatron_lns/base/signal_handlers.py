"""Signal handlers installed for the length of a ``with`` block."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def handled(signals: Iterable[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for each of ``signals`` while inside, then the handlers there were.

    Only the main thread may install handlers: elsewhere (some runners call from a
    thread) the block runs with the handlers as they are."""
    previous = {}
    for sig in signals:
        with contextlib.suppress(ValueError):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
