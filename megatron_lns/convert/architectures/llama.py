"""``LlamaForCausalLM``: the RMSNorm decoder, with its own head size and optional biases.

A megatron-lns model with ``normalization: rmsnorm`` (affine or not) is a Llama:
``head_dim`` carries ``model.kv_channels`` (heads need not tile the residual stream),
and ``attention_bias`` = ``mlp_bias`` = ``model.bias``. A parameter-free RMSNorm gets
weights (the LNS factor, or ones) on export.
"""

from __future__ import annotations

from megatron_lns.convert.architectures.base import Architecture
from megatron_lns.convert.errors import ConversionError


class Llama(Architecture):
    hf_class = "LlamaForCausalLM"
    name = "Llama"
    hf_config_class = "LlamaConfig"
    norm = "rmsnorm"
    hf_eps_key = "rms_norm_eps"

    @classmethod
    def read_hf_bias(cls, config) -> bool:
        attention_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ConversionError(
                f"config.json: attention_bias={attention_bias} with mlp_bias={mlp_bias}: "
                "megatron-lns has one switch (model.bias) for all linear biases"
            )
        return attention_bias

    def hf_config_fields(self) -> dict:
        # Llama's config always has head_dim (hidden_size // heads unless set), and its
        # attention uses it.
        return dict(head_dim=self.head_dim, attention_bias=self.bias, mlp_bias=self.bias)
