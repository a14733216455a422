"""What the stock mixture-of-experts architectures share: megatron's MoE layer, mapped.

A megatron-lns MoE layer (``model.num_moe_experts``) is megatron's ``MoELayer`` behind
the layer's scaled pre-MLP norm: a router ``[E, h]`` whose logits pick ``topk`` experts
per token, ``E`` SwiGLU experts, and optionally one shared expert, with or without a
sigmoid gate ``[1, h]``. The norm feeds router and experts alike, so the LNS factor
folds into the Hugging Face ``post_attention_layernorm`` exactly as for a dense layer.

Routing is the part to match exactly. megatron's softmax router (``moe_router_topk``,
``moe_router_score_function: softmax``):

* ``moe_router_pre_softmax: false`` (megatron's default): the top-k *logits*, then a
  softmax over those k: ``exp(z_i) / sum_{j in top-k} exp(z_j)``;
* ``moe_router_pre_softmax: true``: a softmax over all experts, then its top-k
  probabilities as they are.

Hugging Face's routers (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``) take the softmax
over all experts, its top-k, and divide by their sum (Mixtral always; Qwen2-MoE when
``norm_topk_prob``). ``p_i / sum_{top-k} p_j`` = ``exp(z_i) / sum_{top-k} exp(z_j)``, and
the softmax keeps the order of the logits, so: megatron without pre-softmax = Mixtral =
Qwen2-MoE with ``norm_topk_prob``; megatron with pre-softmax = Qwen2-MoE without it.
Every other router setting that changes the output is refused by name: the score
function, expert bias, top-k scaling and capacity factor by their declarations
(``hf=HF_REFUSE`` with its ``hf_refusal``, ``config/sections/moe.py``), which also make
them the defaults of an imported MoE model; Sinkhorn balancing and linear biases here.

Checkpoint side: megatron-lns always passes ``moe_layer_freq`` to megatron as a list, so
its MoE checkpoints hold each layer under its own keys (``decoder.layers.N.<name>``, not
stacked), with the experts of a layer stacked on an expert axis
(``mlp.experts.experts.linear_fc1.weight`` ``[E, 2f, h]``), the layout SequentialMLP and
TEGroupedMLP (grouped GEMM) share: a checkpoint of either reads the same, one layer at
a time. Import fills the local backend's SequentialMLP, whose parameters are per expert
(``mlp.experts.local_experts.e.linear_fc1.weight``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megatron_lns.config import model_derived
from megatron_lns.config.moe_layers import MoELayerFreqError, moe_layer_pattern
from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.architectures.base import Architecture
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.hf_settings import refused_moe_defaults
from megatron_lns.convert.mapping import (
    ATTN_NORM_BIAS,
    ATTN_NORM_WEIGHT,
    EXPERTS_FC1_WEIGHT,
    EXPERTS_FC2_WEIGHT,
    MOE_NORM_BIAS,
    MOE_NORM_WEIGHT,
    ROUTER_WEIGHT,
    SHARED_FC1_WEIGHT,
    SHARED_FC2_WEIGHT,
    SHARED_GATE_WEIGHT,
    hf_layer_prefix,
)

# Load balancing that changes which experts a token meets, not only the loss.
ROUTING_BALANCERS = {"sinkhorn": "Sinkhorn routing"}

# The parameter names of megatron's SequentialMLP (local backend), which import fills.
LOCAL_EXPERT_FC1 = "mlp.experts.local_experts.{}.linear_fc1.weight"
LOCAL_EXPERT_FC2 = "mlp.experts.local_experts.{}.linear_fc2.weight"


def refuse_megatron_only_routing(m: ModelConfig, name: str) -> None:
    """Refuse what no stock Hugging Face MoE class computes and the declarations do not
    refuse on their own (a value of a setting whose other values export), naming it."""
    if m.bias:
        raise ConversionError(
            f"model.bias=true cannot be exported with model.num_moe_experts: {name} has no "
            "biases in its attention output, router or experts"
        )
    balancing = m.moe_router_load_balancing_type
    if balancing in ROUTING_BALANCERS:
        raise ConversionError(
            f"model.moe_router_load_balancing_type={balancing} cannot be exported: "
            f"{ROUTING_BALANCERS[balancing]} changes which experts a token meets, and the "
            "stock MoE routers take a plain top-k"
        )


def model_moe_pattern(m: ModelConfig) -> tuple[int, ...]:
    """1 for each MoE layer of a ``model:`` section, 0 for each dense one."""
    try:
        return tuple(moe_layer_pattern(m.moe_layer_freq, m.num_layers))
    except MoELayerFreqError as err:
        raise ConversionError(f"model.moe_layer_freq: {err}") from err


@dataclass(frozen=True)
class MoEArchitecture(Architecture):
    """A stock Hugging Face MoE causal LM: the shared decoder with some (or all) MLPs
    replaced by a routed mixture of SwiGLU experts.

    Subclasses say the Hugging Face names (``hf_moe_block``, ``hf_expert_projections``,
    the shared expert's names) and which models they take (``exports_model``).
    """

    moe: ClassVar[bool] = True
    # The MoE block's name in a Hugging Face layer ("mlp." or "block_sparse_moe.").
    hf_moe_block: ClassVar[str]
    # Each expert's (gate, up, down) projection names under "experts.<e>.".
    hf_expert_projections: ClassVar[tuple[str, str, str]]
    # The config.json keys of the number of experts and of each expert's width.
    hf_num_experts_key: ClassVar[str]
    hf_expert_width_key: ClassVar[str]
    # The shared expert's MLP and its gate, under the MoE block (None: no shared expert).
    hf_shared_expert: ClassVar[str | None] = None
    hf_shared_expert_gate: ClassVar[str | None] = None
    # Whether every MoE block of the Hugging Face class has the shared expert (Qwen2-MoE):
    # a model without one then writes it zero wide (``shared_expert_intermediate_size``
    # 0), whose output is exactly zero whatever its sigmoid gate, written as zeros.
    hf_shared_expert_always: ClassVar[bool] = False

    num_experts: int = 0
    topk: int = 0
    expert_ffn_hidden_size: int = 0
    # 1 for each MoE layer, 0 for each dense one.
    moe_pattern: tuple[int, ...] = ()
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    # megatron's moe_router_pre_softmax=false: the top-k weights sum to one.
    topk_renormalized: bool = True
    # The load-balancing loss's weight the run trained with (0 when it had none):
    # config.json's router_aux_loss_coef.
    aux_loss_coeff: float = 0.0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model_config(cls, m: ModelConfig) -> MoEArchitecture:
        if not model_derived.has_experts(m):
            raise ConversionError(
                f"{cls.name} is a mixture-of-experts architecture and model.num_moe_experts "
                "is not set"
            )
        arch = super().from_model_config(m)
        shared = m.moe_shared_expert_intermediate_size or 0
        return dataclasses.replace(
            arch,
            num_experts=m.num_moe_experts,
            topk=m.moe_router_topk,
            expert_ffn_hidden_size=model_derived.expert_ffn_hidden_size(m),
            moe_pattern=model_moe_pattern(m),
            shared_expert_ffn_hidden_size=shared,
            shared_expert_gate=bool(shared and m.moe_shared_expert_gate),
            topk_renormalized=not m.moe_router_pre_softmax,
            aux_loss_coeff=(
                m.moe_aux_loss_coeff if m.moe_router_load_balancing_type != "none" else 0.0
            ),
        )

    @classmethod
    def from_hf_config(cls, config, lns: bool) -> MoEArchitecture:
        arch = super().from_hf_config(config, lns)
        moe = cls.moe_fields_from_hf(config)
        if not any(moe["moe_pattern"]):
            raise ConversionError(
                f"config.json: no layer has experts; megatron-lns imports a {cls.name} with "
                "at least one mixture-of-experts layer"
            )
        if not 1 <= moe["topk"] <= moe["num_experts"]:
            raise ConversionError(
                f"config.json: num_experts_per_tok={moe['topk']} is not between 1 and the "
                f"number of experts ({moe['num_experts']})"
            )
        if moe["topk"] == 1 and moe["topk_renormalized"]:
            raise ConversionError(
                f"config.json: num_experts_per_tok=1 with the top-k renormalised ({cls.name}"
                f"{', norm_topk_prob=true' if cls.hf_shared_expert else ''}) weighs the "
                "chosen expert by 1; megatron's top-1 router weighs it by its softmax "
                "probability (it requires moe_router_pre_softmax)"
            )
        moe["aux_loss_coeff"] = float(config.router_aux_loss_coef)
        return dataclasses.replace(arch, **moe)

    @classmethod
    def moe_fields_from_hf(cls, config) -> dict:
        """The MoE fields of this dataclass from a ``config.json`` of this class: the
        experts here, which layers have them and how they are routed in the subclass."""
        return dict(
            num_experts=getattr(config, cls.hf_num_experts_key),
            topk=config.num_experts_per_tok,
            expert_ffn_hidden_size=getattr(config, cls.hf_expert_width_key),
        )

    @classmethod
    def check_model_config(cls, m: ModelConfig, head_dim: int) -> None:
        refuse_megatron_only_routing(m, cls.name)

    def training_settings(self) -> dict:
        return super().training_settings() | {"moe_aux_loss_coeff": self.aux_loss_coeff}

    def hf_config_fields(self) -> dict:
        return {
            self.hf_num_experts_key: self.num_experts,
            "num_experts_per_tok": self.topk,
            self.hf_expert_width_key: self.expert_ffn_hidden_size,
        }

    def hf_config(self, vocab_size: int, dtype: torch.dtype, bos: int | None, eos: int):
        config = super().hf_config(vocab_size, dtype, bos, eos)
        config.router_aux_loss_coef = self.aux_loss_coeff
        return config

    def model_settings(self) -> dict:
        pattern = list(self.moe_pattern)
        return (
            super().model_settings()
            | {
                "num_moe_experts": self.num_experts,
                "moe_router_topk": self.topk,
                "moe_ffn_hidden_size": self.expert_ffn_hidden_size,
                "moe_layer_freq": 1 if all(pattern) else pattern,
                "moe_shared_expert_intermediate_size": self.shared_expert_ffn_hidden_size or None,
                "moe_shared_expert_gate": self.shared_expert_gate,
                "moe_router_pre_softmax": not self.topk_renormalized,
            }
            | refused_moe_defaults(ModelConfig)
        )

    # ------------------------------------------------------------------ checkpoint side
    def is_moe_layer(self, index: int) -> bool:
        return bool(self.moe_pattern[index])

    def norm_keys(self, index: int) -> tuple[tuple[str, str, str], ...]:
        if not self.is_moe_layer(index):
            return super().norm_keys(index)
        return (
            (ATTN_NORM_WEIGHT, ATTN_NORM_BIAS, "input_layernorm."),
            (MOE_NORM_WEIGHT, MOE_NORM_BIAS, "post_attention_layernorm."),
        )

    def mlp_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        if not self.is_moe_layer(index):
            return super().mlp_shapes(index)
        h, e, f = self.hidden_size, self.num_experts, self.expert_ffn_hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            ROUTER_WEIGHT: (e, h),
            EXPERTS_FC1_WEIGHT: (e, 2 * f, h),
            EXPERTS_FC2_WEIGHT: (e, h, f),
        }
        if self.shared_expert_ffn_hidden_size:
            s = self.shared_expert_ffn_hidden_size
            shapes |= {SHARED_FC1_WEIGHT: (2 * s, h), SHARED_FC2_WEIGHT: (h, s)}
            if self.shared_expert_gate:
                shapes[SHARED_GATE_WEIGHT] = (1, h)
        return shapes

    def mlp_outputs(self, index: int) -> tuple[str, ...]:
        """An MoE layer's output is its experts' ``linear_fc2`` outputs, weighted by the
        router, plus the shared expert's (times its sigmoid gate): a per-channel gain
        folds into each of them."""
        if not self.is_moe_layer(index):
            return super().mlp_outputs(index)
        shared = (SHARED_FC2_WEIGHT,) if self.shared_expert_ffn_hidden_size else ()
        return (EXPERTS_FC2_WEIGHT, *shared)

    # ------------------------------------------------------------------ Hugging Face side
    def hf_block(self, index: int) -> str:
        return hf_layer_prefix(index) + self.hf_moe_block

    def hf_expert_names(self, index: int, expert: int) -> tuple[str, str, str]:
        prefix = f"{self.hf_block(index)}experts.{expert}."
        return tuple(prefix + name + ".weight" for name in self.hf_expert_projections)

    def hf_shared_names(self, index: int) -> tuple[str, str, str, str]:
        """The shared expert's gate, up and down projections and its sigmoid gate."""
        shared = self.hf_block(index) + self.hf_shared_expert
        gate = self.hf_block(index) + self.hf_shared_expert_gate + ".weight"
        return (
            f"{shared}.gate_proj.weight",
            f"{shared}.up_proj.weight",
            f"{shared}.down_proj.weight",
            gate,
        )

    def hf_mlp_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        if not self.is_moe_layer(index):
            return super().hf_mlp_shapes(index)
        h, f = self.hidden_size, self.expert_ffn_hidden_size
        shapes = {self.hf_block(index) + "gate.weight": (self.num_experts, h)}
        for expert in range(self.num_experts):
            gate, up, down = self.hf_expert_names(index, expert)
            shapes |= {gate: (f, h), up: (f, h), down: (h, f)}
        if self.shared_expert_ffn_hidden_size or self.hf_shared_expert_always:
            s = self.shared_expert_ffn_hidden_size
            gate, up, down, sigmoid_gate = self.hf_shared_names(index)
            shapes |= {gate: (s, h), up: (s, h), down: (h, s), sigmoid_gate: (1, h)}
        return shapes

    def mlp_to_hf(self, tensors: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        if not self.is_moe_layer(index):
            return super().mlp_to_hf(tensors, index)
        out = {self.hf_block(index) + "gate.weight": tensors[ROUTER_WEIGHT]}
        fc1, fc2 = tensors[EXPERTS_FC1_WEIGHT], tensors[EXPERTS_FC2_WEIGHT]
        for expert in range(self.num_experts):
            gate, up, down = self.hf_expert_names(index, expert)
            out[gate], out[up] = fc1[expert].chunk(2, dim=0)
            out[down] = fc2[expert]
        if self.shared_expert_ffn_hidden_size:
            gate, up, down, sigmoid_gate = self.hf_shared_names(index)
            out[gate], out[up] = tensors[SHARED_FC1_WEIGHT].chunk(2, dim=0)
            out[down] = tensors[SHARED_FC2_WEIGHT]
            out[sigmoid_gate] = tensors[SHARED_GATE_WEIGHT]
        elif self.hf_shared_expert_always:
            h, dtype = self.hidden_size, tensors[ROUTER_WEIGHT].dtype
            gate, up, down, sigmoid_gate = self.hf_shared_names(index)
            out[gate] = out[up] = torch.zeros((0, h), dtype=dtype)
            out[down] = torch.zeros((h, 0), dtype=dtype)
            out[sigmoid_gate] = torch.zeros((1, h), dtype=dtype)
        return out

    def mlp_from_hf(self, hf: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """An MoE layer's router and shared expert by their checkpoint names, its experts
        by SequentialMLP's parameter names (one per expert)."""
        if not self.is_moe_layer(index):
            return super().mlp_from_hf(hf, index)
        out = {ROUTER_WEIGHT: hf[self.hf_block(index) + "gate.weight"]}
        for expert in range(self.num_experts):
            gate, up, down = self.hf_expert_names(index, expert)
            out[LOCAL_EXPERT_FC1.format(expert)] = torch.cat([hf[gate], hf[up]])
            out[LOCAL_EXPERT_FC2.format(expert)] = hf[down]
        if self.shared_expert_ffn_hidden_size:
            gate, up, down, sigmoid_gate = self.hf_shared_names(index)
            out[SHARED_FC1_WEIGHT] = torch.cat([hf[gate], hf[up]])
            out[SHARED_FC2_WEIGHT] = hf[down]
            out[SHARED_GATE_WEIGHT] = hf[sigmoid_gate]
        return out
