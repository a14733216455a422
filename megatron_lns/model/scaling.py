"""How a norm scaling rule's factor folds into a norm's affine parameters.

A rule (``model.norm_scaling``, registered in ``config/norm_scalings.py``) scales the output
of a pre-block norm in block ``l`` by ``s = factor(l)``; LNS's factor is ``1/sqrt(l)``.
A norm's output is ``x_hat * gamma + beta``, so scaling it by ``s`` is the same as
using ``s * gamma`` and ``s * beta``: the factor can be folded into the affine
parameters at forward time, which costs no pass over the activations and keeps
fused norm+linear kernels fused. Autograd carries the factor into the parameter
gradients, so forward and backward are exact.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

# The rules and their factors are registered in config/norm_scalings.py (torch-free); they
# are re-exported here, where the folding that applies them lives.
from megatron_lns.config.choices import NORM_SCALING_CHOICES as NORM_SCALING_CHOICES
from megatron_lns.config.choices import NormScaling as NormScaling
from megatron_lns.config.norm_scalings import lns_factor as lns_factor
from megatron_lns.config.norm_scalings import norm_output_scale as norm_output_scale


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


def scaled_gamma(
    gamma: torch.Tensor, scale: float, zero_centered: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The plain multiplicative weight of a norm scaled by ``scale``: ``s*g``, or ``s*(1+g)``
    for zero-centred gamma, computed in at least fp32 and rounded once to ``dtype``
    (default: ``gamma``'s).

    This is what a kernel should multiply by. The folded zero-centred parameter
    ``s*g + (s-1)`` is exact in real arithmetic but sits near ``-(1-s)``, where bf16's step
    is 2^-8, so in bf16 the effective scale of a deep layer would be off by percents
    (1.6% at layer 64); rounded here, ``s*(1+g)`` is as precise as any plain bf16 gamma.
    """
    effective = _at_least_fp32(gamma)
    if zero_centered:
        effective = effective + 1.0
    if scale != 1.0:
        effective = effective * scale
    return effective.to(dtype or gamma.dtype)


@torch.no_grad()
def bake_scale_into(
    gamma: torch.Tensor, beta: torch.Tensor | None, scale: float, zero_centered: bool
) -> None:
    """Multiply ``scale`` into a norm's stored parameters in place, keeping their form.

    Computed in at least fp32 and rounded once. A zero-centred gamma stays zero-centred,
    so a baked deep layer stores ``s*g + (s-1)``: bake fp32 parameters (a checkpoint's),
    not bf16 model copies, or see :func:`scaled_gamma` for the precision lost.
    """
    gamma.copy_(fold_scale_into_gamma(_at_least_fp32(gamma), scale, zero_centered))
    if beta is not None:
        beta.copy_(fold_scale_into_beta(_at_least_fp32(beta), scale))


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


@runtime_checkable
class ScaledNorm(Protocol):
    """What :class:`~megatron_lns.model.layer.LNSTransformerLayer` needs from the module that
    applies one of its pre-norms, separate (``norms.LocalNorm``) or fused into the next
    linear (``fused_norm.FusedNormScaling``).

    ``output_scale`` is the factor the norm's output is multiplied by (set by the layer,
    1.0 for plain Pre-LN and the final norm). ``norm_parameter_names`` names the module's
    gamma and beta attributes, the parameters the factor folds into (beta may be absent).
    ``bake_output_scale`` multiplies the factor into them for good and resets it to 1.
    """

    output_scale: float
    norm_parameter_names: tuple[str, str]

    @property
    def affine(self) -> bool:
        """False for a parameter-free norm (OLMo): no gamma or beta to train or bake into."""
        ...

    @property
    def zero_centered_gamma(self) -> bool:
        """Whether gamma is stored as ``g`` with the norm multiplying by ``1 + g``."""
        ...

    def bake_output_scale(self) -> None: ...


def require_affine(norm: ScaledNorm) -> None:
    """Refuse to bake into a parameter-free norm, which has nothing to hold the factor."""
    if not norm.affine:
        raise ValueError(
            f"{type(norm).__name__} has a parameter-free norm: there is no weight to bake "
            "the LNS factor into; export it with an explicit scale instead"
        )
