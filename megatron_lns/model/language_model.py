"""Build LNS GPT models (one module per virtual-pipeline chunk) from a typed config."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import init_method_normal

from megatron_lns.base.errors import UserError
from megatron_lns.config import hybrid_pattern, model_derived
from megatron_lns.config.choices import (
    Activation,
    Architecture,
    LayerVariant,
    NormScaling,
    OutputLayerInit,
    PositionEmbedding,
    RecomputeGranularity,
    RecomputeMethod,
)
from megatron_lns.config.layer_variants import variant_info
from megatron_lns.config.moe_layers import MoELayerFreq
from megatron_lns.config.output_inits import resolved_output_init
from megatron_lns.model.specs import get_lns_block_spec
from megatron_lns.model.variants import VariantSettings
from megatron_lns.runtime import ParallelLayout, uses_gloo

Precision = Literal["fp32", "bf16", "fp16"]
Normalization = Literal["RMSNorm", "LayerNorm"]
PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The fields of GPTModelConfig that megatron's TransformerConfig takes as they are, by
# the same name (sorted); transformer_config() spells out only those it derives or renames.
TRANSFORMER_CONFIG_FIELDS = (
    "apply_query_key_layer_scaling",
    "apply_rope_fusion",
    "attention_dropout",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "cpu_offloading",
    "cpu_offloading_activations",
    "cpu_offloading_num_layers",
    "cpu_offloading_weights",
    "cross_entropy_loss_fusion",
    "ffn_hidden_size",
    "fp32_residual_connection",
    "gradient_accumulation_fusion",
    "hidden_dropout",
    "hidden_size",
    "init_method_std",
    "kv_channels",
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
    "masked_softmax_fusion",
    "normalization",
    "num_attention_heads",
    "num_query_groups",
    "overlap_p2p_comm",
    "qk_layernorm",
    "recompute_granularity",
    "recompute_method",
    "tp_comm_bootstrap_backend",
    "tp_comm_overlap",
)
# The same, taken only by a model with experts, and only with FP8 (``fp8`` set).
MOE_FIELDS = (
    "moe_ffn_hidden_size",
    "moe_grouped_gemm",
    "moe_permute_fusion",
    "moe_router_topk",
    "moe_shared_expert_intermediate_size",
    "num_moe_experts",
)
FP8_FIELDS = ("fp8_amax_compute_algo", "fp8_amax_history_len", "fp8_margin", "fp8_param")


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """The embedding size: ``vocab_size`` rounded up to a multiple of ``divisible_by`` and
    of ``tensor_parallel``.

    Megatron-LM pads to a multiple of ``divisible_by * tensor_parallel``, which makes the
    embedding shape depend on TP and a checkpoint unloadable at another TP size. Padding
    to the least common multiple keeps the shape the same for every TP size that divides
    ``divisible_by``, so checkpoints reshard freely.
    """
    multiple = math.lcm(divisible_by, tensor_parallel)
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ParameterCounts:
    """``total``: every parameter; ``active``: those one token meets (the router, its
    ``topk`` experts and the shared expert in an MoE layer; all of them in a dense model)."""

    total: int
    active: int


@dataclass
class GPTModelConfig:
    """Architecture of a decoder-only GPT / LLaMA / OLMo model with optional LNS.

    ``norm_scaling`` is a rule registered in ``config/norm_scalings.py`` (LNS: the pre-norms
    of block l scaled by ``1/sqrt(l)``). ``output_layer_init`` picks the init of the
    residual-branch output projections (attention ``linear_proj`` and MLP ``linear_fc2``),
    one registered in ``config/output_inits.py`` (``normal``, ``scaled``, ``depth_scaled``);
    ``None`` is the norm scaling rule's default (``normal`` with LNS, as the paper advises;
    megatron's ``scaled`` without).

    ``layer_variant`` picks the residual/normalisation scheme of every layer (the
    registered layer variants, ``variants/``); ``variant_options`` holds the variants' own
    settings by key name (``mix_ln_post_fraction``, ``layerscale_init``: the keys their
    registrations declare; those not given take their declared defaults).

    ``recompute_*`` are megatron's activation recomputation settings, passed through
    unchanged: ``"selective"`` recomputes the core attention (megatron's default
    ``recompute_modules``), ``"full"`` whole layers, chosen by ``recompute_method`` and
    ``recompute_num_layers``. They trade compute for memory; the result is the same.

    The fusion switches, ``attention_backend`` and the pipeline communication settings
    are megatron's ``TransformerConfig`` fields of the same names, passed through; their
    defaults are what runs anywhere (``fast_paths.py`` chooses them per machine).
    ``batch_p2p_comm=None`` batches pipeline send/receive except on gloo.

    ``tp_comm_overlap`` and ``cpu_offloading*`` are megatron's fields of the same names,
    passed through; both run in Transformer Engine (``tp_comm_overlap`` after
    ``userbuffers.initialize_userbuffers``).

    ``kv_channels`` is the attention head size (megatron's name); ``None`` is
    ``hidden_size // num_attention_heads``. The query, key and value projections are
    ``heads x kv_channels`` wide, so attention need not be as wide as the residual stream.

    ``num_moe_experts`` makes the layers that ``moe_layer_freq`` picks mixture-of-experts
    layers (megatron's ``MoELayer``): ``moe_router_topk`` experts of ``moe_ffn_hidden_size``
    (default ``ffn_hidden_size``) per token, plus a shared expert of
    ``moe_shared_expert_intermediate_size`` if set. The fields the model code itself reads
    are here; the router, dispatcher and loss settings pass through
    ``extra_transformer_config`` to megatron unchanged.

    ``architecture`` picks megatron-core's model class: ``"gpt"`` (``GPTModel``: one
    layer = attention + MLP) or ``"hybrid"`` (``HybridModel``, its successor: one module
    per sublayer of ``hybrid_layer_pattern``, ``hybrid_pattern.py``). Without a pattern the
    hybrid model is the GPT model's twin (:meth:`hybrid_stack_pattern`) and ``num_layers``
    counts blocks; with one, ``num_layers`` counts its sublayers, as in megatron-core. Depth
    (LNS's ``l``, the scaled init) always counts the paper's blocks (:meth:`num_blocks`).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    max_position_embeddings: int | None = None
    norm_scaling: NormScaling = "lns"
    layer_variant: LayerVariant = "pre_ln"
    variant_options: dict = field(default_factory=dict)
    normalization: Normalization = "RMSNorm"
    norm_affine: bool = True
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    activation: Activation = "swiglu"
    bias: bool = False
    position_embedding_type: PositionEmbedding = "rope"
    rotary_base: int = 10000
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    output_layer_init: OutputLayerInit | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    precision: Precision = "fp32"
    backend: Literal["local", "te"] = "local"
    qk_layernorm: bool = False
    recompute_granularity: RecomputeGranularity | None = None
    recompute_method: RecomputeMethod | None = None
    recompute_num_layers: int | None = None
    fp8: str | None = None  # recipe: delayed | tensorwise | blockwise | mxfp8
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    fp8_param: bool = False
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    masked_softmax_fusion: bool = False
    apply_rope_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    cross_entropy_loss_fusion: bool = False
    attention_backend: Literal["auto", "flash", "fused"] = "auto"
    batch_p2p_comm: bool | None = None
    overlap_p2p_comm: bool = False
    fp32_residual_connection: bool = False
    apply_query_key_layer_scaling: bool = False
    tp_comm_overlap: bool = False
    tp_comm_bootstrap_backend: Literal["nccl", "mpi", "gloo"] = "nccl"
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    num_moe_experts: int | None = None
    moe_layer_freq: MoELayerFreq = 1
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False
    architecture: Architecture = "gpt"
    hybrid_layer_pattern: str | None = None
    extra_transformer_config: dict = field(default_factory=dict)

    def variant_settings(self) -> VariantSettings:
        settings = VariantSettings(
            layer_variant=self.layer_variant,
            options=dict(self.variant_options),
            output_init=self.resolved_output_layer_init(),
        )
        settings.check(self.norm_scaling)
        return settings

    def resolved_output_layer_init(self) -> str:
        return resolved_output_init(self.output_layer_init, self.norm_scaling).name

    @property
    def head_size(self) -> int:
        """Channels per attention head: ``kv_channels``, else hidden / heads."""
        return model_derived.head_size(self)

    def flops_per_token(self) -> float:
        """Training (forward + backward) FLOPs per token: 6 x matmul parameters plus causal
        attention, the count behind model TFLOP/s and MFU (as nanoGPT's ``estimate_mfu``)."""
        h, s = self.hidden_size, self.seq_length
        ffn = model_derived.ffn_hidden_size(self)
        q = self.num_attention_heads * self.head_size  # width of all query (and output) heads
        matmul = h * self.vocab_size
        attention_layers = 0
        for symbol in self.sublayer_pattern():
            if symbol == hybrid_pattern.ATTENTION:
                matmul += self._attention_weights()
                attention_layers += 1
            elif symbol == hybrid_pattern.MOE:
                matmul += self.moe_mlp_active_weights()
            else:
                matmul += self._mlp_weights(ffn)
        return 6.0 * matmul + 6.0 * attention_layers * q * s

    def _attention_weights(self) -> int:
        """Matmul weights of one attention: query, key, value and output projections."""
        groups = model_derived.query_groups(self)
        q = self.num_attention_heads * self.head_size
        kv = 2 * groups * self.head_size
        return self.hidden_size * (q + kv) + q * self.hidden_size

    def sublayer_pattern(self) -> str:
        """The model as hybrid sublayers (``*`` attention, ``-`` MLP, ``E`` MoE), pipeline
        separators left out; a GPT layer is an attention and an MLP or MoE."""
        if self.architecture == "hybrid" and self.hybrid_layer_pattern:
            return hybrid_pattern.sublayers(self.hybrid_layer_pattern)
        return hybrid_pattern.gpt_equivalent_pattern(self.moe_layer_pattern())

    def num_blocks(self) -> int:
        """The paper's depth: blocks, each started by an attention (``num_layers`` for GPT)."""
        return hybrid_pattern.num_blocks(self.sublayer_pattern())

    def hybrid_stack_pattern(self, layout: ParallelLayout = ParallelLayout()) -> str:
        """The pattern ``HybridModel`` builds at ``layout``: the configured one, or the GPT
        twin split at the GPT model's stage boundaries (one ``|`` segment per pipeline
        stage and virtual chunk). A pattern's ``|`` are for its training layout; built
        without a pipeline (conversion, analysis) it is one segment."""
        stages = layout.pipeline * (layout.virtual_pipeline or 1)
        if not self.hybrid_layer_pattern:
            return hybrid_pattern.gpt_equivalent_pattern(
                self.moe_layer_pattern(), stages if stages > 1 else 1
            )
        if stages == 1:
            return hybrid_pattern.sublayers(self.hybrid_layer_pattern)
        errors = hybrid_pattern.pattern_errors(
            self.hybrid_layer_pattern, self.num_layers, layout.pipeline, layout.virtual_pipeline
        )
        if errors:
            raise hybrid_pattern.HybridPatternError(f"hybrid_layer_pattern {errors[0]}")
        return self.hybrid_layer_pattern

    def moe_layer_pattern(self) -> list[int]:
        """1 for each MoE layer, 0 for each dense one (all 0 without experts)."""
        return model_derived.moe_layers(self)

    def _mlp_weights(self, ffn: int) -> int:
        """Matmul weights of one (dense or expert) MLP of width ``ffn``."""
        mlp_in = 2 * ffn if self.activation == "swiglu" else ffn
        return self.hidden_size * mlp_in + ffn * self.hidden_size

    def moe_mlp_active_weights(self) -> int:
        """Matmul weights one token meets in an MoE layer: the router, ``topk`` experts
        and the shared expert (with its sigmoid gate when megatron's
        ``moe_shared_expert_gate`` is set)."""
        h = self.hidden_size
        expert_ffn = self._expert_ffn()
        weights = h * self.num_moe_experts + self.moe_router_topk * self._mlp_weights(expert_ffn)
        if self.moe_shared_expert_intermediate_size:
            weights += self._mlp_weights(self.moe_shared_expert_intermediate_size)
            if self.extra_transformer_config.get("moe_shared_expert_gate"):
                weights += h
        return weights

    def parameter_counts(self) -> ParameterCounts:
        """Parameters of the whole model (all ranks together), and those one token meets.

        Counts the matmul weights, the embedding, an untied output layer and the norms'
        weights (and LayerNorm biases); not the linear layers' biases (``bias: true``) or
        the paper variants' per-layer gains (a few ``hidden_size`` each)."""
        h = self.hidden_size
        ffn = model_derived.ffn_hidden_size(self)
        per_channel = 2 if self.normalization == "LayerNorm" else 1  # weight (+ bias)
        norm = per_channel * h if self.norm_affine else 0
        qk_norm = 2 * per_channel * self.head_size if self.qk_layernorm else 0
        sublayers = self.sublayer_pattern()
        attention = sublayers.count(hybrid_pattern.ATTENTION)
        dense_mlps = sublayers.count(hybrid_pattern.MLP)
        moe_layers = sublayers.count(hybrid_pattern.MOE)
        dense = attention * (self._attention_weights() + qk_norm) + len(sublayers) * norm
        dense += norm  # the final norm
        dense += h * self.vocab_size * (1 if self.share_embeddings_and_output_weights else 2)
        if self.position_embedding_type == "learned_absolute":
            dense += model_derived.max_positions(self, self.seq_length) * h
        dense += dense_mlps * self._mlp_weights(ffn)
        if not moe_layers:
            return ParameterCounts(total=dense, active=dense)
        expert = self._mlp_weights(self._expert_ffn())
        idle_experts = self.num_moe_experts - self.moe_router_topk
        active = dense + moe_layers * self.moe_mlp_active_weights()
        return ParameterCounts(total=active + moe_layers * idle_experts * expert, active=active)

    def _expert_ffn(self) -> int:
        return model_derived.expert_ffn_hidden_size(self)

    def transformer_config(
        self, layout: ParallelLayout = ParallelLayout(), cpu_init: bool | None = None
    ) -> TransformerConfig:
        """The megatron ``TransformerConfig`` for this architecture and parallel layout."""
        if cpu_init is None:
            cpu_init = not torch.cuda.is_available()
        dtype = PARAMS_DTYPES[self.precision]
        # A per-layer init (depth_scaled) gives its model-wide std here; each layer replaces
        # it with its own (variants/per_layer_init.py).
        init = resolved_output_init(self.output_layer_init, self.norm_scaling)
        output_init = init_method_normal(init.std(self.init_method_std, self.num_blocks(), None))
        swiglu = self.activation == "swiglu"
        return TransformerConfig(
            num_layers=len(self.sublayer_pattern())
            if self.architecture == "hybrid"
            else self.num_layers,
            gated_linear_unit=swiglu,
            activation_func=F.silu if swiglu else F.gelu,
            add_bias_linear=self.bias,
            add_qkv_bias=self.bias,
            output_layer_init_method=output_init,
            attention_backend=AttnBackend[self.attention_backend],
            **layout.megatron_sizes(),
            sequence_parallel=layout.sequence_parallel,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=self.precision == "bf16",
            fp16=self.precision == "fp16",
            use_cpu_initialization=cpu_init,
            batch_p2p_comm=(
                not uses_gloo() and not self.overlap_p2p_comm
                if self.batch_p2p_comm is None
                else self.batch_p2p_comm
            ),
            # Layers that differ in their parameters (Mix-LN's) are checkpointed each under
            # its own key rather than stacked along a layer axis.
            hetereogenous_dist_checkpoint=variant_info(self.layer_variant).heterogeneous_layers,
            recompute_num_layers=self.megatron_recompute_num_layers(),
            **self._same_name(TRANSFORMER_CONFIG_FIELDS),
            **self._moe_settings(),
            **self._fp8_settings(),
            **self.extra_transformer_config,
        )

    def megatron_recompute_num_layers(self) -> int | None:
        """``recompute_num_layers`` as megatron-core counts it: modules of a pipeline
        stage, which are sublayers in the hybrid model. The GPT twin's ``num_layers`` counts
        blocks (an attention and an MLP sublayer each), so its recompute count is doubled
        to recompute the same blocks as the GPT model; with a pattern both count
        sublayers."""
        twin = self.architecture == "hybrid" and not self.hybrid_layer_pattern
        if twin and self.recompute_num_layers:
            return 2 * self.recompute_num_layers
        return self.recompute_num_layers

    def _moe_settings(self) -> dict:
        if not model_derived.has_experts(self):
            return {}
        # The hybrid model builds its MoE layers from the pattern's ``E``s; megatron's
        # router-loss report (and MoEMetrics) still count MoE layers by moe_layer_freq over
        # num_layers, here sublayers, so it marks the E sublayers (1 would count all of them).
        if self.architecture == "hybrid":
            layer_freq = [int(s == hybrid_pattern.MOE) for s in self.sublayer_pattern()]
        else:
            layer_freq = self.moe_layer_pattern()
        return self._same_name(MOE_FIELDS) | {"moe_layer_freq": layer_freq}

    def _fp8_settings(self) -> dict:
        if self.fp8 is None:
            return {}
        return self._same_name(FP8_FIELDS) | {"fp8": self.fp8_format, "fp8_recipe": self.fp8}

    def _same_name(self, names: tuple[str, ...]) -> dict:
        return {name: getattr(self, name) for name in names}

    def to_dict(self) -> dict:
        return asdict(self)


def build_model(
    config: GPTModelConfig,
    layout: ParallelLayout = ParallelLayout(),
    device: torch.device | str | None = None,
) -> list[torch.nn.Module]:
    """This rank's model chunks: one ``GPTModel`` or ``HybridModel`` (``config.architecture``)
    per virtual-pipeline stage.

    Requires megatron's parallel state to be initialised (see ``runtime.init_distributed``).
    """
    tf_config = config.transformer_config(layout)
    if config.backend == "te" and config.apply_query_key_layer_scaling:
        # Transformer Engine reads query-key layer scaling from the environment only, and
        # megatron-core refuses a config that disagrees with it.
        os.environ["NVTE_APPLY_QK_LAYER_SCALING"] = "1"
    build_chunk = _hybrid_chunk if config.architecture == "hybrid" else _gpt_chunk
    chunks = []
    for vp_stage in range(layout.virtual_pipeline or 1):
        vp = vp_stage if layout.virtual_pipeline else None
        model = build_chunk(
            config,
            tf_config,
            layout,
            vp,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
        )
        if device is not None:
            model = model.to(device)
        chunks.append(model)
    return chunks


def _common_model_args(config: GPTModelConfig, vp: int | None) -> dict:
    return dict(
        vocab_size=config.vocab_size,
        max_sequence_length=model_derived.max_positions(config, config.seq_length),
        share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
        position_embedding_type=config.position_embedding_type,
        rotary_base=config.rotary_base,
        vp_stage=vp,
    )


def _layer_options(config: GPTModelConfig) -> dict:
    """What the GPT block spec and the hybrid stack spec are both built with."""
    return dict(
        norm_scaling=config.norm_scaling,
        backend=config.backend,
        norm_affine=config.norm_affine,
        qk_layernorm=config.qk_layernorm,
    )


def _gpt_chunk(
    config: GPTModelConfig,
    tf_config: TransformerConfig,
    layout: ParallelLayout,
    vp: int | None,
    **stage: bool,
) -> torch.nn.Module:
    """A ``GPTModel`` chunk: the only code that needs megatron-core's ``GPTModel``."""
    gpt_model = gpt_model_class()
    return gpt_model(
        config=tf_config,
        transformer_layer_spec=get_lns_block_spec(
            tf_config, vp_stage=vp, variant=config.variant_settings(), **_layer_options(config)
        ),
        **_common_model_args(config, vp),
        **stage,
    )


def gpt_model_class() -> type:
    """megatron-core's ``GPTModel``, deprecated in 0.19 in favour of ``HybridModel``; a
    release without it gets one clear error rather than an import traceback."""
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError as err:
        raise ArchitectureUnavailable(
            "the installed megatron-core has no GPTModel (megatron-core 0.19 deprecated it in "
            "favour of HybridModel): set model.architecture=hybrid, which builds the same LNS "
            "model and resumes its checkpoints (docs/hybrid.md), or install megatron-core "
            f"0.19 ({err})"
        ) from None
    return GPTModel


class ArchitectureUnavailable(UserError, ImportError):
    """The configured architecture's model class is not in the installed megatron-core: a
    user error (one ``error:`` line naming the fix), not a bug with a traceback."""


def _hybrid_chunk(
    config: GPTModelConfig,
    tf_config: TransformerConfig,
    layout: ParallelLayout,
    vp: int | None,
    **stage: bool,
) -> torch.nn.Module:
    """A ``HybridModel`` chunk with the LNS hybrid stack (``hybrid_specs.py``)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_lns.model.hybrid_specs import get_lns_hybrid_stack_spec

    if config.variant_settings().needs_variant_layer:
        raise ValueError(
            f"layer_variant={config.layer_variant!r} is built for the GPT architecture only; "
            "the hybrid stack has Pre-LN sublayers with or without LNS"
        )
    pattern = config.hybrid_stack_pattern(layout)
    return HybridModel(
        config=tf_config,
        hybrid_stack_spec=get_lns_hybrid_stack_spec(
            pattern,
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            **_layer_options(config),
        ),
        hybrid_layer_pattern=pattern,
        **_common_model_args(config, vp),
        **stage,
    )
