"""LNS on megatron-core's ``HybridModel``: the hybrid stack spec (local and TE backends).

``HybridStack`` builds one module per pattern symbol (``hybrid_pattern.py``). Each LNS
sublayer here is one half of the GPT model's LNS layer (``specs.get_lns_layer_spec``):
the attention sublayer keeps its input norm and attention, the MLP / MoE sublayer its
pre-MLP norm and MLP. So the modules, their parameter names within the sublayer and their
norms (separate ``LocalNorm``s, or norms fused into ``linear_qkv`` / ``linear_fc1``) are
the GPT model's, and ``*-*-...`` computes exactly what the GPT LNS model computes.

The one thing that differs is the depth: megatron numbers sublayers, not blocks, so each
sublayer is told the paper's block index of every sublayer (``block_numbers``) and takes
its own from there instead of from ``layer_number``.

For Megatron-LM (docs/megatron_integration.md): :data:`lns_hybrid_stack_spec` is a
module-level stack spec for ``--spec megatron_lns.model.hybrid_specs lns_hybrid_stack_spec``
with a hybrid model; the stack reads the pattern from Megatron-LM's arguments there.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lns.config import hybrid_pattern
from megatron_lns.model.norms import local_norm_builder
from megatron_lns.model.scaling import NormScaling
from megatron_lns.model.specs import get_lns_layer_spec
from megatron_lns.model.te import te_final_norm_builder


def attention_half(layer: ModuleSpec) -> ModuleSpec:
    """The attention sublayer of a full (attention + MLP) layer spec."""
    return _without(layer, "pre_mlp_layernorm", "mlp", "mlp_bda")


def mlp_half(layer: ModuleSpec) -> ModuleSpec:
    """The MLP (or MoE) sublayer of a full layer spec."""
    return _without(layer, "input_layernorm", "self_attention", "self_attn_bda")


def _without(layer: ModuleSpec, norm: str, module: str, bias_dropout_add: str) -> ModuleSpec:
    """A copy of ``layer`` with one branch's norm, module and bias-dropout-add made
    identities, which is how megatron's ``TransformerLayer`` leaves a branch out."""
    half = copy.deepcopy(layer)
    setattr(half.submodules, norm, IdentityOp)
    setattr(half.submodules, module, IdentityOp)
    setattr(half.submodules, bias_dropout_add, IdentityFuncOp)
    return half


class LNSHybridStack(HybridStack):
    """megatron's ``HybridStack`` with LNS sublayers: each is given the block index of
    every sublayer of the whole pattern (so of every pipeline stage), and the final norm
    is the spec's (never scaled) instead of megatron's hard-wired ``TENorm``.

    ``hybrid_layer_pattern`` is the whole model's main pattern; ``None`` reads it from
    Megatron-LM's arguments (the ``--spec`` route)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: HybridStackSubmodules,
        *,
        final_norm: Any,
        hybrid_layer_pattern: str | None = None,
        post_layer_norm: bool = True,
        **kwargs: Any,
    ) -> None:
        pattern = hybrid_layer_pattern or _megatron_lm_pattern()
        layer_types = kwargs.get("layer_type_list") or []
        unsupported = sorted(set(layer_types) - set(hybrid_pattern.SUPPORTED))
        if unsupported:
            names = ", ".join(
                f"{symbol!r} ({hybrid_pattern.REFUSED.get(symbol, 'unknown')})"
                for symbol in unsupported
            )
            raise ValueError(
                f"the LNS hybrid stack builds {', '.join(hybrid_pattern.SUPPORTED)} sublayers, "
                f"not {names}"
            )
        numbers = hybrid_pattern.block_numbers(pattern)
        submodules = copy.copy(submodules)
        for name in ("attention_layer", "mlp_layer", "moe_layer"):
            spec = copy.copy(getattr(submodules, name))
            if isinstance(spec, ModuleSpec):
                spec.params = {**spec.params, "block_numbers": numbers}
                setattr(submodules, name, spec)
        super().__init__(config, submodules, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = final_norm(
                config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )


def _megatron_lm_pattern() -> str:
    try:
        from megatron.training import get_args

        args = get_args()
        # --hybrid-override-pattern is megatron's deprecated spelling of the same pattern.
        pattern = args.hybrid_layer_pattern or getattr(args, "hybrid_override_pattern", None)
    except (ImportError, AssertionError, AttributeError):
        pattern = None
    if not pattern:
        raise ValueError(
            "LNSHybridStack needs the whole model's hybrid_layer_pattern for the block index "
            "of each sublayer: pass it in the spec's params or run under Megatron-LM with "
            "--hybrid-layer-pattern"
        )
    return pattern.split(hybrid_pattern.MTP)[0]


def get_lns_hybrid_stack_spec(
    hybrid_layer_pattern: str | None,
    norm_scaling: NormScaling = "lns",
    backend: str = "local",
    norm_affine: bool = True,
    qk_layernorm: bool = False,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
) -> ModuleSpec:
    """The LNS hybrid stack for ``hybrid_layer_pattern`` (the whole model's, ``|`` kept;
    ``None``: Megatron-LM's ``--hybrid-layer-pattern``): attention, MLP and (with
    ``num_experts``) MoE sublayers, local or Transformer Engine modules."""
    layer = get_lns_layer_spec(norm_scaling, backend, norm_affine, qk_layernorm)
    moe = IdentityOp
    if num_experts:
        moe_layer = get_lns_layer_spec(
            norm_scaling,
            backend,
            norm_affine,
            qk_layernorm,
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
        )
        moe = mlp_half(moe_layer)
    final_norm = (
        te_final_norm_builder(norm_affine) if backend == "te" else local_norm_builder(norm_affine)
    )
    return ModuleSpec(
        module=LNSHybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=attention_half(layer), mlp_layer=mlp_half(layer), moe_layer=moe
        ),
        params={"final_norm": final_norm, "hybrid_layer_pattern": hybrid_layer_pattern},
    )


# Megatron-LM's ``--spec <module> <name>`` imports an object: the local backend, dense and
# MoE sublayers (experts one by one); the pattern comes from --hybrid-layer-pattern.
lns_hybrid_stack_spec: ModuleSpec = get_lns_hybrid_stack_spec(None, num_experts=1)
