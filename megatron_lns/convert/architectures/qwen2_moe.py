"""``Qwen2MoeForCausalLM``: RMSNorm decoder whose MoE layers add a gated shared expert.

Qwen2-MoE's MoE block is a routed mixture plus one shared SwiGLU expert scaled by
``sigmoid(x @ shared_expert_gate)``: megatron's ``moe_shared_expert_intermediate_size``
with ``moe_shared_expert_gate: true`` (SharedExpertMLP's ``gate_weight``). A model
without a shared expert is a Qwen2-MoE whose shared expert is zero wide
(``shared_expert_intermediate_size: 0``): its down projection sums nothing, so its output
is exactly zero, and the block is the routed mixture alone. Its router divides the top-k
probabilities by their sum when ``norm_topk_prob`` (megatron's
``moe_router_pre_softmax: false``) and keeps them as they are otherwise
(``moe_router_pre_softmax: true``); see :mod:`.moe`. Dense layers mixed in by
``moe_layer_freq`` (any pattern) are its ``mlp_only_layers`` (with
``decoder_sparse_step`` 1), each a ``Qwen2MoeMLP`` of width ``intermediate_size``, which
is megatron's ``ffn_hidden_size``, the width of every dense layer of a megatron model;
the experts' width is ``moe_intermediate_size``. Its attention has no output bias and,
here, no QKV bias (``qkv_bias: false``); its heads are hidden_size / num_attention_heads
wide.
"""

from __future__ import annotations

from typing import ClassVar

from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.architectures.moe import MoEArchitecture
from megatron_lns.convert.architectures.refusals import (
    refuse_head_size_other_than_hidden_over_heads,
    refuse_kv_channels_other_than_hidden_over_heads,
)
from megatron_lns.convert.errors import ConversionError


class Qwen2Moe(MoEArchitecture):
    hf_class = "Qwen2MoeForCausalLM"
    name = "Qwen2-MoE"
    hf_config_class = "Qwen2MoeConfig"
    norm = "rmsnorm"
    hf_eps_key = "rms_norm_eps"
    hf_fixed_switches: ClassVar[dict[str, bool]] = {"qkv_bias": False, "use_sliding_window": False}
    hf_moe_block = "mlp."
    hf_expert_projections: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    hf_shared_expert = "shared_expert"
    hf_shared_expert_gate = "shared_expert_gate"
    hf_shared_expert_always = True
    hf_num_experts_key = "num_experts"
    hf_expert_width_key = "moe_intermediate_size"
    hf_inert_fields: ClassVar[dict[str, str]] = {
        "sliding_window": "used only with use_sliding_window, which import refuses",
        "max_window_layers": (
            "the layers that slide their window with use_sliding_window, which import refuses"
        ),
    }

    @classmethod
    def check_model_config(cls, m: ModelConfig, head_dim: int) -> None:
        super().check_model_config(m, head_dim)
        if m.moe_shared_expert_intermediate_size and not m.moe_shared_expert_gate:
            raise ConversionError(
                "model.moe_shared_expert_gate=false cannot be exported: Qwen2-MoE's shared "
                "expert is always scaled by a sigmoid gate, and no stock class here has an "
                "ungated one"
            )
        refuse_kv_channels_other_than_hidden_over_heads(m, head_dim, f"as {cls.name}", cls.name)

    @classmethod
    def check_hf_config(cls, config, head_dim: int) -> None:
        refuse_head_size_other_than_hidden_over_heads(
            config, head_dim, "Qwen2-MoE's heads are hidden_size / num_attention_heads wide"
        )
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ConversionError(
                f"config.json: layer_types={sorted(layer_types)} is not supported "
                "(megatron-lns attends to the whole sequence in every layer)"
            )

    @classmethod
    def moe_fields_from_hf(cls, config) -> dict:
        step = config.decoder_sparse_step
        dense = set(config.mlp_only_layers or [])
        pattern = tuple(
            int(config.num_experts > 0 and i not in dense and (i + 1) % step == 0)
            for i in range(config.num_hidden_layers)
        )
        return super().moe_fields_from_hf(config) | dict(
            moe_pattern=pattern,
            # Zero wide: no shared expert (its gate multiplies zeros).
            shared_expert_ffn_hidden_size=config.shared_expert_intermediate_size,
            shared_expert_gate=bool(config.shared_expert_intermediate_size),
            topk_renormalized=bool(config.norm_topk_prob),
        )

    def hf_config_fields(self) -> dict:
        return super().hf_config_fields() | dict(
            shared_expert_intermediate_size=self.shared_expert_ffn_hidden_size,
            norm_topk_prob=self.topk_renormalized,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(self.moe_pattern) if not moe],
        )
