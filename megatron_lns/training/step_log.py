"""What the training loop logs of each step it trains (``metrics.py`` writes it).

Every step's loss goes to the metrics (for loss curves); every ``log_every_n_steps``-th
step and the last also get the console line: loss, learning rate, gradient norm, batch
size, tokens/s and model TFLOP/s per device since the last such line, the MoE metrics,
and the time left to ``max_steps``. A skipped update (an fp16 overflow) is counted in
``skipped_steps``; megatron's timers report on their own interval. Kept apart from the
loop so that the loop reads as the order of its steps, not as the columns of a line.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.distributed as dist
from megatron.core.num_microbatches_calculator import get_num_microbatches

from megatron_lns.training.attempt_recorder import AttemptRecorder
from megatron_lns.training.metrics import MetricsLogger, Throughput
from megatron_lns.training.moe_metrics import MoEMetrics
from megatron_lns.training.step import StepResult
from megatron_lns.training.timers import TimerReport


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


class StepLog:
    """The lines and metrics rows of the run's training steps (module doc). Every rank
    calls it: the MoE metrics are reduced across ranks (``logger`` writes on rank 0)."""

    def __init__(
        self,
        logger: MetricsLogger,
        attempt: AttemptRecorder,
        moe_metrics: MoEMetrics | None,
        flops_per_token: float,
        every: int,
        max_steps: int,
        say: Callable[[str], None],
    ) -> None:
        """``every``: ``trainer.log_every_n_steps``; ``say`` prints a console line."""
        self.logger, self.attempt, self.moe_metrics = logger, attempt, moe_metrics
        self.flops_per_token, self.every, self.max_steps = flops_per_token, every, max_steps
        self.say = say

    def trained(
        self, step: int, result: StepResult, lr: float, samples: int, throughput: Throughput
    ) -> None:
        """Step ``step`` applied its update (``lr``: the learning rate it used; ``samples``:
        consumed so far); on the interval its console line closes ``throughput``'s window."""
        if step % self.every == 0 or step == self.max_steps:
            self._line(step, result, lr, samples, throughput.close_window())
        else:  # every step's loss, for curves; the console gets the interval
            self.logger.log(step, {"loss": result.loss}, console=False)

    def _line(
        self, step: int, result: StepResult, lr: float, samples: int, tokens_per_s: float
    ) -> None:
        metrics = {
            "loss": result.loss,
            "ppl": math.exp(min(result.loss, 50.0)),
            "lr": lr,
            "grad_norm": _or_nan(result.grad_norm),
            "global_batch_size": result.num_samples,
            "consumed_samples": samples,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": self.tflops_per_device(tokens_per_s),
        }
        per_layer = {}
        if self.moe_metrics is not None:
            moe, per_layer = self.moe_metrics.report(get_num_microbatches())
            metrics.update(moe)
        self.attempt.logged()
        eta = self.attempt.time_to(self.max_steps)
        note = f"time_to_max_steps {eta}" if eta is not None else ""
        self.logger.log(step, metrics, note=note)
        if per_layer:
            self.logger.log(step, per_layer, console=False)

    def skipped(self, step: int, skipped_steps: int) -> None:
        """Step ``step`` skipped its update (``skipped_steps`` so far in this attempt)."""
        self.logger.log(step, {"skipped_steps": skipped_steps}, console=False)

    def timers(self, step: int, report: TimerReport | None) -> None:
        """Megatron's timers after ``step``: their table and maxima, where they reported."""
        if report is None:
            return
        if report.table is not None:
            self.say(
                f"step {step}: megatron timers, per step of the last {report.steps}, {report.table}"
            )
        if report.max_seconds:
            self.logger.log(step, report.max_seconds, console=False)

    def tflops_per_device(self, tokens_per_second: float) -> float:
        """Model TFLOP/s per device (all ranks share the tokens)."""
        flops = tokens_per_second * self.flops_per_token
        return flops / 1e12 / dist.get_world_size()
