"""The model sizes whose null defaults depend on other settings, decided once.

A null ``ffn_hidden_size`` is 4 x hidden (megatron-core's rule); a null ``num_moe_experts``
is a dense model; a null ``kv_channels`` is hidden / heads; a null ``num_query_groups`` is
one group per head (multi-head attention); a null ``moe_ffn_hidden_size`` is the dense
MLP's width; a null ``max_position_embeddings`` is the sequence length. The config
checks, ``plan``, the model's FLOPs and parameter counts, and Hugging Face export read
them here, so each rule has one home.

``m`` is anything with the model section's field names: the ``model:`` section
(``config.schema.ModelConfig``) or the model's own ``GPTModelConfig``. Nothing here
imports torch.
"""

from __future__ import annotations

from typing import Any

from megatron_lns.config.moe_layers import moe_layer_pattern


def ffn_hidden_size(m: Any) -> int:
    """The dense MLP's width (per gate/up half with SwiGLU): null is 4 x hidden."""
    return m.ffn_hidden_size or 4 * m.hidden_size


def has_experts(m: Any) -> bool:
    """Whether the model has mixture-of-experts layers: dense when null."""
    return bool(m.num_moe_experts)


def expert_ffn_hidden_size(m: Any) -> int:
    """Each routed expert's MLP width: null is the dense MLP's."""
    return m.moe_ffn_hidden_size or ffn_hidden_size(m)


def head_size(m: Any) -> int:
    """Channels per attention head: null ``kv_channels`` is hidden / heads."""
    return m.kv_channels or m.hidden_size // m.num_attention_heads


def query_groups(m: Any) -> int:
    """Key/value heads: null ``num_query_groups`` is one per query head."""
    return m.num_query_groups or m.num_attention_heads


def max_positions(m: Any, seq_length: int) -> int:
    """Rows of a learned position table: null ``max_position_embeddings`` is the sequence
    length."""
    return m.max_position_embeddings or seq_length


def moe_layers(m: Any) -> list[int]:
    """1 for each MoE layer, 0 for each dense one, over ``num_layers`` (all 0 when dense)."""
    if not has_experts(m):
        return [0] * m.num_layers
    return moe_layer_pattern(m.moe_layer_freq, m.num_layers)
