"""What a config value must be, by its type: the one check of the keys OmegaConf does not
type (NeMo's keys, which ``nemo_compat`` reads as YAML gave them).

NeMo's keys get no conversion, so without this a string ``'false'`` would be a true
value wherever a rule reads it as a bool, and ``trainer.max_epochs=abc`` would reach a
comparison with a number.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

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
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
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
    return None if fits else "must be " + " or ".join(_NAMES[kind] for kind in kinds)
