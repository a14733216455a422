"""DeepNorm (Wang et al., 2022, DeepNet): Post-LN with the residual scaled up and the
branch init scaled down, ``h = LN(alpha h + f(h))`` with ``alpha = (2N)^(1/4)`` and the
value, output and both FFN projections initialised times ``beta = (8N)^(-1/4)`` (queries
and keys keep gain 1), for a decoder-only model of N layers."""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLP

from megatron_lns.model.variants.residual import normalise_after_add
from megatron_lns.model.variants.settings import VariantSettings


def deepnorm_alpha(num_layers: int) -> float:
    """DeepNet's residual scale for a decoder-only model of N layers: ``(2N)^(1/4)``."""
    return (2.0 * num_layers) ** 0.25


def deepnorm_beta(num_layers: int) -> float:
    """DeepNet's init gain for a decoder-only model of N layers: ``(8N)^(-1/4)``."""
    return (8.0 * num_layers) ** -0.25


def build(layer: torch.nn.Module, settings: VariantSettings) -> None:
    num_layers = layer.config.num_layers
    normalise_after_add(layer, deepnorm_alpha(num_layers))
    scale_branch_init(layer, deepnorm_beta(num_layers))


@torch.no_grad()
def scale_branch_init(layer: torch.nn.Module, beta: float) -> None:
    """DeepNet: multiply the init of the value, output and both FFN projections by beta
    (queries and keys keep gain 1). Per local shard, so it is exact at any TP or EP size."""
    attention = layer.self_attention
    qkv = attention.linear_qkv.weight
    groups = attention.num_query_groups_per_partition
    per_group = attention.num_attention_heads_per_partition // groups
    rows = qkv.view(groups, per_group + 2, attention.hidden_size_per_attention_head, -1)
    rows[:, -1].mul_(beta)  # v: last head-slot of each query group ([q... | k | v])
    attention.linear_proj.weight.mul_(beta)
    for ffn in feed_forward_networks(layer.mlp):
        ffn.linear_fc1.weight.mul_(beta)
        ffn.linear_fc2.weight.mul_(beta)


def feed_forward_networks(mlp: torch.nn.Module) -> list[MLP]:
    """The FFNs of a layer's MLP slot that DeepNet's beta scales: the dense MLP itself, or an
    MoE layer's experts (this rank's) and its shared expert.

    An MoE router, like the shared expert's sigmoid gate, keeps gain 1: it sets how the
    branch mixes its FFNs, as queries and keys set how attention mixes its values, and
    DeepNet leaves those at gain 1. Experts that are not megatron ``MLP`` modules (TE's
    grouped GEMM) are refused rather than left unscaled.
    """
    ffns = [module for module in mlp.modules() if isinstance(module, MLP)]
    if not ffns:
        raise ValueError(
            f"layer_variant='deepnorm' scales the feed-forward init, and {type(mlp).__name__} "
            "has no megatron MLP experts (grouped GEMM); use moe_grouped_gemm=false"
        )
    return ffns
