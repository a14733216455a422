"""Non-finite numbers in the JSON files the tools write (``analysis.json``,
``comparison.json``, ``compare_result.json``).

Strict JSON has no NaN or infinity, and Python's ``json`` wrote them as the bare words
``NaN`` and ``Infinity``, which other parsers (``jq``, JavaScript, pandas' strict mode)
reject. A measured number that is not finite (the loss of a diverged model) is written as
the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``; ``null`` stays what was not
measured. :func:`number` reads either back as a float (NaN for ``null``).
"""

from __future__ import annotations

import json
import math
from typing import Any

NON_FINITE = ("NaN", "Infinity", "-Infinity")


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples) a string of
    :data:`NON_FINITE`."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """Strict JSON of ``value`` (:func:`json_safe`); ``options`` as for ``json.dumps``."""
    return json.dumps(json_safe(value), allow_nan=False, **options)


def number(value: Any) -> Any:
    """A float read back from such a file: ``null`` is NaN, a :data:`NON_FINITE` string
    its float; anything else as it is."""
    if value is None:
        return math.nan
    if isinstance(value, str) and value in NON_FINITE:
        return float(value)
    return value
