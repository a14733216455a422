"""megatron-core's own timers (NeMo's ``model.enable_megatron_timers``).

megatron-core times its pipeline schedule ('forward-backward', 'forward-compute',
'backward-compute'), pipeline send and receive ('forward-recv', ...), gradient
reduction ('all-grads-sync', ...) and optimizer ('optimizer-inner-step', ...) whenever
the model's config (and the optimizer's) holds a ``megatron.core.timers.Timers``.
:class:`MegatronTimers` installs one at NeMo's log level 2 (every timer), adds
Megatron-LM's 'optimizer' and 'batch-generator' timers, and reports each interval's
time per step: megatron's table (min and max over ranks, the max, or every rank) and
the max over ranks as metrics named as Megatron-LM writes them to TensorBoard
(``<name>-time``, seconds).

A report all-gathers every rank's times: every rank must report at the same steps with
the same timer names, or the run hangs. Reports come after the steps whose number is a
multiple of the interval (global numbers, so a resumed run keeps the grid), and name
the fixed list :data:`TIMER_NAMES`: ranks of different pipeline stages register
different timers, and a rank without a timer of some name adds nothing to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.timers import Timers

from megatron_lns.config.schema import ExperimentConfig

# megatron-core's timers (0.19) that time waiting for other ranks: the pipeline's
# point-to-point transfers and finalize_model_grads' all-reduces (stragglers.py subtracts
# them from a step to get a rank's own compute time).
PIPELINE_TRANSFER_TIMERS = (
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
)
GRADIENT_REDUCTION_TIMERS = (
    "conditional-embedder-grads-all-reduce",
    "non-tensor-parallel-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
)
WAIT_TIMERS = frozenset(PIPELINE_TRANSFER_TIMERS + GRADIENT_REDUCTION_TIMERS)
# Every timer megatron-core 0.19 starts (pipeline_parallel/, distributed/,
# optimizer/), then the two the loop adds, in Megatron-LM's reporting order.
TIMER_NAMES = (
    "forward-backward",
    "forward-compute",
    "backward-compute",
    "batch-generator",
    *PIPELINE_TRANSFER_TIMERS,
    *GRADIENT_REDUCTION_TIMERS,
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
)
# NeMo builds its timers at log level 2: megatron-core's level-1 and level-2 timers.
LOG_LEVEL = 2


@dataclass(frozen=True)
class TimerSettings:
    log_every_n_steps: int
    log_option: str = "minmax"  # max | minmax | all (megatron's Timers)
    barrier: bool = False  # a barrier before the times are read


def timer_settings(cfg: ExperimentConfig) -> TimerSettings | None:
    """megatron's timers, or None when ``model.enable_megatron_timers`` is off."""
    if not cfg.model.enable_megatron_timers:
        return None
    kwargs = cfg.model.megatron_timer_kwargs
    return TimerSettings(
        log_every_n_steps=kwargs.log_every_n_steps or cfg.trainer.log_every_n_steps,
        log_option=kwargs.log_option or kwargs.log_mode or "minmax",
        barrier=kwargs.barrier,
    )


@dataclass
class TimerReport:
    """One interval's times per step; the same on every rank."""

    steps: int  # training steps the interval timed
    table: str | None  # megatron's table in ms; None when nothing was timed
    max_seconds: dict[str, float] = field(default_factory=dict)  # "<name>-time": seconds


@contextlib.contextmanager
def timed(timers: Timers | None, name: str, log_level: int = 1, barrier: bool = False):
    """Time the block with megatron's timer ``name`` (nothing without timers)."""
    if timers is None:
        yield
        return
    timers(name, log_level=log_level).start(barrier=barrier)
    try:
        yield
    finally:
        timers(name).stop()


class MegatronTimers:
    """The run's megatron timers, or none (``settings`` None): then every method is a
    no-op and megatron-core times nothing."""

    def __init__(self, settings: TimerSettings | None) -> None:
        self.settings = settings
        self.timers = None
        if settings is not None:
            self.timers = Timers(log_level=LOG_LEVEL, log_option=settings.log_option)
        self._configs: list[Any] = []
        self._steps_in_interval = 0

    def install(self, model_config: ModelParallelConfig, optimizer: MegatronOptimizer) -> None:
        """Hand the timers to megatron-core: the model's config (pipeline schedules,
        send/receive, ``finalize_model_grads``) and each optimizer's config."""
        if self.timers is None:
            return
        optimizers = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        self._configs = [model_config, *(o.config for o in optimizers)]
        for config in self._configs:
            config.timers = self.timers

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time nothing inside (validation is not training time, as in Megatron-LM)."""
        held = [config.timers for config in self._configs]
        for config in self._configs:
            config.timers = None
        try:
            yield
        finally:
            for config, timers in zip(self._configs, held, strict=True):
                config.timers = timers

    def timing(self, name: str, log_level: int = 1):
        """A block timed as ``name`` (see :func:`timed`)."""
        return timed(self.timers, name, log_level)

    def step_done(self, step: int, update_applied: bool) -> TimerReport | None:
        """After every training step (skipped updates too: their time is spent); every
        rank at once. Returns the interval's report after each ``log_every_n_steps``-th
        applied update, else None."""
        if self.timers is None:
            return None
        self._steps_in_interval += 1
        if not update_applied or step % self.settings.log_every_n_steps:
            return None
        return self._report()

    def _report(self) -> TimerReport:
        steps, self._steps_in_interval = self._steps_in_interval, 0
        names = list(TIMER_NAMES)
        table = self.timers.get_all_timers_string(
            names, normalizer=steps, reset=False, barrier=self.settings.barrier
        )
        # What megatron's Timers.write computes for TensorBoard; write() itself takes a
        # SummaryWriter only, and these metrics also go to metrics.jsonl and W&B.
        min_max = self.timers._get_global_min_max_time(
            names, reset=True, barrier=False, normalizer=steps
        )
        max_seconds = {f"{name}-time": high for name, (_, high) in min_max.items()}
        return TimerReport(steps, table, max_seconds)
