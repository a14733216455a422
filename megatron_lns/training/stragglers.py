"""The straggler report: which ranks compute more slowly than the others, with their hosts.

A slow rank slows every rank (they meet in the gradient sync every step), so step times
say nothing about who is slow. What differs is the time a rank spends *working*: its
step's wall time less the time it waited in collectives for the others. The slow rank
hardly waits; the others wait for it.

The waits are those megatron-core already marks with its timers: the gradient sync
(``all-grads-sync`` and the other all-reduces of ``finalize_model_grads``) and the
pipeline's sends and receives (``forward-recv``, ``backward-send``, ...). :class:`WaitClock`
stands in as the model config's ``timers``: it times those names (synchronizing CUDA
around them, as megatron's own timers do, so that the host clock sees the device's wait)
and hands every call on to megatron's :class:`~megatron.core.timers.Timers` when
``model.enable_megatron_timers`` installed them. Without them it asks for no barrier
(megatron passes ``barrier_with_L1_time`` to level-1 timers) and times nothing else, so
the cost is two clock reads per wait. Waits megatron-core does not time count as work:
the distributed optimizer's gradient-norm all-reduce inside ``optimizer.step()`` is one;
a rank slowed between its backward pass and its optimizer step then makes the others'
optimizer step look slow too (docs/resilience.md, "Straggler report").

Every ``report_every_n_steps`` steps (global step numbers) the ranks all-gather three
floats each (steps, wall seconds, waited seconds of the interval): one small collective
on the default group at a step boundary every rank reaches. Rank 0 names the ranks whose
compute time per step exceeds the median rank's by more than ``slower_than_median`` (one
line, with their hosts, gathered once at start), logs every rank's time through the
:class:`~megatron_lns.training.metrics.MetricsLogger`, and sums the attempt up at its end
from what it gathered (no collective then: the attempt may be ending on a failure).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config

from megatron_lns.training.metrics import MetricsLogger
from megatron_lns.training.timers import WAIT_TIMERS


class _NoTimer:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


_NO_TIMER = _NoTimer()


class _WaitTimer:
    """One of :data:`WAIT_TIMERS`: adds its time to the clock, and runs megatron's timer of
    the same name (its barrier, if any, counted as waiting) when there is one."""

    def __init__(self, clock: WaitClock, inner: Any) -> None:
        self.clock, self.inner = clock, inner

    def start(self, barrier: bool = False) -> None:
        self.clock.wait_began()
        if self.inner is not None:
            self.inner.start(barrier=barrier)

    def stop(self, barrier: bool = False) -> None:
        if self.inner is not None:
            self.inner.stop(barrier=barrier)
        self.clock.wait_ended()


class WaitClock:
    """Callable as megatron-core calls ``config.timers(name, log_level=...)``: the seconds
    spent in :data:`WAIT_TIMERS` since :meth:`take`, nested ones counted once."""

    def __init__(self, inner: Callable[..., Any] | None, cuda: bool) -> None:
        self.inner = inner  # megatron's Timers, when the run has them
        self.cuda = cuda
        self.waited_s = 0.0
        self._depth = 0
        self._began = 0.0

    def __call__(self, name: str, log_level: int | None = None) -> Any:
        inner = None
        if self.inner is not None:
            inner = self.inner(name) if log_level is None else self.inner(name, log_level)
        if name in WAIT_TIMERS:
            return _WaitTimer(self, inner)
        return inner if inner is not None else _NO_TIMER

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def wait_began(self) -> None:
        if self._depth == 0:
            self._began = self._now()
        self._depth += 1

    def wait_ended(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.waited_s += self._now() - self._began

    def take(self) -> float:
        """The seconds waited since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited


@dataclass(frozen=True)
class RankTime:
    """One rank's interval: compute and waiting, seconds per step."""

    rank: int
    host: str
    compute_s: float
    wait_s: float


@dataclass(frozen=True)
class StragglerFinding:
    """One report: every rank's time, the median compute time, the ranks named."""

    first_step: int
    last_step: int
    ranks: tuple[RankTime, ...]
    median_s: float
    stragglers: tuple[RankTime, ...]

    @property
    def slowest_over_median(self) -> float:
        slowest = max(r.compute_s for r in self.ranks)
        return slowest / self.median_s if self.median_s > 0 else 1.0

    def line(self) -> str | None:
        """The log line naming the stragglers; None when there is none."""
        if not self.stragglers:
            return None
        named = ", ".join(
            f"rank {r.rank} (host {r.host}) {r.compute_s:.3g} s/step compute, "
            f"{r.compute_s / self.median_s:.2f}x the median {self.median_s:.3g} s"
            for r in self.stragglers
        )
        return f"stragglers over steps {self.first_step}-{self.last_step}: {named}"

    def metrics(self) -> dict[str, float]:
        metrics = {f"straggler/compute_s_rank{r.rank}": r.compute_s for r in self.ranks}
        metrics["straggler/median_compute_s"] = self.median_s
        metrics["straggler/slowest_over_median"] = self.slowest_over_median
        return metrics


