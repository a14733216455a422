"""The names and numerics every Hugging Face architecture shares.

Megatron's checkpoint keys, the Hugging Face names of the Llama layout that all
registered architectures use (``model.embed_tokens``, ``model.layers.i.``,
``model.norm``, ``lm_head``), the exact fold of the LNS factor into a norm weight and
its exact inverse, and the RoPE settings of a ``transformers`` config. What differs
between architectures lives in :mod:`megatron_lns.convert.architectures`, one module
each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_lns.config.layer_variants import REGISTRY as LAYER_VARIANTS
from megatron_lns.model.scaling import fold_scale_into_gamma

# Checkpoint keys (megatron's sharded keys). Per-layer tensors are stacked on a leading
# layer axis under LAYERS + name; the local spec's separate norms are saved under the
# names of the norms fused into linear_qkv / linear_fc1.
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM_WEIGHT = "decoder.final_layernorm.weight"
FINAL_NORM_BIAS = "decoder.final_layernorm.bias"
LAYERS = "decoder.layers."
ATTN_NORM_WEIGHT = "self_attention.linear_qkv.layer_norm_weight"
ATTN_NORM_BIAS = "self_attention.linear_qkv.layer_norm_bias"
QKV_WEIGHT = "self_attention.linear_qkv.weight"
QKV_BIAS = "self_attention.linear_qkv.bias"
PROJ_WEIGHT = "self_attention.linear_proj.weight"
PROJ_BIAS = "self_attention.linear_proj.bias"
MLP_NORM_WEIGHT = "mlp.linear_fc1.layer_norm_weight"
MLP_NORM_BIAS = "mlp.linear_fc1.layer_norm_bias"
FC1_WEIGHT = "mlp.linear_fc1.weight"
FC1_BIAS = "mlp.linear_fc1.bias"
FC2_WEIGHT = "mlp.linear_fc2.weight"
FC2_BIAS = "mlp.linear_fc2.bias"
# The learnable gains on the branch outputs (LayerScale's [h] per channel, SkipInit's [1]
# scalar), by layer variant and branch (config/layer_variants.py registers them): the
# variant multiplies the branch output with them before the residual add.
BRANCH_GAINS = {
    name: info.branch_gains for name, info in LAYER_VARIANTS.items() if info.branch_gains
}
# A mixture-of-experts layer (megatron's MoELayer). Its pre-MLP norm is a module of its
# own (no linear_fc1 to fuse it into); the experts of a layer are stacked on an expert
# axis, [E, 2f, h] and [E, h, f], by SequentialMLP and TEGroupedMLP alike; the shared
# expert's optional sigmoid gate is a [1, h] weight.
MOE_NORM_WEIGHT = "pre_mlp_layernorm.weight"
MOE_NORM_BIAS = "pre_mlp_layernorm.bias"
ROUTER_WEIGHT = "mlp.router.weight"
EXPERTS_FC1_WEIGHT = "mlp.experts.experts.linear_fc1.weight"
EXPERTS_FC2_WEIGHT = "mlp.experts.experts.linear_fc2.weight"
SHARED_FC1_WEIGHT = "mlp.shared_experts.linear_fc1.weight"
SHARED_FC2_WEIGHT = "mlp.shared_experts.linear_fc2.weight"
SHARED_GATE_WEIGHT = "mlp.shared_experts.gate_weight"

# Hugging Face names (every registered architecture has the Llama layout).
HF_EMBEDDING = "model.embed_tokens.weight"
HF_LM_HEAD = "lm_head.weight"
HF_FINAL_NORM = "model.norm."
# Buffers some older checkpoints carry; derived from the config, never weights.
HF_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def layer_prefix(index: int) -> str:
    """The checkpoint prefix of layer ``index`` (0-based, global) where megatron saves
    each layer under its own keys: a model whose layers differ (dense and MoE)."""
    return f"{LAYERS}{index}."


def effective_norm_weight(weight: Tensor, scale: float, zero_centered: bool) -> Tensor:
    """The plain-form gamma a norm multiplies with: LNS folded in, zero-centring removed.

    The same expression as ``LocalNorm.effective_gamma``, so the result is bitwise the
    weight the megatron forward pass uses.
    """
    gamma = fold_scale_into_gamma(weight, scale, zero_centered)
    return gamma + 1.0 if zero_centered else gamma


def invert_exactly(
    target: Tensor, forward: Callable[[Tensor], Tensor], guess: Tensor, max_ulps: int = 4
) -> tuple[Tensor, int]:
    """A ``source`` with ``forward(source) == target`` bitwise, elementwise, near ``guess``.

    Dividing by the factor and multiplying again need not give back the same float, so
    the quotient is corrected by up to ``max_ulps`` ulps in either direction. Every
    tensor that ``forward`` produced has an exact preimage, so an export re-imported
    exports bitwise identically. Returns the source and the number of elements with no
    exact preimage (there the closest one is taken).
    """
    best = guess.clone()
    best_error = (forward(best).double() - target.double()).abs()
    for direction in (float("inf"), float("-inf")):
        candidate = guess
        for _ in range(max_ulps):
            if not bool((best_error > 0).any()):
                return best, 0
            candidate = torch.nextafter(candidate, torch.full_like(candidate, direction))
            error = (forward(candidate).double() - target.double()).abs()
            better = error < best_error
            best = torch.where(better, candidate, best)
            best_error = torch.where(better, error, best_error)
    return best, int((best_error > 0).sum())


# The config.json fields transformers builds the RoPE settings from (5.x folds the 4.x
# fields into rope_parameters): hf_rope_parameters reads them all, under one name or
# the other.
HF_ROPE_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor")


def hf_rope_parameters(config) -> dict:
    """RoPE settings of a ``transformers`` config, from 4.x (``rope_theta``,
    ``rope_scaling``, ``partial_rotary_factor``) or 5.x (``rope_parameters``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in rope:
        scaling = getattr(config, "rope_scaling", None) or {}
        rope = {
            "rope_theta": config.rope_theta,
            "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
            "partial_rotary_factor": getattr(config, "partial_rotary_factor", 1.0),
        }
    return rope
