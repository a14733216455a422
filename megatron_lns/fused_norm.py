"""LNS inside a fused norm + linear module (Transformer Engine's ``LayerNormLinear``).

Transformer Engine fuses the pre-norm into the following GEMM (``linear_qkv`` and
``linear_fc1``) and reads ``self.layer_norm_weight`` / ``self.layer_norm_bias`` by plain
attribute access on every forward. A separate multiply after the norm would break the
fusion (and the FP8 cast inside it), so the factor is folded into those parameters for
the duration of the forward call:

* the folded tensor is placed in the module's instance ``__dict__`` under the
  parameter's name. Python finds instance attributes before ``nn.Module.__getattr__``
  looks in ``_parameters``, so the kernel reads the folded tensor, while the real
  parameter stays registered: its name, checkpoint key, optimizer slot and the
  ``sequence_parallel`` attribute TE and megatron set on it are untouched;
* the folded tensor is an autograd expression of the parameter, so the gradient that
  the fused kernel returns for it flows to the parameter exactly;
* the shadow is removed when forward returns (also on error).

Renaming the parameter (``torch.nn.utils.parametrize``) would change checkpoint keys,
and a class-level property would break TE's ``setattr(weight, "sequence_parallel", ...)``;
this does neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache
from typing import Any

import torch

from megatron_lns.scaling import fold_scale_into_beta, fold_scale_into_gamma

NORM_PARAMETER_NAMES = ("layer_norm_weight", "layer_norm_bias")


@contextlib.contextmanager
def folded_norm_parameters(
    module: torch.nn.Module, scale: float, zero_centered_gamma: bool
) -> Iterator[None]:
    """Within the block, ``module.layer_norm_weight``/``_bias`` read as their folded values."""
    if scale == 1.0:
        yield
        return
    shadowed = []
    try:
        for name in NORM_PARAMETER_NAMES:
            param = module._parameters.get(name)
            if param is None:
                continue
            if name == "layer_norm_weight":
                folded = fold_scale_into_gamma(param, scale, zero_centered_gamma)
            else:
                folded = fold_scale_into_beta(param, scale)
            module.__dict__[name] = folded
            shadowed.append(name)
        yield
    finally:
        for name in shadowed:
            module.__dict__.pop(name, None)


class FusedNormScaling:
    """Mixin for a fused norm + linear class: applies ``output_scale`` to its norm.

    ``output_scale`` is set by :class:`~megatron_lns.layer.LNSTransformerLayer`;
    ``norm_affine=False`` freezes gamma at 1 (and beta at 0) and leaves them out of
    checkpoints, giving a parameter-free norm whose effective gamma is ``output_scale``.
    """

    output_scale: float = 1.0
    norm_affine: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs.get("config")
        self.lns_zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        if not self.norm_affine:
            with torch.no_grad():
                for name in NORM_PARAMETER_NAMES:
                    param = self._parameters.get(name)
                    if param is not None:
                        identity = 1.0 if name == "layer_norm_weight" else 0.0
                        if self.lns_zero_centered_gamma:
                            identity = 0.0
                        param.fill_(identity)
                        param.requires_grad_(False)
            self._register_state_dict_hook(_drop_frozen_norm_parameters)
            self.register_load_state_dict_pre_hook(_keep_frozen_norm_parameters)

    def forward(self, *args: Any, **kwargs: Any):
        with folded_norm_parameters(self, self.output_scale, self.lns_zero_centered_gamma):
            return super().forward(*args, **kwargs)

    def folded_layer_norm_weight(self) -> torch.Tensor:
        """The norm weight as the kernel sees it (for code that reads it directly)."""
        return fold_scale_into_gamma(
            self.layer_norm_weight.data, self.output_scale, self.lns_zero_centered_gamma
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.norm_affine:
            for name in NORM_PARAMETER_NAMES:
                sharded.pop(f"{prefix}{name}", None)
        return sharded


def _drop_frozen_norm_parameters(module, state_dict, prefix, local_metadata) -> None:
    for name in NORM_PARAMETER_NAMES:
        state_dict.pop(prefix + name, None)


def _keep_frozen_norm_parameters(module, state_dict, prefix, *args) -> None:
    for name in NORM_PARAMETER_NAMES:
        param = module._parameters.get(name)
        if param is not None:
            state_dict.setdefault(prefix + name, param.detach())


@cache
def with_norm_scaling(linear_cls: type, norm_affine: bool = True) -> type:
    """``linear_cls`` (a fused norm + linear class) with :class:`FusedNormScaling` mixed in.

    A class rather than constructor arguments, because megatron builds ``linear_qkv``
    with ``build_module`` and ``linear_fc1`` by calling the class directly.
    """
    name = f"LNS{linear_cls.__name__}" + ("" if norm_affine else "NonAffine")
    return type(name, (FusedNormScaling, linear_cls), {"norm_affine": norm_affine})
