"""``StableLmForCausalLM``: the LayerNorm decoder without linear biases.

A megatron-lns model with ``normalization: layernorm`` or ``layernorm1p`` (affine or
not) and ``bias: false`` is a StableLM with ``partial_rotary_factor`` 1.0, no parallel
residual, no QK-norm and no QKV bias. Its LayerNorms have a weight and a bias, so they
can carry the LNS factor and OLMo's parameter-free norm (``OlmoForCausalLM``'s norms
have no weights to carry it). Its heads are always hidden_size / num_attention_heads
wide.
"""

from __future__ import annotations

from typing import ClassVar

from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.architectures.base import Architecture
from megatron_lns.convert.architectures.refusals import (
    refuse_head_size_other_than_hidden_over_heads,
    refuse_kv_channels_other_than_hidden_over_heads,
)
from megatron_lns.convert.errors import ConversionError


class StableLm(Architecture):
    hf_class = "StableLmForCausalLM"
    name = "StableLM"
    hf_config_class = "StableLmConfig"
    norm = "layernorm"
    hf_eps_key = "layer_norm_eps"
    hf_fixed_switches: ClassVar[dict[str, bool]] = {
        "use_parallel_residual": False,
        "qk_layernorm": False,
        "use_qkv_bias": False,
    }
    hf_hidden_dropout = True

    @classmethod
    def check_model_config(cls, m: ModelConfig, head_dim: int) -> None:
        if m.bias:
            raise ConversionError(
                f"model.normalization={m.normalization} with model.bias=true cannot be "
                "exported: StableLM (the stock LayerNorm + RoPE + SwiGLU architecture) has no "
                "output-projection or MLP biases; Llama (with biases) needs "
                "model.normalization=rmsnorm"
            )
        refuse_kv_channels_other_than_hidden_over_heads(
            m,
            head_dim,
            f"with model.normalization={m.normalization}",
            cls.name,
            hint="; Llama (model.normalization=rmsnorm) carries its own head_dim",
        )

    @classmethod
    def check_hf_config(cls, config, head_dim: int) -> None:
        refuse_head_size_other_than_hidden_over_heads(
            config,
            head_dim,
            "StableLM's attention has hidden_size / num_attention_heads channels per head, so "
            "model.kv_channels cannot differ",
        )

    def hf_config_fields(self) -> dict:
        return dict(partial_rotary_factor=1.0, hidden_dropout=self.hidden_dropout)
