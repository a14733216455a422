"""A run that cannot learn stops, and says where a rerun can start.

Two things end it: a non-finite loss or gradient norm (the run diverged), and fp16
gradients that overflow on every update even at the smallest loss scale (no update
applies). The trainer raises :class:`TrainingStopped` on every rank (the loss and the
norm are global) before the step's checkpoint, so that the newest checkpoint a rerun
resumes from is one taken before the failure. Torch-free: these are the verdicts and
their messages, not the step.
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_lns.base.errors import UserError

# Consecutive skipped updates after which an fp16 run stops: megatron's dynamic loss
# scale halves on every overflow (after a hysteresis of 2), so 50 skips take it from its
# initial 2**32 past its minimum of 1. Overflows beyond that mean the run cannot learn.
MAX_CONSECUTIVE_SKIPPED_STEPS = 50


class TrainingStopped(UserError):
    """The run cannot continue: a non-finite loss or gradient, or no update applies."""


def non_finite_step(step: int, loss: float, grad_norm: float | None) -> str | None:
    """What was not finite in training step ``step`` (its ``loss`` and ``grad_norm``,
    None where the optimizer computed none), for :func:`diverged_message`; None when
    both are finite."""
    norm = grad_norm if grad_norm is not None else 0.0
    if math.isfinite(loss) and math.isfinite(norm):
        return None
    said = "not computed" if grad_norm is None else grad_norm
    return f"step {step}: loss {loss}, gradient norm {said}"


def every_update_skipped(skips: int, step: int) -> TrainingStopped:
    """The error that ends a run whose last ``skips`` updates after ``step`` overflowed."""
    return TrainingStopped(
        f"the last {skips} optimizer updates after step {step} were all skipped (fp16 "
        "gradients overflow even at the smallest loss scale): the run cannot learn; lower "
        "the learning rate or train in bf16-mixed"
    )


def diverged_message(what: str, newest: Path | None) -> str:
    """The line that ends a diverged run: ``what`` (the non-finite values) and where a
    rerun can start (``newest``: the newest complete checkpoint, None before the first)."""
    newest_said = (
        f"newest complete one: {newest}"
        if newest is not None
        else "no complete checkpoint yet: a rerun starts afresh"
    )
    return (
        f"{what}: the run diverged and stops before its next checkpoint ({newest_said}); "
        "lower the learning rate or resume from an earlier checkpoint "
        "(exp_manager.resume_from_checkpoint; the checkpoints after it are then moved "
        "aside to checkpoints/abandoned-*, kept)"
    )
