"""The LNS paper's baselines as megatron-core layers: Post-LN, DeepNorm, Mix-LN, LayerScale,
SkipInit, and depth-scaled init, selected by one key (``layer_variant``).

Every variant differs from Pre-LN only in the residual connection of its two sub-blocks,
``out = residual + dropout(branch + bias)`` in megatron's bias-dropout-add (``bda``) slot.
:class:`ResidualBranch` takes that slot and computes::

    out = norm(alpha * residual + gain * dropout(branch + bias))

with ``norm`` present only in post-norm layers (whose pre-norms become identities), ``alpha``
the DeepNorm residual scale (1 otherwise) and ``gain`` a learnable per-channel vector
(LayerScale) or scalar (SkipInit). megatron's forward runs untouched around it; attention, MLP
and their parameter names are megatron's. Definitions and sources: ``docs/variants.md``.

New parameter names (all replicated across tensor parallelism, checkpointed per layer through
megatron's default sharded state dict, like a norm's):
``self_attn_bda.norm.weight`` / ``mlp_bda.norm.weight`` (post-norm layers, the norm moved from
``input_layernorm`` / ``pre_mlp_layernorm``), ``*_bda.layerscale``, ``*_bda.gate``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank, init_method_normal
from torch import Tensor

from megatron_lns.config.choices import (
    LAYER_VARIANTS,
    PRE_NORM_VARIANTS,
    LayerVariant,
    lns_combines_with,
)
from megatron_lns.config.layer_variants import REGISTRY
from megatron_lns.model.layer import LNSTransformerLayer
from megatron_lns.model.scaling import NormScaling, ScaledNorm
from megatron_lns.model.variants.gpas import add_gpas
from megatron_lns.model.variants.peri_ln import add_output_norms


@dataclass(frozen=True)
class VariantSettings:
    """What a layer needs to know about its variant (built from the model config)."""

    layer_variant: LayerVariant = "pre_ln"
    mix_ln_post_fraction: float = 0.25
    layerscale_init: float = 1e-3
    depth_scaled_init: bool = False

    def check(self, norm_scaling: NormScaling) -> None:
        """Refuse unknown variants and combinations that have no meaning, by name."""
        if self.layer_variant not in LAYER_VARIANTS:
            raise ValueError(
                f"layer_variant must be one of {LAYER_VARIANTS}, got {self.layer_variant!r}"
            )
        if not lns_combines_with(norm_scaling, self.layer_variant):
            raise ValueError(
                f"norm_scaling='lns' scales pre-norm outputs, and layer_variant="
                f"{self.layer_variant!r} {REGISTRY[self.layer_variant].lns_refusal}; use "
                f"norm_scaling='none' or one of {PRE_NORM_VARIANTS}"
            )
        if not 0.0 <= self.mix_ln_post_fraction <= 1.0:
            raise ValueError(
                f"mix_ln_post_fraction must be in [0, 1], got {self.mix_ln_post_fraction!r}"
            )
        if not self.layerscale_init > 0.0:
            raise ValueError(f"layerscale_init must be > 0, got {self.layerscale_init!r}")

    @property
    def needs_variant_layer(self) -> bool:
        """False for plain Pre-LN (with or without LNS): megatron's residual add is kept."""
        return self.layer_variant != "pre_ln" or self.depth_scaled_init


PLAIN_PRE_LN = VariantSettings()


def deepnorm_alpha(num_layers: int) -> float:
    """DeepNet's residual scale for a decoder-only model of N layers: ``(2N)^(1/4)``."""
    return (2.0 * num_layers) ** 0.25


def deepnorm_beta(num_layers: int) -> float:
    """DeepNet's init gain for a decoder-only model of N layers: ``(8N)^(-1/4)``."""
    return (8.0 * num_layers) ** -0.25


def num_post_norm_layers(num_layers: int, post_fraction: float) -> int:
    """Mix-LN: the first ``floor(fraction * N)`` layers are Post-LN."""
    return math.floor(post_fraction * num_layers)


def is_post_norm_layer(settings: VariantSettings, layer_number: int, num_layers: int) -> bool:
    """Whether global layer ``layer_number`` (1-based) normalises after its residual adds."""
    if settings.layer_variant in ("post_ln", "deepnorm"):
        return True
    if settings.layer_variant == "mix_ln":
        return layer_number <= num_post_norm_layers(num_layers, settings.mix_ln_post_fraction)
    return False


def depth_scaled_std(std: float, layer_number: int) -> float:
    """Depth-scaled init of layer ``l``'s output projections: ``std / sqrt(2 l)``."""
    return std / math.sqrt(2.0 * layer_number)


