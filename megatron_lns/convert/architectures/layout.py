"""The tensors of a decoder layer in the Llama layout, both ways, LNS folded in and out.

The checkpoint side holds megatron's keys (``self_attention.linear_qkv.weight``, ...),
stacked on a layer axis for a homogeneous GPT model and one layer at a time for an MoE
or hybrid one; the Hugging Face side the Llama layout every registered architecture
has (``model.layers.i.self_attn.q_proj``, ...). Between them: the fused QKV and gate/up
splits, the LNS factor ``1/sqrt(l)`` folded into both pre-norms of block ``l`` with the
rules of :mod:`megatron_lns.model.scaling` (exactly as the megatron forward pass folds
it, so the exported weights are the ones megatron multiplies with, and inverted
exactly on import), and a LayerScale or SkipInit run's branch gains folded into the
last linear of each branch (:meth:`DecoderLayout.fold_branch_gains`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megatron_lns.config.hybrid_pattern import gpt_key_to_hybrid
from megatron_lns.config.layer_variants import REGISTRY as LAYER_VARIANTS
from megatron_lns.convert.checkpoint_reader import CheckpointReader
from megatron_lns.convert.mapping import (
    ATTN_NORM_BIAS,
    ATTN_NORM_WEIGHT,
    BRANCH_GAINS,
    FC1_BIAS,
    FC1_WEIGHT,
    FC2_BIAS,
    FC2_WEIGHT,
    HF_FINAL_NORM,
    LAYERS,
    MLP_NORM_BIAS,
    MLP_NORM_WEIGHT,
    PROJ_BIAS,
    PROJ_WEIGHT,
    QKV_BIAS,
    QKV_WEIGHT,
    effective_norm_weight,
    hf_layer_prefix,
    invert_exactly,
    layer_prefix,
)
from megatron_lns.model.scaling import fold_scale_into_beta, norm_output_scale


@dataclass(frozen=True)
class DecoderLayout:
    """The shape of a decoder and the mapping of its per-layer tensors.

    :class:`~.base.Architecture` adds what each Hugging Face class says; an architecture
    whose MLP differs (:class:`~.moe.MoEArchitecture`) overrides the ``mlp_*`` parts.
    """

    norm: ClassVar[str]  # "rmsnorm" (a weight) or "layernorm" (a weight and a bias)
    # Whether its layers are mixture-of-experts layers (a model with model.num_moe_experts
    # exports only to one that is, a dense model only to one that is not).
    moe: ClassVar[bool] = False

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int  # channels per attention head (model.kv_channels, Llama's head_dim)
    norm_affine: bool
    zero_centered_gamma: bool
    bias: bool
    # The norm scaling rule (config/norm_scalings.py) whose factors the Hugging Face pre-norm
    # weights carry: export folds them in, import divides them out.
    norm_scaling: str
    tied_embeddings: bool
    eps: float
    rotary_base: float
    max_position_embeddings: int
    # The run is megatron-core's HybridModel with the GPT-equivalent pattern: the same
    # tensors, each attention and MLP under its own sublayer's keys (checkpoint_key).
    hybrid: bool = False
    # The run's branch gains ("layerscale" or "skipinit", keys of BRANCH_GAINS), which
    # export folds away; None for Pre-LN and for every imported model.
    branch_gain: str | None = None

    @property
    def rmsnorm(self) -> bool:
        return self.norm == "rmsnorm"

    @property
    def norm_has_bias(self) -> bool:
        """Whether the checkpoint's norms have a bias (an affine LayerNorm)."""
        return not self.rmsnorm and self.norm_affine

    def norm_scale(self, layer_number: int) -> float:
        """The norm scaling factor of block ``layer_number`` (1-based): LNS's ``1/sqrt(l)``,
        or 1 for Pre-LN."""
        return norm_output_scale(self.norm_scaling, layer_number)

    # ------------------------------------------------------------------ tensors
    # The checkpoint side of one layer, by its GPT model keys: megatron stacks the layers
    # of a homogeneous GPT model on a leading axis (``decoder.layers.<name>``), and saves
    # those of an MoE or hybrid model one by one (``stacked_layers``, ``checkpoint_key``).
    def norm_keys(self, index: int) -> tuple[tuple[str, str, str], ...]:
        """(checkpoint weight key, bias key, Hugging Face norm name) of the two pre-norms
        of layer ``index``, attention first."""
        return (
            (ATTN_NORM_WEIGHT, ATTN_NORM_BIAS, "input_layernorm."),
            (MLP_NORM_WEIGHT, MLP_NORM_BIAS, "post_attention_layernorm."),
        )

    def layer_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """Checkpoint key (relative to the layer) -> shape of each tensor of layer ``index``."""
        h, hd = self.hidden_size, self.head_dim
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * hd
        shapes: dict[str, tuple[int, ...]] = {
            QKV_WEIGHT: (qkv, h),
            PROJ_WEIGHT: (h, self.num_attention_heads * hd),
        }
        if self.bias:
            shapes |= {QKV_BIAS: (qkv,), PROJ_BIAS: (h,)}
        shapes |= self.mlp_shapes(index)
        for weight_key, bias_key, _ in self.norm_keys(index):
            if self.norm_affine:
                shapes[weight_key] = (h,)
            if self.norm_has_bias:
                shapes[bias_key] = (h,)
        if self.branch_gain is not None:
            width = h if LAYER_VARIANTS[self.branch_gain].per_channel_gain else 1
            shapes |= {key: (width,) for key in BRANCH_GAINS[self.branch_gain]}
        return shapes

    def mlp_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """The MLP's part of :meth:`layer_shapes` (without its norm): a dense SwiGLU MLP."""
        h, ffn = self.hidden_size, self.ffn_hidden_size
        shapes: dict[str, tuple[int, ...]] = {FC1_WEIGHT: (2 * ffn, h), FC2_WEIGHT: (h, ffn)}
        if self.bias:
            shapes |= {FC1_BIAS: (2 * ffn,), FC2_BIAS: (h,)}
        return shapes

    @property
    def stacked_layers(self) -> bool:
        """Whether the checkpoint stacks the layers on a leading axis: megatron's GPT model
        does when its layers are alike; an MoE GPT model saves each layer under its own
        keys (``decoder.layers.N.<name>``), a hybrid model each sublayer."""
        return not (self.moe or self.hybrid)

    def checkpoint_key(self, key: str) -> str:
        """Where the run's checkpoint and model hold what the GPT model calls ``key``:
        ``key`` itself, or in a hybrid run its sublayer's key
        (:func:`~megatron_lns.config.hybrid_pattern.gpt_key_to_hybrid`: layer ``i``'s attention is
        sublayer ``2i``, its MLP ``2i+1``, the final norm ``decoder.final_norm``)."""
        return gpt_key_to_hybrid(key) if self.hybrid else key

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every per-layer tensor of the checkpoint: full key -> global shape."""
        if self.stacked_layers:
            layers = self.num_layers
            return {LAYERS + key: (layers, *shape) for key, shape in self.layer_shapes(0).items()}
        return {
            self.checkpoint_key(layer_prefix(index) + key): shape
            for index in range(self.num_layers)
            for key, shape in self.layer_shapes(index).items()
        }

    def read_layer(self, reader: CheckpointReader, index: int) -> dict[str, Tensor]:
        """Layer ``index``'s tensors from the checkpoint, by key relative to the layer."""
        if self.stacked_layers:
            stacked = reader.read_layer([LAYERS + key for key in self.layer_shapes(index)], index)
            return {key.removeprefix(LAYERS): tensor for key, tensor in stacked.items()}
        relative = {
            self.checkpoint_key(layer_prefix(index) + key): (key, shape)
            for key, shape in self.layer_shapes(index).items()
        }
        requests = {full: ((0,) * len(shape), shape) for full, (_, shape) in relative.items()}
        return {relative[full][0]: tensor for full, tensor in reader.read(requests).items()}

    def branch_outputs(self, index: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The tensors of layer ``index`` that make its attention branch's output and its
        MLP branch's output, each with the output channels on its second-to-last axis
        (a weight) or last axis (a bias): what a branch gain multiplies."""
        attention = (PROJ_WEIGHT, PROJ_BIAS) if self.bias else (PROJ_WEIGHT,)
        return attention, self.mlp_outputs(index)

    def mlp_outputs(self, index: int) -> tuple[str, ...]:
        """The MLP's part of :meth:`branch_outputs`: ``linear_fc2`` (and its bias)."""
        return (FC2_WEIGHT, FC2_BIAS) if self.bias else (FC2_WEIGHT,)

    def fold_branch_gains(self, tensors: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """Layer ``index``'s tensors with its branch gains folded into the branch outputs.

        ``ResidualBranch`` computes ``h + g * (W x + b)`` (``g`` per channel, or a scalar;
        dropout is off at inference), which is ``h + (diag(g) W) x + g * b``: row ``i`` of
        ``linear_proj`` / ``linear_fc2`` (of every expert and the shared expert in an MoE
        layer) and bias element ``i`` are multiplied by ``g_i``, the attention branch's
        gain for the one and the MLP branch's for the other. Each product is taken in
        float32, where the product of two fp32/bf16/fp16 numbers rounds once (bf16 and
        fp16 products are exact), then rounded to the checkpoint's dtype. The gain
        tensors themselves are dropped.
        """
        if self.branch_gain is None:
            return tensors
        tensors = dict(tensors)
        gains = [tensors.pop(key) for key in BRANCH_GAINS[self.branch_gain]]
        for gain, outputs in zip(gains, self.branch_outputs(index), strict=True):
            compute = torch.promote_types(gain.dtype, torch.float32)
            for key in outputs:
                tensor = tensors[key]
                per_row = gain.to(compute) if tensor.dim() == 1 else gain.to(compute)[:, None]
                tensors[key] = (tensor.to(compute) * per_row).to(tensor.dtype)
        return tensors

    def layer_to_hf(self, tensors: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """One megatron layer (0-based ``index``) as Hugging Face tensors, LNS and the
        branch gains folded in."""
        tensors = self.fold_branch_gains(tensors, index)
        prefix = hf_layer_prefix(index)
        scale = self.norm_scale(index + 1)
        out: dict[str, Tensor] = {}
        dtype = tensors[QKV_WEIGHT].dtype
        for weight_key, bias_key, hf_norm in self.norm_keys(index):
            if self.norm_affine:
                weight = effective_norm_weight(tensors[weight_key], scale, self.zero_centered_gamma)
            else:
                # A parameter-free norm with LNS multiplies by the constant s (LocalNorm).
                weight = torch.full((self.hidden_size,), scale, dtype=dtype)
            out[prefix + hf_norm + "weight"] = weight
            if not self.rmsnorm:
                bias = (
                    fold_scale_into_beta(tensors[bias_key], scale)
                    if self.norm_affine
                    else torch.zeros(self.hidden_size, dtype=dtype)
                )
                out[prefix + hf_norm + "bias"] = bias
        attn = prefix + "self_attn."
        q, k, v = self.split_qkv(tensors[QKV_WEIGHT])
        out |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v}
        out[attn + "o_proj.weight"] = tensors[PROJ_WEIGHT]
        if self.bias:
            q, k, v = self.split_qkv(tensors[QKV_BIAS])
            out |= {attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v}
            out[attn + "o_proj.bias"] = tensors[PROJ_BIAS]
        out |= self.mlp_to_hf(tensors, index)
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def mlp_to_hf(self, tensors: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """The MLP's part of :meth:`layer_to_hf`: ``linear_fc1`` rows ``[:f]`` are the
        gate, ``[f:]`` the up projection."""
        mlp = hf_layer_prefix(index) + "mlp."
        out: dict[str, Tensor] = {}
        for suffix, fc1_key, fc2_key in (
            ("weight", FC1_WEIGHT, FC2_WEIGHT),
            ("bias", FC1_BIAS, FC2_BIAS),
        ):
            if suffix == "bias" and not self.bias:
                continue
            gate, up = tensors[fc1_key].chunk(2, dim=0)
            out |= {f"{mlp}gate_proj.{suffix}": gate, f"{mlp}up_proj.{suffix}": up}
            out[f"{mlp}down_proj.{suffix}"] = tensors[fc2_key]
        return out

    def hf_layer_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape of every tensor of layer ``index``."""
        prefix = hf_layer_prefix(index)
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_query_groups * hd
        shapes = {}
        for _, _, norm in self.norm_keys(index):
            shapes[prefix + norm + "weight"] = (h,)
            if not self.rmsnorm:
                shapes[prefix + norm + "bias"] = (h,)
        outputs = {
            "self_attn.q_proj.": (q, h),
            "self_attn.k_proj.": (kv, h),
            "self_attn.v_proj.": (kv, h),
            "self_attn.o_proj.": (h, q),
        }
        for name, (rows, cols) in outputs.items():
            shapes[prefix + name + "weight"] = (rows, cols)
            if self.bias:
                shapes[prefix + name + "bias"] = (rows,)
        return shapes | self.hf_mlp_shapes(index)

    def hf_mlp_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """The MLP's part of :meth:`hf_layer_shapes`."""
        mlp = hf_layer_prefix(index) + "mlp."
        h, ffn = self.hidden_size, self.ffn_hidden_size
        shapes = {}
        for name, (rows, cols) in {
            "gate_proj.": (ffn, h),
            "up_proj.": (ffn, h),
            "down_proj.": (h, ffn),
        }.items():
            shapes[mlp + name + "weight"] = (rows, cols)
            if self.bias:
                shapes[mlp + name + "bias"] = (rows,)
        return shapes

    def layer_from_hf(self, hf: dict[str, Tensor], index: int) -> tuple[dict[str, Tensor], int]:
        """One layer's Hugging Face tensors as megatron tensors, by name relative to the
        layer (the checkpoint names of :meth:`layer_shapes`, except where
        :meth:`mlp_from_hf` says otherwise), with the norm scaling factor (LNS's) divided
        out exactly. Also returns the number of norm elements that had no exact preimage (see
        :func:`invert_exactly`)."""
        prefix = hf_layer_prefix(index)
        scale = self.norm_scale(index + 1)
        out: dict[str, Tensor] = {}
        inexact = 0
        for weight_key, bias_key, hf_norm in self.norm_keys(index):
            weight = hf[prefix + hf_norm + "weight"]
            guess = (weight.double() / scale - float(self.zero_centered_gamma)).to(weight.dtype)
            out[weight_key], missed = invert_exactly(
                weight,
                lambda g: effective_norm_weight(g, scale, self.zero_centered_gamma),
                guess,
            )
            inexact += missed
            if not self.rmsnorm:
                bias = hf[prefix + hf_norm + "bias"]
                out[bias_key], missed = invert_exactly(
                    bias,
                    lambda b: fold_scale_into_beta(b, scale),
                    (bias.double() / scale).to(bias.dtype),
                )
                inexact += missed
        attn = prefix + "self_attn."
        for suffix, qkv_key, proj_key in (
            ("weight", QKV_WEIGHT, PROJ_WEIGHT),
            ("bias", QKV_BIAS, PROJ_BIAS),
        ):
            if suffix == "bias" and not self.bias:
                continue
            out[qkv_key] = self.merge_qkv(
                hf[f"{attn}q_proj.{suffix}"],
                hf[f"{attn}k_proj.{suffix}"],
                hf[f"{attn}v_proj.{suffix}"],
            )
            out[proj_key] = hf[f"{attn}o_proj.{suffix}"]
        return out | self.mlp_from_hf(hf, index), inexact

    def mlp_from_hf(self, hf: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """The MLP's part of :meth:`layer_from_hf`."""
        mlp = hf_layer_prefix(index) + "mlp."
        out = {}
        for suffix, fc1_key, fc2_key in (
            ("weight", FC1_WEIGHT, FC2_WEIGHT),
            ("bias", FC1_BIAS, FC2_BIAS),
        ):
            if suffix == "bias" and not self.bias:
                continue
            out[fc1_key] = torch.cat([hf[f"{mlp}gate_proj.{suffix}"], hf[f"{mlp}up_proj.{suffix}"]])
            out[fc2_key] = hf[f"{mlp}down_proj.{suffix}"]
        return out

    def final_norm_to_hf(self, weight: Tensor | None, bias: Tensor | None, dtype) -> dict:
        """The final norm (never scaled by LNS) in plain form."""
        h = self.hidden_size
        out = {
            HF_FINAL_NORM + "weight": (
                effective_norm_weight(weight, 1.0, self.zero_centered_gamma)
                if weight is not None
                else torch.ones(h, dtype=dtype)
            )
        }
        if not self.rmsnorm:
            out[HF_FINAL_NORM + "bias"] = bias if bias is not None else torch.zeros(h, dtype=dtype)
        return out

    # The fused QKV projection holds, for each query group in turn, the group's query
    # heads, then its key head, then its value head (``head_dim`` rows each).
    def split_qkv(self, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        groups, hd = self.num_query_groups, self.head_dim
        per_group = self.num_attention_heads // groups
        grouped = fused.reshape(groups, (per_group + 2) * hd, *fused.shape[1:])
        q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
        rest = fused.shape[1:]
        return (
            q.reshape(groups * per_group * hd, *rest),
            k.reshape(groups * hd, *rest),
            v.reshape(groups * hd, *rest),
        )

    def merge_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        groups, hd = self.num_query_groups, self.head_dim
        per_group = self.num_attention_heads // groups
        rest = q.shape[1:]
        grouped = torch.cat(
            [
                q.reshape(groups, per_group * hd, *rest),
                k.reshape(groups, hd, *rest),
                v.reshape(groups, hd, *rest),
            ],
            dim=1,
        )
        return grouped.reshape(-1, *rest)
