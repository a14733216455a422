"""``MixtralForCausalLM``: RMSNorm decoder with a routed MoE block in every layer.

Mixtral's router takes the softmax over all experts, its top-k, and divides them by
their sum: megatron's softmax router with ``moe_router_pre_softmax: false`` (its default;
see :mod:`.moe` for why the two are equal). It has no shared expert and no dense layers,
so a model with either, or with pre-softmax routing, is not a Mixtral: export takes it as
a Qwen2-MoE (:mod:`.qwen2_moe`), which has dense layers, both routings and a gated
shared expert that may be zero wide.
``head_dim`` carries ``model.kv_channels`` as for Llama; ``intermediate_size`` is the
experts' width. The weights are written in the per-expert layout ``save_pretrained``
writes (``block_sparse_moe.experts.e.w1/w2/w3``), which transformers 4 and 5 and vLLM read.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.architectures.moe import MoEArchitecture, model_moe_pattern
from megatron_lns.convert.errors import ConversionError


class Mixtral(MoEArchitecture):
    hf_class = "MixtralForCausalLM"
    name = "Mixtral"
    hf_config_class = "MixtralConfig"
    norm = "rmsnorm"
    hf_eps_key = "rms_norm_eps"
    hf_moe_block = "block_sparse_moe."
    hf_expert_projections: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")
    hf_num_experts_key = "num_local_experts"
    hf_expert_width_key = "intermediate_size"
    hf_inert_fields: ClassVar[dict[str, str]] = {
        "router_jitter_noise": (
            "noise on the router input in training mode only; the imported run trains "
            "without it (megatron-lns has none)"
        ),
    }

    @classmethod
    def from_model_config(cls, m: ModelConfig) -> Mixtral:
        # Every layer is MoE: model.ffn_hidden_size has no weights, and config.json has
        # one width (intermediate_size, the experts'), which import gives to both.
        arch = super().from_model_config(m)
        return dataclasses.replace(arch, ffn_hidden_size=arch.expert_ffn_hidden_size)

    @classmethod
    def exports_model(cls, m: ModelConfig) -> bool:
        return (
            not m.moe_shared_expert_intermediate_size
            and not m.moe_router_pre_softmax
            and all(model_moe_pattern(m))
        )

    @classmethod
    def check_model_config(cls, m: ModelConfig, head_dim: int) -> None:
        super().check_model_config(m, head_dim)
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            raise ConversionError(
                f"model.moe_shared_expert_intermediate_size={shared} cannot be exported as "
                "Mixtral, which has no shared expert"
            )
        if m.moe_router_pre_softmax:
            raise ConversionError(
                "model.moe_router_pre_softmax=true cannot be exported: Mixtral divides the "
                "top-k routing probabilities by their sum (megatron's "
                "moe_router_pre_softmax=false, which megatron allows for top-k > 1 only); "
                "export takes such a model as a Qwen2-MoE"
            )
        if not all(model_moe_pattern(m)):
            raise ConversionError(
                f"model.moe_layer_freq={m.moe_layer_freq} cannot be exported as Mixtral, which "
                "has experts in every layer; export takes a model with dense layers as a "
                "Qwen2-MoE (mlp_only_layers)"
            )

    @classmethod
    def check_hf_config(cls, config, head_dim: int) -> None:
        if getattr(config, "sliding_window", None) is not None:
            raise ConversionError(
                f"config.json: sliding_window={config.sliding_window} is not supported "
                "(megatron-lns attends to the whole sequence)"
            )

    @classmethod
    def moe_fields_from_hf(cls, config) -> dict:
        return super().moe_fields_from_hf(config) | dict(
            moe_pattern=(1,) * config.num_hidden_layers, topk_renormalized=True
        )

    def hf_config_fields(self) -> dict:
        return super().hf_config_fields() | dict(
            head_dim=self.head_dim,
            sliding_window=None,
            # megatron-lns has no router input jitter (megatron's moe_input_jitter_eps is
            # not a setting here), so every run trained without it.
            router_jitter_noise=0.0,
        )
