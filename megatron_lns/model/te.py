"""Transformer Engine backend for LNS: megatron's TE layer spec with LNS folded in.

Importing this module does not import Transformer Engine; building a spec does, and
says how to install it when it is missing.

megatron's own TE layer spec fuses each pre-norm into the GEMM that follows it
(``TELayerNormColumnParallelLinear`` for ``linear_qkv`` and ``linear_fc1``); the LNS
factor is folded into those fused norms at forward time (``fused_norm.py``), so the
fusion and its FP8 cast stay intact and no kernel is added.
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_with_transformer_engine_submodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_lns.model.fused_norm import fused_norm_layer_spec
from megatron_lns.model.norms import local_norm_builder
from megatron_lns.model.scaling import NormScaling

# The `te` extra's floor: fused_norm.py was checked against TE 2.8's and 2.10's source, and
# the userbuffers and offloading code uses their interfaces.
TE_MIN_VERSION = "2.8"
INSTALL_HINT = (
    "Transformer Engine is not installed (it needs CUDA): install it with "
    "`pip install 'megatron-lns[te]'` on a CUDA machine or use an NGC PyTorch container, "
    "or set model.transformer_engine=false for the local backend"
)


class TransformerEngineUnavailable(ImportError):
    pass


def te_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def require_te() -> None:
    if not te_available():
        raise TransformerEngineUnavailable(INSTALL_HINT)


def get_te_lns_layer_spec(
    norm_scaling: NormScaling,
    *,
    norm_affine: bool,
    qk_layernorm: bool,
    num_experts: int | None,
    moe_grouped_gemm: bool,
) -> ModuleSpec:
    """megatron's TE GPT layer spec with LNS folded into its fused norms: the
    ``backend="te"`` part of ``specs.get_lns_layer_spec``, which decides the defaults.

    An MoE layer (``num_experts``) has no ``linear_fc1`` to fuse its pre-MLP norm into:
    megatron's TE MoE spec gives it a separate ``TENorm``; here it is our ``LocalNorm``
    (the factor folded into gamma, same checkpoint key ``pre_mlp_layernorm.*``). Experts
    are TE's grouped GEMM (``TEGroupedMLP``) with ``moe_grouped_gemm``, else TE linears
    run one expert at a time.
    """
    require_te()
    submodules = get_gpt_layer_with_transformer_engine_submodules(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm
    )
    if num_experts:
        submodules.pre_mlp_layernorm = local_norm_builder(norm_affine)
    return fused_norm_layer_spec(submodules, norm_scaling, norm_affine)


def te_final_norm_builder(norm_affine: bool = True):
    """TE's fused norm for the (never scaled) final norm; parameter-free falls back to local."""
    require_te()
    if not norm_affine:
        return local_norm_builder(norm_affine=False)
    from megatron.core.extensions.transformer_engine import TENorm

    return TENorm
