"""The times run files record (epoch seconds), read back without trusting them.

A run directory's records (``.lock``, ``run_progress``) say when things happened as
seconds since the epoch. A record torn by a kill, or edited by hand, may hold anything
there: ``nan``, ``1e30``, a string. :func:`epoch_seconds` is the one test of such a
value, so that what reads a record can show its times with :func:`local_time` and never
fail on them (``time.localtime`` raises on NaN and on times past the calendar's end).
"""

from __future__ import annotations

import time


def epoch_seconds(value: object) -> float | None:
    """``value`` as a time a record may hold, a number of seconds since the epoch that
    the local calendar can show; None for anything else (not a number, a bool, NaN,
    negative, or past the calendar's end)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
        time.localtime(seconds)
    except (OverflowError, OSError, ValueError):
        return None
    return seconds if seconds >= 0 else None  # localtime refused NaN and infinities


def local_time(seconds: float) -> str:
    """``YYYY-MM-DD HH:MM:SS`` in local time, for a value :func:`epoch_seconds` accepted."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))
