"""``model``'s architecture: the sizes, norms, positions and initialisation of the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lns.config.choices import (
    ACTIVATIONS,
    ARCHITECTURES,
    POSITION_EMBEDDINGS,
)
from megatron_lns.config.rules import (
    one_of,
    positive,
    probability,
    rng_seed,
)
from megatron_lns.config.settings import HF_CONVERTER, HF_REFUSE, listed_in, setting, to

NORMALIZATIONS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm", "layernorm1p": "LayerNorm"}


def _normalization(value: str, cfg: Any) -> dict[str, Any]:
    """layernorm1p is LayerNorm with zero-centred gamma (``1 + g``)."""
    return {
        "normalization": NORMALIZATIONS[value],
        "layernorm_zero_centered_gamma": value == "layernorm1p",
    }


@listed_in("architecture")
@dataclass
class ArchitectureSettings:
    """``model``'s architecture keys (the ``architecture`` table)."""

    encoder_seq_length: int = setting(
        512,
        positive,
        target="GPTModel.max_sequence_length",
        translate=to("seq_length"),
        shapes=True,
        resume="data",
        hf=HF_CONVERTER,
    )
    """training sequence length (`GPTModel` / `GPTDataset` sequence length)"""

    max_position_embeddings: int | None = setting(
        None,
        positive,
        target="GPTModel.max_sequence_length",
        translate=to("max_position_embeddings"),
        null_means="= seq length",
        shapes=True,
        resume="tensors",
        hf="max_position_embeddings",
    )
    """`GPTModel.max_sequence_length`"""

    num_layers: int = setting(
        12,
        positive,
        target="TransformerConfig",
        shapes=True,
        resume="tensors",
        hf="num_hidden_layers",
    )
    """`TransformerConfig.num_layers`"""

    architecture: str = setting("gpt", one_of(ARCHITECTURES), target="layer_spec", hf=HF_CONVERTER)
    """megatron-core's model class: `gpt` (`GPTModel`, deprecated in megatron-core 0.19) or `hybrid`
    (`HybridModel`, its successor: one module per sublayer of `hybrid_layer_pattern`). Without a
    pattern, `hybrid` builds the GPT model's twin (`*-` per layer, `*E` where `moe_layer_freq` puts
    experts), which computes the same function and resumes its checkpoints; LNS's depth is the
    paper's block index in both"""

    hybrid_layer_pattern: str | None = setting(
        None,
        target="HybridModel",
        aliases=("hybrid_override_pattern",),
        null_means="the GPT twin",
        shapes=True,
        resume="tensors",
        hf=HF_CONVERTER,
    )
    """`architecture: hybrid` only: one symbol per sublayer, `*` attention, `-` MLP, `E` MoE, `|`
    between pipeline segments (one per stage and virtual chunk); `num_layers` then counts sublayers,
    as in megatron-core. An attention starts LNS block `l`; the MLP/MoE sublayers after it share its
    `l` (docs/design.md). Mamba (`M`), GDN (`G`), DSA (`D`), MLA (`+`) and MTP (`/`) are refused"""

    hidden_size: int = setting(
        768, positive, target="TransformerConfig", shapes=True, hf="hidden_size"
    )
    """`hidden_size`"""

    ffn_hidden_size: int | None = setting(
        None,
        positive,
        target="TransformerConfig",
        null_means="4 x hidden",
        shapes=True,
        hf=HF_CONVERTER,
    )
    """`ffn_hidden_size` (per gate/up half with SwiGLU)"""

    num_attention_heads: int = setting(
        12,
        positive,
        target="TransformerConfig",
        shapes=True,
        hf="num_attention_heads",
    )
    """`num_attention_heads`"""

    kv_channels: int | None = setting(
        None,
        positive,
        target="TransformerConfig",
        null_means="= hidden / heads",
        shapes=True,
        hf=HF_CONVERTER,
    )
    """`kv_channels`: the attention head size; queries, keys and values are `heads x kv_channels`
    wide, so attention may be wider or narrower than `hidden_size` (which then need not divide by
    the heads). With RoPE it must be even. Hugging Face export writes it as Llama's `head_dim`;
    StableLM has no head size of its own, so a LayerNorm model with another head size is refused"""

    num_query_groups: int | None = setting(
        None,
        positive,
        target="TransformerConfig",
        null_means="= heads",
        shapes=True,
        hf="num_key_value_heads",
    )
    """`num_query_groups` (grouped-query attention)"""

    position_embedding_type: str = setting(
        "rope",
        one_of(POSITION_EMBEDDINGS),
        target="GPTModel",
        shapes=True,
        hf=HF_CONVERTER,
    )
    """`rope` (rotate-half, as Hugging Face Llama) or `learned_absolute`"""

    rotary_base: int = setting(10000, positive, target="GPTModel", hf=HF_CONVERTER)
    """RoPE theta"""

    normalization: str = setting(
        "rmsnorm",
        one_of(NORMALIZATIONS),
        target="TransformerConfig",
        translate=_normalization,
        shapes=True,
        hf=HF_CONVERTER,
    )
    """`rmsnorm`, `layernorm`, or `layernorm1p` (LayerNorm with zero-centred gamma,
    `layernorm_zero_centered_gamma`)"""

    norm_affine: bool = setting(True, target="layer_spec", shapes=True, hf=HF_CONVERTER)
    """false: parameter-free norms (OLMo); with LNS the effective gamma is the constant
    `1/sqrt(l)`"""

    layernorm_epsilon: float = setting(1e-5, positive, target="TransformerConfig", hf=HF_CONVERTER)
    """`layernorm_epsilon`"""

    bias: bool = setting(
        False,
        target="TransformerConfig.add_bias_linear",
        translate=to("bias"),
        shapes=True,
        hf=HF_CONVERTER,
    )
    """`add_bias_linear` and `add_qkv_bias`"""

    qk_layernorm: bool = setting(False, target="TransformerConfig", shapes=True, hf=HF_REFUSE)
    """`qk_layernorm`: megatron-core's QK-norm, a norm (`normalization`) on each head's queries and
    keys before RoPE (OLMo 2, Qwen3); never LNS-scaled. Not exported to Hugging Face (Llama,
    StableLM, Mixtral and Qwen2-MoE have none)"""

    activation: str = setting(
        "swiglu",
        one_of(ACTIVATIONS),
        target="TransformerConfig.activation_func",
        translate=to("activation"),
        shapes=True,
        hf=HF_CONVERTER,
    )
    """`swiglu` (`gated_linear_unit` + SiLU) or `gelu`"""

    share_embeddings_and_output_weights: bool = setting(
        False,
        target="GPTModel",
        shapes=True,
        hf="tie_word_embeddings",
    )
    """tie input embedding and LM head"""

    init_method_std: float = setting(
        0.02, positive, target="TransformerConfig", hf="initializer_range"
    )
    """`init_method_std`"""

    hidden_dropout: float = setting(0.0, probability, target="TransformerConfig", hf=HF_CONVERTER)
    """dropout after attention and MLP, before the residual add"""

    attention_dropout: float = setting(
        0.0, probability, target="TransformerConfig", hf="attention_dropout"
    )
    """`attention_dropout`"""

    make_vocab_size_divisible_by: int = setting(128, positive, shapes=True, hf=HF_CONVERTER)
    """embedding rows = tokenizer vocab rounded up to a multiple of lcm(this, TP) (Megatron-LM
    multiplies by TP instead, which ties checkpoints to one TP size)"""

    seed: int = setting(1234, rng_seed, resume="data")
    """init, data order and dropout seeds (`model_parallel_cuda_manual_seed`)"""