class ResidualBranch(torch.nn.Module):
    """megatron's bias-dropout-add with a residual scale, a learnable branch gain and a
    post-norm, each optional: ``norm(alpha * residual + gain * dropout(branch + bias))``.

    Called the way megatron calls its ``bda`` functions: ``module(training, fused)`` returns
    the function ``(branch_with_bias, residual, dropout_prob) -> output``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        residual_scale: float = 1.0,
        gain: Literal["layerscale", "skipinit"] | None = None,
        layerscale_init: float = 1e-3,
        norm: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.residual_scale = residual_scale
        self.norm = norm
        self.layerscale: torch.nn.Parameter | None = None
        self.gate: torch.nn.Parameter | None = None
        if gain == "layerscale":
            self.layerscale = torch.nn.Parameter(
                torch.full((config.hidden_size,), layerscale_init, dtype=config.params_dtype)
            )
        elif gain == "skipinit":
            self.gate = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        for param in (self.layerscale, self.gate):
            if param is not None:
                # Under sequence parallelism each TP rank sees its own tokens: megatron
                # all-reduces the gradients of parameters marked so.
                param.sequence_parallel = config.sequence_parallel

    def forward(self, training: bool, fused: bool = False):
        return partial(self._add, training)

    def _add(
        self,
        training: bool,
        branch_with_bias: tuple[Tensor, Tensor | None],
        residual: Tensor,
        prob: float,
    ) -> Tensor:
        branch, bias = branch_with_bias
        if bias is not None:
            branch = branch + bias
        branch = F.dropout(branch, p=prob, training=training)
        if self.layerscale is not None:
            branch = branch * self.layerscale.to(branch.dtype)
        elif self.gate is not None:
            branch = branch * self.gate.to(branch.dtype)
        if self.residual_scale != 1.0:
            residual = residual * self.residual_scale
        out = residual + branch
        return self.norm(out) if self.norm is not None else out

    def extra_repr(self) -> str:
        return f"residual_scale={self.residual_scale:.6g}"


class VariantTransformerLayer(LNSTransformerLayer):
    """megatron's TransformerLayer with one of the paper's residual/normalisation variants.

    The layer's global number (megatron's ``layer_number``) decides Mix-LN's post/pre split
    and the depth-scaled init, so both are right under pipeline and virtual pipeline
    parallelism.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        norm_scaling: NormScaling = "none",
        variant: VariantSettings = VariantSettings(),
        **kwargs: Any,
    ) -> None:
        variant.check(norm_scaling)
        self.variant = variant
        expected_number = None
        if variant.depth_scaled_init:
            config, expected_number = _with_depth_scaled_output_init(config, layer_number, kwargs)
        if config.inference_fuse_tp_communication:
            raise ValueError(
                f"layer_variant={variant.layer_variant!r}: megatron's fused inference path "
                "(inference_fuse_tp_communication) adds the residual inside its kernels and "
                "would skip the variant's residual; build the model without it"
            )
        super().__init__(config, submodules, layer_number, hidden_dropout, norm_scaling, **kwargs)
        if expected_number is not None and expected_number != self.layer_number:
            raise RuntimeError(
                f"depth-scaled init assumed global layer {expected_number}, megatron numbered "
                f"it {self.layer_number}"
            )
        num_layers = self.config.num_layers
        self.post_norm = is_post_norm_layer(variant, self.layer_number, num_layers)
        deepnorm = variant.layer_variant == "deepnorm"
        alpha = deepnorm_alpha(num_layers) if deepnorm else 1.0
        learnable = variant.layer_variant in ("layerscale", "skipinit")
        gain = variant.layer_variant if learnable else None
        attn_norm = mlp_norm = None
        if self.post_norm:
            attn_norm, mlp_norm = self.input_layernorm, self.pre_mlp_layernorm
            if isinstance(attn_norm, IdentityOp) or isinstance(mlp_norm, IdentityOp):
                raise ValueError(
                    f"layer_variant={variant.layer_variant!r} needs separate norm modules "
                    "(the local backend); fused norm + linear cannot move after the residual"
                )
            self.input_layernorm = IdentityOp()
            self.pre_mlp_layernorm = IdentityOp()
        self.self_attn_bda = ResidualBranch(
            self.config, alpha, gain, variant.layerscale_init, attn_norm
        )
        self.mlp_bda = ResidualBranch(self.config, alpha, gain, variant.layerscale_init, mlp_norm)
        if deepnorm:
            self._scale_deepnorm_init(deepnorm_beta(num_layers))
        if variant.layer_variant == "peri_ln":
            add_output_norms(self)
        elif variant.layer_variant == "gpas":
            add_gpas(self)

    def pre_norm_owners(self) -> list[ScaledNorm]:
        """Post-norm layers have no pre-norm for LNS to scale."""
        if getattr(self, "post_norm", False):
            return []
        return super().pre_norm_owners()

    @torch.no_grad()
    def _scale_deepnorm_init(self, beta: float) -> None:
        """DeepNet: multiply the init of the value, output and both FFN projections by beta
        (queries and keys keep gain 1). Per local shard, so it is exact at any TP or EP size."""
        attention = self.self_attention
        qkv = attention.linear_qkv.weight
        groups = attention.num_query_groups_per_partition
        per_group = attention.num_attention_heads_per_partition // groups
        rows = qkv.view(groups, per_group + 2, attention.hidden_size_per_attention_head, -1)
        rows[:, -1].mul_(beta)  # v: last head-slot of each query group ([q... | k | v])
        attention.linear_proj.weight.mul_(beta)
        for ffn in feed_forward_networks(self.mlp):
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


def _with_depth_scaled_output_init(
    config: TransformerConfig, layer_number: int, kwargs: dict
) -> tuple[TransformerConfig, int]:
    """A per-layer copy of ``config`` whose output projections start at std/sqrt(2 l), and l.

    The global ``l`` is computed with megatron's own offset function, with the arguments
    megatron's TransformerLayer will use; the layer checks the two agree after construction.
    """
    pg_collection = kwargs.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()
    offset = get_transformer_layer_offset(
        config, kwargs.get("vp_stage"), get_pg_rank(pg_collection.pp)
    )
    layer_config = copy.copy(config)
    global_number = layer_number + offset
    std = depth_scaled_std(config.init_method_std, global_number)
    layer_config.output_layer_init_method = init_method_normal(std)
    return layer_config, global_number
