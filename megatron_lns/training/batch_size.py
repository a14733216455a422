"""The global batch size of each step: constant, or ramped up by consumed samples.

NeMo's ``model.rampup_batch_size`` (Megatron-LM's ``--rampup-batch-size``) is
``[start, increment, ramp_up_samples]``: the run starts at ``start`` sequences per step
and grows by ``increment`` in ``(global - start) / increment`` equal stages spread over
the first ``ramp_up_samples`` samples, then trains at ``model.global_batch_size``. Within
the ramp, the batch size after ``c`` consumed samples is
``start + floor(c * stages / ramp_up_samples) * increment``.

megatron-core 0.19 no longer has a ramp-up calculator (``init_num_microbatches_calculator``
ignores ``rampup_batch_size``); it has ``StepBatchsizeNumMicroBatchesCalculator``, a
batch size per consumed-sample threshold. :func:`rampup_thresholds` writes the ramp as
those thresholds, so megatron's calculator decides every step's batch size and
micro-batch count. The batch size is a function of consumed samples alone: a resumed
run, which restores them, continues the ramp exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    init_num_microbatches_calculator,
)


def rampup_thresholds(
    rampup_batch_size: Sequence[int], global_batch_size: int
) -> list[tuple[int, int]]:
    """``(first consumed sample, global batch size)`` of each ramp-up stage, ascending.

    Stage ``k`` (``k = 0..stages``) starts at the first integer sample count ``c`` with
    ``floor(c * stages / ramp_up_samples) >= k``, i.e. ``ceil(k * ramp_up_samples / stages)``
    (integer arithmetic, no float rounding). When several stages would start at the same
    sample (fewer ramp-up samples than stages), the largest batch size of them applies.
    """
    start, increment, ramp_up_samples = (int(v) for v in rampup_batch_size)
    stages = (global_batch_size - start) // increment
    if stages <= 0:
        return [(0, global_batch_size)]
    first_sample = {}
    for k in range(stages + 1):
        first_sample[-(-k * ramp_up_samples // stages)] = start + k * increment
    return sorted(first_sample.items())


def step_schedule(thresholds: Sequence[tuple[int, int]]) -> str:
    """megatron-core's ``step_batch_size_schedule`` string: ``"0:B0 T1:B1 ..."`` (samples)."""
    return " ".join(f"{threshold}:{batch_size}" for threshold, batch_size in thresholds)


def init_batch_size_calculator(
    rank: int,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    rampup_batch_size: Sequence[int] | None = None,
) -> None:
    """(Re)start megatron's num-microbatches calculator for this run.

    Afterwards ``update_num_microbatches(consumed_samples)`` sets the step's batch size and
    ``get_num_microbatches()`` / ``get_current_global_batch_size()`` read it. The
    calculator is process-global; a previous run's in the same process is replaced.
    """
    destroy_num_microbatches_calculator()
    schedule = None
    if rampup_batch_size is not None:
        schedule = step_schedule(rampup_thresholds(rampup_batch_size, global_batch_size))
    init_num_microbatches_calculator(
        rank,
        None,
        None if schedule else global_batch_size,
        micro_batch_size,
        data_parallel_size,
        step_batch_size_schedule=schedule,
    )
