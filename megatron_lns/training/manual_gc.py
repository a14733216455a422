"""Megatron-LM-style manual garbage collection (NeMo's ``model.gc_interval``).

Python's automatic collector starts a generation-2 pass whenever allocations cross its
thresholds, at a different moment on every rank. In a data- or pipeline-parallel step
one slow rank stalls all the others at the next collective, so many ranks collecting
at random moments cost more than all ranks collecting together. With an interval
``n > 0`` the automatic collector is switched off for the run and every rank collects
after every ``n``-th step; ``0`` leaves Python's automatic collection alone.
"""

from __future__ import annotations

import gc


class ManualGarbageCollection:
    """``start()`` before the first step, ``after_step(step)`` after each, ``stop()`` at
    the end (restores the automatic collector as it was)."""

    def __init__(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"gc interval must be >= 0, got {interval}")
        self.interval = interval
        self._was_enabled: bool | None = None

    def start(self) -> None:
        if not self.interval or self._was_enabled is not None:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()  # start from a clean heap, as Megatron-LM does

    def after_step(self, step: int) -> None:
        if self.interval and self._was_enabled is not None and step % self.interval == 0:
            gc.collect()

    def stop(self) -> None:
        if self._was_enabled is None:
            return
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
