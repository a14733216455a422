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
        doc="training sequence length (`GPTModel` / `GPTDataset` sequence length)",
        shapes=True,
        hf=HF_CONVERTER,
    )
    max_position_embeddings: int | None = setting(
        None,
        positive,
        target="GPTModel.max_sequence_length",
        translate=to("max_position_embeddings"),
        null_means="= seq length",
        doc="`GPTModel.max_sequence_length`",
        shapes=True,
        hf="max_position_embeddings",
    )
    num_layers: int = setting(
        12,
        positive,
        target="TransformerConfig.num_layers",
        doc="`TransformerConfig.num_layers`",
        shapes=True,
        hf="num_hidden_layers",
    )
    architecture: str = setting(
        "gpt",
        one_of(ARCHITECTURES),
        target="layer_spec.architecture",
        doc=(
            "megatron-core's model class: `gpt` (`GPTModel`, deprecated in megatron-core 0.19) "
            "or `hybrid` (`HybridModel`, its successor: one module per sublayer of "
            "`hybrid_layer_pattern`). Without a pattern, `hybrid` builds the GPT model's twin "
            "(`*-` per layer, `*E` where `moe_layer_freq` puts experts), which computes the same "
            "function and resumes its checkpoints; LNS's depth is the paper's block index in both"
        ),
        hf=HF_CONVERTER,
    )
    hybrid_layer_pattern: str | None = setting(
        None,
        target="HybridModel.hybrid_layer_pattern",
        aliases=("hybrid_override_pattern",),
        null_means="the GPT twin",
        doc=(
            "`architecture: hybrid` only: one symbol per sublayer, `*` attention, `-` MLP, `E` "
            "MoE, `|` between pipeline segments (one per stage and virtual chunk); `num_layers` "
            "then counts sublayers, as in megatron-core. An attention starts LNS block `l`; the "
            "MLP/MoE sublayers after it share its `l` (docs/design.md). Mamba (`M`), GDN (`G`), "
            "DSA (`D`), MLA (`+`) and MTP (`/`) are refused"
        ),
        shapes=True,
        hf=HF_CONVERTER,
    )
    hidden_size: int = setting(
        768,
        positive,
        target="TransformerConfig.hidden_size",
        doc="`hidden_size`",
        shapes=True,
        hf="hidden_size",
    )
    ffn_hidden_size: int | None = setting(
        None,
        positive,
        target="TransformerConfig.ffn_hidden_size",
        null_means="4 x hidden",
        doc="`ffn_hidden_size` (per gate/up half with SwiGLU)",
        shapes=True,
        hf=HF_CONVERTER,
    )
    num_attention_heads: int = setting(
        12,
        positive,
        target="TransformerConfig.num_attention_heads",
        doc="`num_attention_heads`",
        shapes=True,
        hf="num_attention_heads",
    )
    kv_channels: int | None = setting(
        None,
        positive,
        target="TransformerConfig.kv_channels",
        null_means="= hidden / heads",
        doc=(
            "`kv_channels`: the attention head size; queries, keys and values are `heads x "
            "kv_channels` wide, so attention may be wider or narrower than `hidden_size` (which "
            "then need not divide by the heads). With RoPE it must be even. Hugging Face export "
            "writes it as Llama's `head_dim`; StableLM has no head size of its own, so a "
            "LayerNorm model with another head size is refused"
        ),
        shapes=True,
        hf=HF_CONVERTER,
    )
    num_query_groups: int | None = setting(
        None,
        positive,
        target="TransformerConfig.num_query_groups",
        null_means="= heads",
        doc="`num_query_groups` (grouped-query attention)",
        shapes=True,
        hf="num_key_value_heads",
    )
    position_embedding_type: str = setting(
        "rope",
        one_of(POSITION_EMBEDDINGS),
        target="GPTModel.position_embedding_type",
        doc="`rope` (rotate-half, as Hugging Face Llama) or `learned_absolute`",
        shapes=True,
        hf=HF_CONVERTER,
    )
    rotary_base: int = setting(
        10000,
        positive,
        target="GPTModel.rotary_base",
        doc="RoPE theta",
        hf=HF_CONVERTER,
    )
    normalization: str = setting(
        "rmsnorm",
        one_of(NORMALIZATIONS),
        target="TransformerConfig.normalization",
        translate=_normalization,
        doc=(
            "`rmsnorm`, `layernorm`, or `layernorm1p` (LayerNorm with zero-centred gamma, "
            "`layernorm_zero_centered_gamma`)"
        ),
        shapes=True,
        hf=HF_CONVERTER,
    )
    norm_affine: bool = setting(
        True,
        target="layer_spec.norm_affine",
        doc=(
            "false: parameter-free norms (OLMo); with LNS the effective gamma is the constant "
            "`1/sqrt(l)`"
        ),
        shapes=True,
        hf=HF_CONVERTER,
    )
    layernorm_epsilon: float = setting(
        1e-5,
        positive,
        target="TransformerConfig.layernorm_epsilon",
        doc="`layernorm_epsilon`",
        hf=HF_CONVERTER,
    )
    bias: bool = setting(
        False,
        target="TransformerConfig.add_bias_linear",
        translate=to("bias"),
        doc="`add_bias_linear` and `add_qkv_bias`",
        shapes=True,
        hf=HF_CONVERTER,
    )
    qk_layernorm: bool = setting(
        False,
        target="TransformerConfig.qk_layernorm",
        doc=(
            "`qk_layernorm`: megatron-core's QK-norm, a norm (`normalization`) on each head's "
            "queries and keys before RoPE (OLMo 2, Qwen3); never LNS-scaled. Not exported to "
            "Hugging Face (Llama, StableLM, Mixtral and Qwen2-MoE have none)"
        ),
        shapes=True,
        hf=HF_REFUSE,
    )
    activation: str = setting(
        "swiglu",
        one_of(ACTIVATIONS),
        target="TransformerConfig.activation_func",
        translate=to("activation"),
        doc="`swiglu` (`gated_linear_unit` + SiLU) or `gelu`",
        shapes=True,
        hf=HF_CONVERTER,
    )
    share_embeddings_and_output_weights: bool = setting(
        False,
        target="GPTModel.share_embeddings_and_output_weights",
        doc="tie input embedding and LM head",
        shapes=True,
        hf="tie_word_embeddings",
    )
    init_method_std: float = setting(
        0.02,
        positive,
        target="TransformerConfig.init_method_std",
        doc="`init_method_std`",
        hf="initializer_range",
    )
    hidden_dropout: float = setting(
        0.0,
        probability,
        target="TransformerConfig.hidden_dropout",
        doc="`hidden_dropout`",
        hf=HF_CONVERTER,
    )
    attention_dropout: float = setting(
        0.0,
        probability,
        target="TransformerConfig.attention_dropout",
        doc="`attention_dropout`",
        hf="attention_dropout",
    )
    make_vocab_size_divisible_by: int = setting(
        128,
        positive,
        doc=(
            "embedding rows = tokenizer vocab rounded up to a multiple of lcm(this, TP) "
            "(Megatron-LM multiplies by TP instead, which ties checkpoints to one TP size)"
        ),
        shapes=True,
        hf=HF_CONVERTER,
    )
    seed: int = setting(
        1234,
        rng_seed,
        doc="init, data order and dropout seeds (`model_parallel_cuda_manual_seed`)",
    )
