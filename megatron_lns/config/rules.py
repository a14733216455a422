"""Value rules declared with the config fields, and the one validator that reads them.

A key that needs more than its type says declares a :class:`Check` (``settings.py``)::

    num_layers: int = setting(12, positive, ...)

``settings.value_errors`` walks the declarations and reports each value that breaks its
rule, naming the dotted key. Rules here look at one value only; rules that relate
several keys (divisibility, world size, ...) are in ``validate.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from megatron_lns.config.moe_layers import MoELayerFreqError, parse_moe_layer_freq
from megatron_lns.config.value_kinds import shown


@dataclass(frozen=True)
class Check:
    """``holds(value)``, or the message ``<key> must be <expected>, got <value>``.

    ``None`` always passes: OmegaConf already refuses it for fields not typed optional,
    and for optional ones it means "not set".
    """

    expected: str
    holds: Callable[[Any], bool]

    def error(self, key: str, value: Any) -> str | None:
        if value is None or self.holds(value):
            return None
        return f"{key} must be {self.expected}, got {shown(value)}"


@dataclass(frozen=True)
class OneOf(Check):
    """A value from a fixed vocabulary (a NeMo spelling or a component's choices)."""

    def error(self, key: str, value: Any) -> str | None:
        if value is None or self.holds(value):
            return None
        return f"{key}={value!r} is not one of {self.expected}"


def one_of(choices: Iterable) -> OneOf:
    allowed = list(choices)
    return OneOf(str(allowed), lambda value: value in allowed)


def _finite(value: Any) -> bool:
    """A number, not a bool, and finite; an int too large for a float is not (the loader
    refuses it for keys typed int or float; others, ``Any``, reach here with it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


positive = Check("positive", lambda v: _finite(v) and v > 0)
# sbatch --signal=SIG@TIME takes at most 65535 seconds (a 16-bit field in SLURM).
signal_lead_seconds = Check("in 1..65535", lambda v: _finite(v) and 0 < v <= 65535)
non_negative = Check(">= 0", lambda v: _finite(v) and v >= 0)
# A multiple of the slowest time seen below 1 would declare a healthy run hung.
safety_multiple = Check(
    ">= 1 (a learnt timeout below the slowest time seen ends a healthy run)",
    lambda v: _finite(v) and v >= 1,
)
# Dropout probabilities: 1 would zero every activation.
probability = Check("a probability in [0, 1)", lambda v: _finite(v) and 0 <= v < 1)
# numpy's RandomState (megatron's dataset shuffling) takes seeds in [0, 2**32).
rng_seed = Check("an integer in [0, 2**32)", lambda v: _finite(v) and 0 <= v < 2**32)
adam_betas = Check(
    "[beta1, beta2] with each in [0, 1)",
    lambda v: len(v) == 2 and all(_finite(b) and 0 <= b < 1 for b in v),
)
global_ranks = Check(
    "a non-empty list of global ranks (integers >= 0)",
    lambda v: len(v) > 0 and all(_finite(r) and r >= 0 and int(r) == r for r in v),
)
non_empty = Check("a non-empty name", lambda v: bool(str(v).strip()))
rampup_batch_sizes = Check(
    "[start_batch_size, batch_size_increment, ramp_up_samples], three positive integers",
    lambda v: len(v) == 3 and all(_finite(x) and x > 0 for x in v),
)


def _is_moe_layer_freq(value: Any) -> bool:
    try:
        parse_moe_layer_freq(value)
    except MoELayerFreqError:
        return False
    return True


moe_layer_frequency = Check(
    "an int N >= 1 (every N-th layer, from the first, is MoE), a list of 0/1 per layer, or a "
    "list expression such as '[0]*1+[1]*15'",
    _is_moe_layer_freq,
)


def _is_module_list(choices: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda v: len(v) > 0 and all(item in choices for item in v)


def module_list(choices: Iterable[str]) -> Check:
    allowed = tuple(choices)
    return Check(f"a non-empty list of {list(allowed)}", _is_module_list(allowed))


_SPLIT_NUMBER = re.compile(r"^\s*\d+(\.\d*)?\s*$|^\s*\.\d+\s*$")


def _is_split(value: Any) -> bool:
    parts = str(value).split(",")
    if len(parts) != 3 or not all(_SPLIT_NUMBER.match(p) for p in parts):
        return False
    # megatron builds no training split from a zero train weight: the run would start and
    # stop at once with "no training data".
    return float(parts[0]) > 0


split_weights = Check(
    "three comma-separated non-negative numbers, the first (train) positive (train,valid,test)",
    _is_split,
)