def find_stragglers(
    compute_s: Sequence[float],
    hosts: Sequence[str],
    slower_than_median: float,
    steps: tuple[int, int],
    wait_s: Sequence[float] | None = None,
) -> StragglerFinding:
    """The ranks whose ``compute_s`` (seconds per step, by rank) exceeds the median by more
    than ``slower_than_median`` (a fraction); ``steps`` the interval's first and last."""
    waits = wait_s if wait_s is not None else [0.0] * len(compute_s)
    ranks = tuple(
        RankTime(rank, host, compute, wait)
        for rank, (host, compute, wait) in enumerate(zip(hosts, compute_s, waits, strict=True))
    )
    median = statistics.median(compute_s)
    limit = median * (1.0 + slower_than_median)
    named = tuple(r for r in ranks if median > 0 and r.compute_s > limit)
    return StragglerFinding(steps[0], steps[1], ranks, median, named)


def attempt_summary(findings: Sequence[StragglerFinding], every: int, steps_run: int) -> str:
    """The line that sums up an attempt's reports."""
    if not findings:
        return (
            f"straggler report: none made in this attempt ({steps_run} steps, one every "
            f"{every}: exp_manager.straggler_detection_params.report_every_n_steps)"
        )
    span = f"{len(findings)} report(s) over steps {findings[0].first_step}-{findings[-1].last_step}"
    named: dict[int, list[RankTime]] = {}
    for finding in findings:
        for r in finding.stragglers:
            named.setdefault(r.rank, []).append(r)
    if not named:
        worst = max(f.slowest_over_median for f in findings)
        return f"straggler report, {span}: no straggler (slowest rank {worst:.2f}x the median)"
    parts = []
    for rank, times in sorted(named.items()):
        worst = max(
            r.compute_s / f.median_s for f in findings for r in f.stragglers if r.rank == rank
        )
        parts.append(
            f"rank {rank} (host {times[0].host}) named in {len(times)}, "
            f"up to {worst:.2f}x the median"
        )
    return f"straggler report, {span}: " + "; ".join(parts)


@dataclass
class _Interval:
    steps: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0


@dataclass
class StragglerReport:
    """The run's straggler report (``enabled`` false: every method does nothing)."""

    enabled: bool
    rank0: bool = False
    every: int = 0
    slower_than_median: float = 0.0
    device: torch.device | None = None
    logger: MetricsLogger | None = None
    say: Callable[[str], None] = print
    clock: WaitClock | None = None
    hosts: list[str] = field(default_factory=list)
    first_step: int | None = None  # of the interval being timed
    steps_run: int = 0
    findings: list[StragglerFinding] = field(default_factory=list)
    _interval: _Interval = field(default_factory=_Interval)

    @classmethod
    def for_run(
        cls,
        cfg: Any,
        model: Sequence[torch.nn.Module],
        device: torch.device,
        logger: MetricsLogger,
        say: Callable[[str], None],
    ) -> StragglerReport:
        """Installs the wait clock as the model's config's ``timers`` and gathers the hosts
        (every rank at once); off with ``create_straggler_detection_callback: false`` or
        on a single rank (nothing to compare)."""
        if not cfg.exp_manager.create_straggler_detection_callback or dist.get_world_size() < 2:
            return cls(enabled=False)
        params = cfg.exp_manager.straggler_detection_params
        model_config = get_model_config(model[0])
        clock = WaitClock(model_config.timers, cuda=device.type == "cuda")
        model_config.timers = clock
        hosts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        return cls(
            enabled=True,
            rank0=dist.get_rank() == 0,
            every=params.report_every_n_steps,
            slower_than_median=params.slower_than_median,
            device=device,
            logger=logger,
            say=say,
            clock=clock,
            hosts=hosts,
        )

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one training step: its wall time and the waits inside it."""
        if not self.enabled:
            yield
            return
        self.clock.take()  # waits outside steps (validation's pipeline) are not the step's
        start = time.perf_counter()
        yield
        self._interval.steps += 1
        self._interval.wall_s += time.perf_counter() - start
        self._interval.wait_s += self.clock.take()

    def step_done(self, step: int, update_applied: bool) -> None:
        """After every training step, on every rank: reports after the steps whose
        global number is a multiple of ``report_every_n_steps``."""
        if not self.enabled:
            return
        self.steps_run += 1
        if self.first_step is None:
            self.first_step = step
        if update_applied and step % self.every == 0:
            self._report(step)

    def _report(self, step: int) -> None:
        interval, self._interval = self._interval, _Interval()
        mine = torch.tensor(
            [interval.steps, interval.wall_s, interval.wait_s], dtype=torch.float64
        ).to(self.device)
        gathered = [torch.empty_like(mine) for _ in self.hosts]
        dist.all_gather(gathered, mine)
        first, self.first_step = self.first_step, step + 1
        if not self.rank0:
            return
        rows = [t.cpu().tolist() for t in gathered]
        compute = [(wall - wait) / max(steps, 1) for steps, wall, wait in rows]
        waits = [wait / max(steps, 1) for steps, _, wait in rows]
        finding = find_stragglers(
            compute, self.hosts, self.slower_than_median, (first, step), waits
        )
        self.findings.append(finding)
        if (line := finding.line()) is not None:
            self.say(line)
        self.logger.log(step, finding.metrics(), console=False)

    def summary(self) -> None:
        """Rank 0 says what the attempt's reports found (the end of every attempt)."""
        if self.enabled and self.rank0:
            self.say(attempt_summary(self.findings, self.every, self.steps_run))
