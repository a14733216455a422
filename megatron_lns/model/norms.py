"""Local-backend (pure PyTorch) norms for megatron's local spec, LNS-aware.

megatron's own local-spec norm without apex (``WrappedTorchNorm``) refuses sequence
parallelism and zero-centred gamma and has no parameter-free variant, all of which
LNS users need (OLMo's LayerNorm has neither weight nor bias). :class:`LocalNorm`
covers RMSNorm and LayerNorm, affine or not, plain or zero-centred gamma, and marks
its parameters ``sequence_parallel`` so megatron all-reduces their gradients across
the tensor-parallel group.

The LNS factor is folded into gamma/beta at forward time (see ``scaling.py``): the
activations see exactly one norm kernel whether or not LNS is on.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lns.model.scaling import (
    bake_scale_into,
    fold_scale_into_beta,
    require_affine,
    scaled_gamma,
)

SUPPORTED_NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class LocalNorm(torch.nn.Module):
    """``config.normalization`` over the last dimension, optionally scaled by a constant.

    A :class:`~megatron_lns.model.scaling.ScaledNorm`: ``output_scale`` is a plain float (never
    a buffer, never in a checkpoint), set by :class:`~megatron_lns.model.layer.LNSTransformerLayer`
    from its global layer number; it stays 1.0 for the final norm.
    """

    norm_parameter_names = ("weight", "bias")

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        affine: bool = True,
        **_unused: Any,
    ) -> None:
        super().__init__()
        if config.normalization not in SUPPORTED_NORMALIZATIONS:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported by the local "
                f"backend; choose one of {SUPPORTED_NORMALIZATIONS}"
            )
        self.normalization = config.normalization
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma) and affine
        self.output_scale = 1.0
        if affine:
            gamma_init = torch.zeros if self.zero_centered_gamma else torch.ones
            self.weight = torch.nn.Parameter(gamma_init(hidden_size, dtype=config.params_dtype))
            self.bias = (
                torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
                if self.normalization == "LayerNorm"
                else None
            )
            for param in self.parameters():
                param.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self._constant_gamma: dict[tuple[torch.device, torch.dtype, float], torch.Tensor] = {}

    @property
    def affine(self) -> bool:
        return self.weight is not None

    def bake_output_scale(self) -> None:
        """Multiply ``output_scale`` into gamma/beta for good; the norm is then plain."""
        require_affine(self)
        bake_scale_into(self.weight, self.bias, self.output_scale, self.zero_centered_gamma)
        self.output_scale = 1.0

    def effective_gamma(self, like: torch.Tensor) -> torch.Tensor | None:
        """The multiplicative weight the norm kernel applies, LNS factor included."""
        if self.weight is None:
            return None if self.output_scale == 1.0 else self._constant(like)
        # (1 + g) * s in fp32, rounded once to the activation dtype: as precise as a plain
        # gamma even where a folded zero-centred s*g + (s-1) would not be (scaled_gamma).
        return scaled_gamma(self.weight, self.output_scale, self.zero_centered_gamma, like.dtype)

    def effective_beta(self) -> torch.Tensor | None:
        return fold_scale_into_beta(self.bias, self.output_scale)

    def _constant(self, like: torch.Tensor) -> torch.Tensor:
        # Parameter-free norm with LNS: gamma is the constant s. Cached per device/dtype
        # so no kernel runs per step; derived from output_scale, never saved.
        key = (like.device, like.dtype, self.output_scale)
        if key not in self._constant_gamma:
            self._constant_gamma[key] = torch.full(
                (self.hidden_size,), self.output_scale, dtype=like.dtype, device=like.device
            )
        return self._constant_gamma[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.effective_gamma(x)
        if gamma is not None and gamma.dtype != x.dtype:
            gamma = gamma.to(x.dtype)
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (self.hidden_size,), gamma, self.eps)
        beta = self.effective_beta()
        if beta is not None and beta.dtype != x.dtype:
            beta = beta.to(x.dtype)
        return F.layer_norm(x, (self.hidden_size,), gamma, beta, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalization}({self.hidden_size}, eps={self.eps}, affine={self.affine}, "
            f"zero_centered_gamma={self.zero_centered_gamma}, output_scale={self.output_scale:.6g})"
        )


def local_norm_builder(norm_affine: bool = True) -> partial:
    """A megatron ``LayerNormBuilder`` for :class:`LocalNorm` (affine or parameter-free)."""
    return partial(LocalNorm, affine=norm_affine)


class MultiplyAfterNorm(LocalNorm):
    """Reference implementation: the norm, then a separate multiply by ``output_scale``.

    This is how the paper's code applies LNS. It costs an extra elementwise pass over
    the activations (forward and backward); it exists only as a reference for tests
    and for ``benchmarks/lns_overhead.py``, never in a training spec.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, self.output_scale = self.output_scale, 1.0
        try:
            normed = super().forward(x)
        finally:
            self.output_scale = scale
        return normed * scale if scale != 1.0 else normed
