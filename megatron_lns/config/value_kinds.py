"""What a config value must be, by its type: the one check of the keys OmegaConf does not
type (NeMo's keys, which ``nemo_compat`` reads as YAML gave them), and of the integers
OmegaConf lets through for the schema's keys (the loader).

NeMo's keys get no conversion, so without this a string ``'false'`` would be a true
value wherever a rule reads it as a bool, and ``trainer.max_epochs=abc`` would reach a
comparison with a number. A schema key typed int takes a Python int of any size from
OmegaConf, which megatron-core, torch and numpy hold in 64 bits, and ``plan``'s and the
rules' arithmetic in floats (``10**309`` raised OverflowError in ``math.isfinite``).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any

# megatron-core, torch and numpy hold integers in 64 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}


def kinds_of_hint(hint: Any) -> tuple[type, ...]:
    """The Python types a value of a field typed ``hint`` may have, None aside (empty: any;
    ``list[int] | None`` -> ``(list,)``)."""
    if _is_union(hint):
        found: list[type] = []
        for option in typing.get_args(hint):
            if option is not type(None):
                kinds = kinds_of_hint(option)
                if not kinds:
                    return ()
                found.extend(kinds)
        return tuple(dict.fromkeys(found))
    if dataclasses.is_dataclass(hint):
        return (dict,)
    origin = typing.get_origin(hint) or hint
    return (origin,) if origin in _NAMES else ()


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def kind_problem(value: Any, kinds: tuple[type, ...]) -> str | None:
    """What is wrong with ``value`` for a key of ``kinds`` (``must be true or false``),
    None when nothing is. None passes (the key's own rule says whether it may be unset);
    a bool is no number and a number no bool; an int is a number."""
    if value is None or not kinds:
        return None
    if isinstance(value, bool):
        fits = bool in kinds
    elif isinstance(value, int):
        fits = int in kinds or float in kinds
    else:
        fits = isinstance(value, tuple(k for k in kinds if k not in (bool, int)))
    if not fits:
        return "must be " + " or ".join(_NAMES[kind] for kind in kinds)
    return range_problem(value, kinds)


def range_problem(value: Any, kinds: tuple[type, ...]) -> str | None:
    """What is wrong with an integer ``value`` too large for what holds a key of
    ``kinds`` (int64 for an integer, a float for a number); None when nothing is."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if int in kinds and not INT64_MIN <= value <= INT64_MAX:
        return "must lie in [-2**63, 2**63) (megatron-core and torch hold integers as int64)"
    if int not in kinds and float in kinds and abs(value) > sys.float_info.max:
        return "is too large for a floating-point number"
    return None


def out_of_range(cfg: Any, prefix: str = "") -> tuple[str, str, Any] | None:
    """The first key of the typed config ``cfg`` (a schema dataclass) whose integer is
    too large for what holds it, what is wrong and its value; None when there is none.
    Read after OmegaConf's conversions: a quoted number, an interpolation's result."""
    hints = typing.get_type_hints(type(cfg))
    for field in dataclasses.fields(cfg):
        key, value = f"{prefix}{field.name}", getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            found = out_of_range(value, key + ".")
        elif isinstance(value, list):
            kinds = kinds_of_hint(_element_hint(hints[field.name]))
            found = next(
                (
                    (f"{key}[{index}]", problem, item)
                    for index, item in enumerate(value)
                    if (problem := range_problem(item, kinds))
                ),
                None,
            )
        else:
            problem = range_problem(value, kinds_of_hint(hints[field.name]))
            found = (key, problem, value) if problem else None
        if found:
            return found
    return None


def _element_hint(hint: Any) -> Any:
    """The type of a list's elements (``list[int] | None`` -> int; Any if not said)."""
    for option in typing.get_args(hint) if _is_union(hint) else (hint,):
        if typing.get_origin(option) is list:
            return (typing.get_args(option) or (Any,))[0]
    return Any


def shown(value: Any) -> str:
    """``value`` as a message shows it: repr, but a huge integer by its size (its digits
    would fill the line, or be more than Python writes out)."""
    huge = isinstance(value, int) and abs(value) >= 10**30
    return f"a {value.bit_length()}-bit integer" if huge else repr(value)
