"""megatron ``ModuleSpec``s for LNS layers: the one place that chooses the backend.

Local backend: megatron's own local GPT layer spec (``get_gpt_layer_local_submodules``)
with two substitutions: the layer class is :class:`LNSTransformerLayer` and the norms are
:class:`LocalNorm`. Everything else (attention, MLP, ``sharded_state_dict_keys_map``)
is megatron's, so parameter names and checkpoint keys are exactly those of a plain
Pre-LN model built from megatron's local spec, and checkpoints move between the two.
Transformer Engine backend: megatron's TE spec with LNS folded into its fused norms
(``te.py``, built on ``fused_norm.py``).

With ``norm_scaling="none"`` the result is an ordinary Pre-LN layer.

For people already on Megatron-LM or Megatron-Bridge (docs/megatron_integration.md):
:data:`lns_layer_spec` is a module-level spec for Megatron-LM's
``--spec megatron_lns.model.specs lns_layer_spec``, and :func:`lns_block_spec` is a callable
for the ``transformer_layer_spec`` of a Megatron-Bridge GPT provider (or of Megatron-LM's
``GPTModelConfig``), which call it with the config and, if it takes one, ``vp_stage``.
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_lns.config import model_derived
from megatron_lns.config.moe_layers import moe_layer_pattern
from megatron_lns.model.layer import LNSTransformerLayer
from megatron_lns.model.norms import local_norm_builder
from megatron_lns.model.scaling import NORM_SCALING_CHOICES, NormScaling
from megatron_lns.model.te import get_te_lns_layer_spec, te_final_norm_builder
from megatron_lns.model.variants import PLAIN_PRE_LN, VariantSettings, VariantTransformerLayer

BACKENDS = ("local", "te")


def get_lns_layer_spec(
    norm_scaling: NormScaling = "lns",
    backend: str = "local",
    norm_affine: bool = True,
    qk_layernorm: bool = False,
    variant: VariantSettings = PLAIN_PRE_LN,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
) -> ModuleSpec:
    """Spec of one transformer layer with LayerNorm Scaling (or plain Pre-LN), or one of
    the other layer variants (``variants/``).

    With ``num_experts`` the MLP is megatron's ``MoELayer`` (router, token dispatcher,
    experts, optional shared experts): its pre-norm feeds the router and the experts
    alike, so both see the scaled input. Its norm is a separate module in both backends,
    as in megatron's own MoE specs, and is checkpointed as ``pre_mlp_layernorm.*`` in both.
    """
    if norm_scaling not in NORM_SCALING_CHOICES:
        raise ValueError(
            f"norm_scaling must be one of {NORM_SCALING_CHOICES}, got {norm_scaling!r}"
        )
    variant.check(norm_scaling)
    if backend == "te" and variant.needs_variant_layer:
        raise ValueError(
            f"layer_variant={variant.layer_variant!r} (output_layer_init="
            f"{variant.output_init!r}) is implemented for backend='local' only"
        )
    if backend == "te":
        return get_te_lns_layer_spec(
            norm_scaling,
            norm_affine=norm_affine,
            qk_layernorm=qk_layernorm,
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
        )
    if backend != "local":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if moe_grouped_gemm:
        # megatron's local backend builds SequentialMLP whatever moe_grouped_gemm says.
        raise ValueError(
            "moe_grouped_gemm needs the Transformer Engine backend (TEGroupedMLP); the local "
            "backend runs the experts one after another"
        )

    norm = local_norm_builder(norm_affine)
    submodules = get_gpt_layer_local_submodules(num_experts=num_experts, qk_layernorm=qk_layernorm)
    submodules.input_layernorm = norm
    submodules.pre_mlp_layernorm = norm
    if num_experts:
        # The MoE layer has no linear_fc1 to file its norm under: keep the module's own
        # key, as megatron's TE MoE spec does, so checkpoints move between the backends.
        submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
    if qk_layernorm:
        attention = submodules.self_attention.submodules
        attention.q_layernorm = local_norm_builder(True)
        attention.k_layernorm = local_norm_builder(True)
    if variant.needs_variant_layer:
        return ModuleSpec(
            module=VariantTransformerLayer,
            submodules=submodules,
            params={"norm_scaling": norm_scaling, "variant": variant},
        )
    return ModuleSpec(
        module=LNSTransformerLayer, submodules=submodules, params={"norm_scaling": norm_scaling}
    )


def get_lns_block_spec(
    config: TransformerConfig,
    norm_scaling: NormScaling = "lns",
    backend: str = "local",
    norm_affine: bool = True,
    qk_layernorm: bool = False,
    vp_stage: int | None = None,
    variant: VariantSettings = PLAIN_PRE_LN,
) -> TransformerBlockSubmodules:
    """Spec of this pipeline stage's (or virtual chunk's) share of the decoder.

    A block spec rather than a bare layer spec so that the final norm is a
    :class:`LocalNorm` too: megatron's default final norm without apex cannot do
    sequence parallelism or parameter-free LayerNorm. The final norm is never scaled.

    With ``config.num_moe_experts``, ``config.moe_layer_freq`` says which layers are MoE
    (megatron's rule, ``moe.moe_layer_pattern``); the stage takes its slice of the whole
    model's pattern, so layer ``l`` is dense or MoE whatever the pipeline layout.
    """
    dense = get_lns_layer_spec(norm_scaling, backend, norm_affine, qk_layernorm, variant)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    if model_derived.has_experts(config):
        moe = get_lns_layer_spec(
            norm_scaling,
            backend,
            norm_affine,
            qk_layernorm,
            variant,
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
        )
        pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
        layer_specs = [moe if pattern[i] else dense for i in range(offset, offset + num_layers)]
    else:
        layer_specs = [dense] * num_layers
    if backend == "te":
        final_norm = te_final_norm_builder(norm_affine)
    else:
        final_norm = local_norm_builder(norm_affine)
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=final_norm)


# Megatron-LM's ``--spec <module> <name>`` imports ``vars(module)[name]``: an object, not a
# function, so it has to exist at import time. The local backend (megatron's own local
# layer with LNS norms); megatron adds its default final norm.
lns_layer_spec: ModuleSpec = get_lns_layer_spec("lns", "local")

_IMPL_TO_BACKEND = {"local": "local", "transformer_engine": "te"}


def lns_block_spec(config: object, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The LNS decoder of one pipeline stage for a Megatron-Bridge GPT provider (itself a
    ``TransformerConfig``) or a Megatron-LM ``GPTModelConfig`` (which holds one as
    ``.transformer``): local or Transformer Engine layers as ``transformer_impl`` says,
    ``qk_layernorm`` as configured, and an (unscaled) LNS-aware final norm."""
    tf_config = config if isinstance(config, TransformerConfig) else config.transformer
    impl = tf_config.transformer_impl
    if impl not in _IMPL_TO_BACKEND:
        raise ValueError(
            f"transformer_impl={impl!r} has no LNS layer spec; use one of "
            f"{sorted(_IMPL_TO_BACKEND)}"
        )
    return get_lns_block_spec(
        tf_config,
        backend=_IMPL_TO_BACKEND[impl],
        qk_layernorm=bool(tf_config.qk_layernorm),
        vp_stage=vp_stage,
    )


# Local-backend norm parameter names -> the fused (Transformer Engine) names. Checkpoints
# already agree (megatron's local spec saves its norms under the fused names); this is
# for plain ``state_dict`` transfers between the two backends.
LOCAL_TO_FUSED_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def local_to_fused_state_dict(state_dict: dict) -> dict:
    """A local-backend model's ``state_dict`` under fused-norm (TE) parameter names.

    An MoE layer (one with ``mlp.router.weight``) keeps its separate pre-MLP norm in both
    backends, so its ``pre_mlp_layernorm.*`` keeps its name."""
    renamed = {}
    for key, value in state_dict.items():
        for local, fused in LOCAL_TO_FUSED_NORM_NAMES.items():
            if not key.endswith("." + local):
                continue
            layer = key[: -len(local)]
            if local.startswith("pre_mlp_layernorm.") and layer + "mlp.router.weight" in state_dict:
                break
            key = layer + fused
            break
        renamed[key] = value
    return renamed
