"""Which layers of a model are mixture-of-experts layers, and how many parameters each
token meets: arithmetic shared by the config checks (no torch here), the layer specs,
the FLOPs count and the memory estimate.

megatron-core's ``moe_layer_freq`` is an int ``N`` (layer ``i``, 0-based, is MoE when
``i % N == 0``: every layer for 1, layers 1, 3, 5, ... in 1-based terms for 2) or a list
of 0/1 per layer. NeMo YAML may also give the list as a string (``"[0]*1+[1]*15"``),
which megatron-lm's argument parser evaluates; we accept the same Python list expression
(literals, ``+`` and ``*`` only, at most :data:`MAX_LIST_LENGTH` entries, checked before
the list is built) and nothing else.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Sequence

MoELayerFreq = int | Sequence[int] | str


class MoELayerFreqError(ValueError):
    pass


def parse_moe_layer_freq(moe_layer_freq: MoELayerFreq) -> int | list[int]:
    """The int, or the list of 0/1 (a list expression evaluated), checked for its form."""
    if isinstance(moe_layer_freq, str):
        moe_layer_freq = _list_expression(moe_layer_freq)
    if isinstance(moe_layer_freq, bool) or not isinstance(moe_layer_freq, (int, Sequence)):
        raise MoELayerFreqError(
            f"moe_layer_freq must be an int or a list of 0/1, got {moe_layer_freq!r}"
        )
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise MoELayerFreqError(f"moe_layer_freq must be >= 1, got {moe_layer_freq}")
        return moe_layer_freq
    pattern = list(moe_layer_freq)
    for layer, entry in enumerate(pattern):
        if isinstance(entry, bool) or entry not in (0, 1):
            raise MoELayerFreqError(
                f"moe_layer_freq entries must be 0 (dense) or 1 (MoE), got {entry!r} at layer "
                f"{layer}"
            )
    return [int(x) for x in pattern]


def moe_layer_pattern(moe_layer_freq: MoELayerFreq, num_layers: int) -> list[int]:
    """1 for each mixture-of-experts layer, 0 for each dense layer, in layer order."""
    freq = parse_moe_layer_freq(moe_layer_freq)
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if len(freq) != num_layers:
        raise MoELayerFreqError(
            f"moe_layer_freq lists {len(freq)} layers but num_layers is {num_layers}"
        )
    return freq


def moe_layer_count(
    moe_layer_freq: MoELayerFreq, num_layers: int, start: int = 0, stop: int | None = None
) -> int:
    """How many of layers ``start`` to ``stop - 1`` (default: all) are mixture-of-experts
    layers: :func:`moe_layer_pattern`'s sum over them, but an int frequency's layers are
    counted, not listed (a check or a plan of a billion layers takes no memory)."""
    stop = num_layers if stop is None else stop
    freq = parse_moe_layer_freq(moe_layer_freq)
    if isinstance(freq, int):  # the multiples of freq in [start, stop)
        return max(0, -(-stop // freq) - -(-start // freq))
    return sum(moe_layer_pattern(freq, num_layers)[start:stop])


_OPERATORS = {ast.Add: operator.add, ast.Mult: operator.mul}
# More layers than any model has: a longer list is refused before it is built (each
# step's result is checked before it is computed), so that '[1]*10**11' costs nothing.
MAX_LIST_LENGTH = 100_000
# Errors of a text too large or too deeply nested to parse or evaluate: a long chain of
# '+' (RecursionError), a parser stack overflow (MemoryError), an integer beyond what
# Python converts or indexes (ValueError, OverflowError).
_TOO_LARGE = (RecursionError, MemoryError, ValueError, OverflowError)


def _list_expression(text: str) -> list[int]:
    """``"[0]*3+[1]*5"`` -> the list, evaluated without ``eval``."""
    shown = text if len(text) <= 60 else text[:50] + "..."

    def not_a_list_expression() -> MoELayerFreqError:
        return MoELayerFreqError(
            f"moe_layer_freq={shown!r} is not a list expression of 0/1 literals, '+' and '*'"
        )

    def value(node: ast.AST):
        if isinstance(node, ast.List):
            items = [value(element) for element in node.elts]
            if any(isinstance(item, list) for item in items):
                raise not_a_list_expression()
            return items
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if _length(node.op, left, right) > MAX_LIST_LENGTH:
                raise MoELayerFreqError(
                    f"moe_layer_freq={shown!r} lists more than {MAX_LIST_LENGTH} layers"
                )
            return _OPERATORS[type(node.op)](left, right)
        raise not_a_list_expression()

    try:
        tree = ast.parse(text.strip(), mode="eval")
        result = value(tree.body)
    except MoELayerFreqError:
        raise
    except SyntaxError:
        raise MoELayerFreqError(f"moe_layer_freq={shown!r} is not a list expression") from None
    except TypeError:
        raise MoELayerFreqError(f"moe_layer_freq={shown!r} mixes lists and numbers") from None
    except _TOO_LARGE:
        raise MoELayerFreqError(
            f"moe_layer_freq={shown!r} is too large or too deeply nested to evaluate"
        ) from None
    if not isinstance(result, list):
        raise MoELayerFreqError(f"moe_layer_freq={shown!r} does not evaluate to a list")
    return result


def _length(op: ast.operator, left, right) -> int:
    """The length of the list ``left op right`` makes, without making it (0 for a
    number; what is not a list op a number is the caller's TypeError)."""
    if isinstance(op, ast.Add):
        both = isinstance(left, list) and isinstance(right, list)
        return len(left) + len(right) if both else 0
    items, count = (left, right) if isinstance(left, list) else (right, left)
    if isinstance(items, list) and isinstance(count, int):
        return len(items) * max(count, 0)
    return 0
