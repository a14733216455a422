"""The LayerNorm Scaling rule and how it folds into a norm's affine parameters.

LNS scales the output of a pre-block norm in block ``l`` by ``s = 1/sqrt(l)``.
A norm's output is ``x_hat * gamma + beta``, so scaling it by ``s`` is the same as
using ``s * gamma`` and ``s * beta``: the factor can be folded into the affine
parameters at forward time, which costs no pass over the activations and keeps
fused norm+linear kernels fused. Autograd carries the factor into the parameter
gradients, so forward and backward are exact.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

NormScaling = Literal["lns", "none"]
NORM_SCALING_CHOICES: tuple[str, ...] = ("lns", "none")


def lns_factor(layer_number: int) -> float:
    """``1/sqrt(layer_number)`` for a global, 1-based block index."""
    if isinstance(layer_number, bool) or not isinstance(layer_number, int) or layer_number < 1:
        raise ValueError(f"layer_number must be a 1-based int, got {layer_number!r}")
    return 1.0 / math.sqrt(layer_number)


def norm_output_scale(norm_scaling: NormScaling, layer_number: int) -> float:
    """The factor applied to the pre-norms of block ``layer_number``."""
    if norm_scaling == "lns":
        return lns_factor(layer_number)
    if norm_scaling == "none":
        return 1.0
    raise ValueError(f"norm_scaling must be one of {NORM_SCALING_CHOICES}, got {norm_scaling!r}")


def fold_scale_into_gamma(
    gamma: torch.Tensor, scale: float, zero_centered: bool = False
) -> torch.Tensor:
    """The gamma parameter that makes a norm's output ``scale`` times larger.

    Plain gamma (``y = x_hat * g``): ``g' = s * g``.
    Zero-centred gamma (``y = x_hat * (1 + g)``, the form Transformer Engine's
    ``zero_centered_gamma`` uses): ``1 + g' = s * (1 + g)``, so ``g' = s * g + (s - 1)``.
    """
    if scale == 1.0:
        return gamma
    if zero_centered:
        return gamma * scale + (scale - 1.0)
    return gamma * scale


def fold_scale_into_beta(beta: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """``b' = s * b``; a missing bias stays missing."""
    if beta is None or scale == 1.0:
        return beta
    return beta * scale
