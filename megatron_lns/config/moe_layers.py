"""Which layers of a model are mixture-of-experts layers, and how many parameters each
token meets: arithmetic shared by the config checks (no torch here), the layer specs,
the FLOPs count and the memory estimate.

megatron-core's ``moe_layer_freq`` is an int ``N`` (layer ``i``, 0-based, is MoE when
``i % N == 0``: every layer for 1, layers 1, 3, 5, ... in 1-based terms for 2) or a list
of 0/1 per layer. NeMo YAML may also give the list as a string (``"[0]*1+[1]*15"``),
which megatron-lm's argument parser evaluates; we accept the same Python list expression
(literals, ``+`` and ``*`` only) and nothing else.
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
    if any(isinstance(x, bool) or x not in (0, 1) for x in pattern):
        raise MoELayerFreqError(f"moe_layer_freq entries must be 0 (dense) or 1 (MoE): {pattern}")
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


def _list_expression(text: str) -> list[int]:
    """``"[0]*3+[1]*5"`` -> the list, evaluated without ``eval``."""

    def value(node: ast.AST):
        if isinstance(node, ast.List):
            return [value(element) for element in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise MoELayerFreqError(
            f"moe_layer_freq={text!r} is not a list expression of 0/1 literals, '+' and '*'"
        )

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise MoELayerFreqError(f"moe_layer_freq={text!r} is not a list expression") from None
    try:
        result = value(tree.body)
    except TypeError:
        raise MoELayerFreqError(f"moe_layer_freq={text!r} mixes lists and numbers") from None
    if not isinstance(result, list):
        raise MoELayerFreqError(f"moe_layer_freq={text!r} does not evaluate to a list")
    return result
