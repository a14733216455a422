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
* a zero-centred gamma is passed as the plain gamma ``s*(1+g)`` with the module's
  ``zero_centered_gamma`` off for the call, which keeps bf16 precision;
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
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_lns.model.layer import LNSTransformerLayer
from megatron_lns.model.scaling import (
    NormScaling,
    bake_scale_into,
    fold_scale_into_beta,
    require_affine,
    scaled_gamma,
)

NORM_PARAMETER_NAMES = ("layer_norm_weight", "layer_norm_bias")


@contextlib.contextmanager
def folded_norm_parameters(module: torch.nn.Module, scale: float) -> Iterator[None]:
    """Within the block, the module's fused norm computes its output times ``scale``.

    ``layer_norm_weight`` reads as the plain gamma ``s*g`` and ``layer_norm_bias`` as
    ``s*b``. A zero-centred gamma reads as ``s*(1+g)`` with ``module.zero_centered_gamma``
    off for the block (Transformer Engine reads that flag at forward time and keeps what it
    used for backward): TE casts the weight to the activation dtype before its kernel adds
    1, so the folded zero-centred form ``s*g + (s-1)`` would lose percents of the scale in
    bf16 (see ``scaling.scaled_gamma``).
    """
    if scale == 1.0:
        yield
        return
    zero_centered = module.zero_centered_gamma
    shadowed = []
    try:
        weight = module._parameters.get("layer_norm_weight")
        if weight is not None:
            module.__dict__["layer_norm_weight"] = scaled_gamma(weight, scale, zero_centered)
            shadowed.append("layer_norm_weight")
        bias = module._parameters.get("layer_norm_bias")
        if bias is not None:
            module.__dict__["layer_norm_bias"] = fold_scale_into_beta(bias, scale)
            shadowed.append("layer_norm_bias")
        module.zero_centered_gamma = False
        yield
    finally:
        for name in shadowed:
            module.__dict__.pop(name, None)
        module.zero_centered_gamma = zero_centered


class FusedNormScaling:
    """Mixin for a fused norm + linear class: applies ``output_scale`` to its norm.

    A :class:`~megatron_lns.model.scaling.ScaledNorm`. ``output_scale`` is set by
    :class:`~megatron_lns.model.layer.LNSTransformerLayer`; ``zero_centered_gamma`` is the wrapped
    module's own attribute (Transformer Engine's). ``affine=False`` freezes gamma at the
    identity (and beta at 0) and leaves them out of checkpoints, giving a parameter-free
    norm whose effective gamma is ``output_scale``.
    """

    output_scale: float = 1.0
    affine: bool = True
    norm_parameter_names = NORM_PARAMETER_NAMES
    zero_centered_gamma: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(getattr(self, "zero_centered_gamma", None), bool):
            raise TypeError(
                f"{type(self).__name__} has no boolean zero_centered_gamma attribute; LNS can "
                "only be folded into a fused norm that says which gamma form it uses"
            )
        if not self.affine:
            self._freeze_norm_parameters()
            self._register_state_dict_hook(_drop_frozen_norm_parameters)
            self.register_load_state_dict_pre_hook(_keep_frozen_norm_parameters)

    def reset_parameters(self, *args: Any, **kwargs: Any) -> None:
        """The wrapped class's reset, keeping a parameter-free norm frozen.

        Transformer Engine's ``reset_parameters`` (called by its ``__init__`` and by
        Megatron-FSDP's meta-device init) re-wraps every parameter as a fresh
        ``nn.Parameter``, which would make the frozen gamma/beta trainable again.
        """
        super().reset_parameters(*args, **kwargs)
        if not self.affine:
            self._freeze_norm_parameters()

    @torch.no_grad()
    def _freeze_norm_parameters(self) -> None:
        """Gamma and beta at the identity (gamma 0 when zero-centred), out of training."""
        for name in NORM_PARAMETER_NAMES:
            param = self._parameters.get(name)
            if param is not None:
                identity = 1.0 if name == "layer_norm_weight" else 0.0
                if self.zero_centered_gamma:
                    identity = 0.0
                param.fill_(identity)
                param.requires_grad_(False)

    def forward(self, *args: Any, **kwargs: Any):
        with folded_norm_parameters(self, self.output_scale):
            return super().forward(*args, **kwargs)

    def bake_output_scale(self) -> None:
        """Multiply ``output_scale`` into the norm parameters for good; the norm is then plain."""
        require_affine(self)
        weight, bias = (self._parameters.get(name) for name in NORM_PARAMETER_NAMES)
        bake_scale_into(weight, bias, self.output_scale, self.zero_centered_gamma)
        self.output_scale = 1.0

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.affine:
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

    The class keeps ``linear_cls.__name__``: megatron-core dispatches on class names
    (Megatron-FSDP's ``FullyShardedDataParallel._detect_parallelism_type`` treats a
    ``"TELayerNormColumnParallelLinear"`` as column-parallel with replicated norm
    parameters, and any other name containing "Norm" as replicated throughout), so a
    new name would silently change parameter layouts. ``isinstance(m, FusedNormScaling)``
    identifies the LNS class; its ``__qualname__`` says what it wraps.
    """
    qualname = f"with_norm_scaling({linear_cls.__qualname__}, norm_affine={norm_affine})"
    return type(
        linear_cls.__name__,
        (FusedNormScaling, linear_cls),
        {"affine": norm_affine, "__qualname__": qualname, "__module__": __name__},
    )


def fused_norm_layer_spec(
    submodules: TransformerLayerSubmodules, norm_scaling: NormScaling, norm_affine: bool = True
) -> ModuleSpec:
    """An LNS layer spec from submodules whose pre-norms are fused into the next linear.

    ``linear_qkv`` and the MLP's ``linear_fc1`` classes (Transformer Engine's
    ``TELayerNormColumnParallelLinear``, or any module that reads
    ``self.layer_norm_weight`` in forward) get :class:`FusedNormScaling` mixed in.
    Parameter names, checkpoint keys and the ``sequence_parallel`` attributes stay as
    the wrapped class makes them.
    """
    if submodules.input_layernorm is not IdentityOp:
        raise ValueError("fused_norm_layer_spec expects the attention norm fused into linear_qkv")
    attention = submodules.self_attention.submodules
    attention.linear_qkv = with_norm_scaling(attention.linear_qkv, norm_affine)
    if submodules.pre_mlp_layernorm is not IdentityOp:
        # A separate pre-MLP norm (an MoE layer's): it must apply the factor itself.
        return ModuleSpec(
            module=LNSTransformerLayer, submodules=submodules, params={"norm_scaling": norm_scaling}
        )
    mlp = submodules.mlp
    mlp_class = getattr(getattr(mlp, "func", None), "__self__", None)
    if mlp_class is not None and mlp_class.__name__.startswith("TEFused"):
        raise ValueError(
            "the Transformer Engine op fuser (TEFusedMLP) reads the raw pre-MLP norm weight, "
            "so LNS cannot be folded into it; build the spec without use_te_op_fuser"
        )
    mlp_submodules = mlp.keywords["submodules"]
    mlp_submodules.linear_fc1 = with_norm_scaling(mlp_submodules.linear_fc1, norm_affine)
    return ModuleSpec(
        module=LNSTransformerLayer, submodules=submodules, params={"norm_scaling": norm_scaling}
    )
