"""What conversion refuses for every architecture, each refusal one line naming its key.

The registered architectures share one design (RoPE, a gated SiLU MLP, Pre-LN blocks,
real-valued weights, plain RoPE over the whole head): a ``model:`` section or a
``config.json`` outside it is refused here, before an architecture is built. What one
architecture alone refuses stays in its module's hooks, with the helpers below where
two say the same.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_lns.config.layer_variants import REGISTRY as LAYER_VARIANTS
from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.mapping import hf_rope_parameters


def listed(names: Iterable[str], sep: str = " and ") -> str:
    """``"A"``, ``"A and B"``, ``"A, B and C"``: names in a message."""
    names = list(names)
    return ", ".join(names[:-1]) + sep + names[-1] if len(names) > 1 else "".join(names)


# The layer variants that no stock architecture computes, and why (their registration in
# config/layer_variants.py says): each normalises or scales where the stock decoders (which
# normalise only a branch's input) do not. pre_ln exports as it is, and variants with branch
# gains with those folded into o_proj / down_proj (BRANCH_GAINS); a test requires every
# layer_variant to be one of these.
UNEXPORTABLE_VARIANTS = {
    name: info.hf_refusal for name, info in LAYER_VARIANTS.items() if info.hf_refusal
}


def refuse_unshared_design(m: ModelConfig, names: list[str]) -> None:
    """Refuse what none of the architectures ``names`` computes: the base mapping
    assumes RoPE, a gated SiLU MLP, Pre-LN blocks (with or without branch gains) and
    real-valued weights."""
    if m.position_embedding_type != "rope":
        raise ConversionError(
            f"model.position_embedding_type={m.position_embedding_type} cannot be exported: "
            f"the supported stock architectures ({', '.join(names)}) use rope"
        )
    if m.activation != "swiglu":
        raise ConversionError(
            f"model.activation={m.activation} cannot be exported: {listed(names)} "
            "use a gated SiLU MLP (swiglu); no stock architecture here has RoPE with a "
            "plain GELU MLP"
        )
    if m.layer_variant in UNEXPORTABLE_VARIANTS:
        raise ConversionError(
            f"model.layer_variant={m.layer_variant} cannot be exported: "
            f"{UNEXPORTABLE_VARIANTS[m.layer_variant]}, and the stock architectures "
            f"({', '.join(names)}) normalise only each branch's input (Pre-LN)"
        )
    if m.qk_layernorm:
        raise ConversionError(
            f"model.qk_layernorm=true cannot be exported: the supported stock architectures "
            f"({', '.join(names)}) have no per-head query/key norm"
        )
    if m.fp8_param:
        raise ConversionError(
            "model.fp8_param=true: the checkpoint holds FP8 weights, which export does "
            "not dequantize; save a checkpoint trained with model.fp8_param=false"
        )


def refuse_head_size_other_than_hidden_over_heads(config, head_dim: int, why: str) -> None:
    """For architectures whose attention heads are always ``hidden_size / heads`` wide
    (no ``head_dim`` of their own): a ``config.json`` that says otherwise is refused."""
    heads = config.num_attention_heads
    if head_dim * heads != config.hidden_size:
        raise ConversionError(
            f"config.json: head_dim={head_dim} x num_attention_heads={heads} != "
            f"hidden_size={config.hidden_size}: {why}"
        )


def refuse_kv_channels_other_than_hidden_over_heads(
    m: ModelConfig, head_dim: int, exported: str, name: str, hint: str = ""
) -> None:
    """The export side of :func:`refuse_head_size_other_than_hidden_over_heads`: a model
    whose ``kv_channels`` is not ``hidden_size / heads`` cannot be ``exported`` (``"as
    X"``, ``"with model.normalization=..."``) to the architecture ``name``."""
    heads = m.num_attention_heads
    if head_dim * heads != m.hidden_size:
        raise ConversionError(
            f"model.kv_channels={head_dim} cannot be exported {exported}: {name}'s attention "
            f"has hidden_size / num_attention_heads channels per head "
            f"({m.hidden_size} / {heads}){hint}"
        )


def refuse_unshared_hf_design(config) -> None:
    """Refuse a ``config.json`` outside the shared design: RoPE scaling, partial
    rotation, a non-integer ``rope_theta`` or an activation other than SiLU."""
    rope = hf_rope_parameters(config)
    if rope.get("rope_type", "default") != "default":
        raise ConversionError(
            f"config.json: rope scaling '{rope['rope_type']}' is not supported (megatron-lns "
            "uses plain RoPE)"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(
            f"config.json: partial_rotary_factor={rope['partial_rotary_factor']} is not "
            "supported (megatron-lns rotates the whole head)"
        )
    if not float(rope["rope_theta"]).is_integer():
        raise ConversionError(
            f"config.json: rope_theta={rope['rope_theta']} is not an integer "
            "(model.rotary_base is one)"
        )
    if config.hidden_act != "silu":
        raise ConversionError(
            f"config.json: hidden_act={config.hidden_act} is not supported (swiglu only)"
        )


# config.json's sizes that a model has at least one of: a zero or a string in one would
# otherwise end in a traceback (a range of step 0, a division), not a refusal.
HF_COUNTS = ("num_hidden_layers", "hidden_size", "num_attention_heads")


def refuse_impossible_hf_counts(config) -> None:
    """Refuse, naming the field, a ``config.json`` count that is not a whole number of at
    least 1 (``transformers`` checks some of them, depending on its version)."""
    for key in HF_COUNTS:
        value = getattr(config, key, None)
        if type(value) is not int or value < 1:
            raise ConversionError(
                f"config.json: {key}={value!r} is not a model's: give a whole number of at least 1"
            )
