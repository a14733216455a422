"""``model``'s speed and memory keys: activation recomputation, fused kernels, flash
attention, communication overlap, CPU offloading and fp16 loss scaling. None of them
changes what the model computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lns.config.choices import (
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
)
from megatron_lns.config.rules import (
    module_list,
    non_negative,
    one_of,
    positive,
)
from megatron_lns.config.settings import listed_in, setting, to

# model.ub_tp_comm_bootstrap_backend: the collectives that set up TE's userbuffers.
UB_BOOTSTRAP_BACKENDS = ("nccl", "mpi", "gloo")


def _module_names(value: Any, cfg: Any) -> dict[str, Any]:
    """A plain list; null leaves megatron-core's default (``[core_attn]``)."""
    return {} if value is None else {"recompute_modules": [str(v) for v in value]}


def cpu_offloading_num_layers(m: Any) -> int:
    """How many layers' activations go to CPU memory; null is NeMo's every layer but the
    last (whose backward follows its forward at once, so offloading it gains nothing)."""
    if not m.cpu_offloading:
        return 0
    if m.cpu_offloading_num_layers is None:
        return m.num_layers - 1
    return m.cpu_offloading_num_layers


def _cpu_offloading_num_layers(value: int | None, cfg: Any) -> dict[str, Any]:
    return {"cpu_offloading_num_layers": cpu_offloading_num_layers(cfg.model)}


@listed_in("recomputation")
@dataclass
class RecomputationSettings:
    """``model``'s activation-recomputation keys (the ``recomputation`` table)."""

    activations_checkpoint_granularity: str | None = setting(
        None,
        one_of(RECOMPUTE_GRANULARITIES),
        target="TransformerConfig.recompute_granularity",
        aliases=("recompute_granularity",),
    )
    """`recompute_granularity`: null keeps every activation; `selective` recomputes the core
    attention (softmax, dropout, attention x V) of every layer, megatron's default
    `recompute_modules: [core_attn]`, a small cost that saves the sequence-length-squared
    activations; `full` recomputes whole layers, chosen by the next two keys"""

    activations_checkpoint_method: str | None = setting(
        None,
        one_of(RECOMPUTE_METHODS),
        target="TransformerConfig.recompute_method",
        aliases=("recompute_method",),
    )
    """`recompute_method`, `full` only: `uniform` splits each pipeline stage's layers into groups of
    `num_layers` and keeps only each group's input; `block` recomputes the first `num_layers` layers
    of each stage (or virtual chunk) and keeps the rest"""

    activations_checkpoint_num_layers: int | None = setting(
        None,
        positive,
        target="TransformerConfig.recompute_num_layers",
        aliases=("recompute_num_layers",),
    )
    """`recompute_num_layers`, `full` only: 1 .. layers per pipeline stage. With `architecture:
    hybrid` it counts what `num_layers` counts: blocks in the GPT twin (passed to megatron-core
    doubled, as sublayers), sublayers with a pattern (at most the longest `|` segment's)"""

    recompute_modules: list[str] | None = setting(
        None,
        module_list(RECOMPUTE_MODULES),
        target="TransformerConfig",
        translate=_module_names,
        null_means="`[core_attn]`",
    )
    """`recompute_modules`, `selective` only: what megatron-core recomputes in backward:
    `core_attn`, `mlp` (a dense layer's MLP), `moe` (the whole MoE layer), `moe_act` (the experts'
    activation; needs `moe_grouped_gemm`), `shared_experts`, `layernorm` (the pre-norms, LNS factor
    included; needs `transformer_engine: true`, as megatron-core's CheckpointWithoutOutput reads
    Transformer Engine's FP8 state)"""


@listed_in("performance")
@dataclass
class PerformanceSettings:
    """``model``'s fused kernels, overlap, offloading and loss scaling (the
    ``performance`` table)."""

    bias_activation_fusion: bool | None = setting(
        None,
        target="TransformerConfig",
        policy="machine",
        training_only=True,
    )
    """`TransformerConfig.bias_activation_fusion`: the MLP's bias + activation (SwiGLU/GELU) as one
    TorchScript-fused function. Runs on CPU and CUDA; refused with `activation: gelu` and no bias
    (megatron-core fuses the bias into GELU). null: on with CUDA"""

    bias_dropout_add_fusion: bool | None = setting(
        None, target="TransformerConfig.bias_dropout_fusion", policy="machine", training_only=True
    )
    """`bias_dropout_fusion`: bias + dropout + residual add fused (TorchScript). null: on with
    CUDA"""

    masked_softmax_fusion: bool | None = setting(
        None, target="TransformerConfig", policy="machine", training_only=True
    )
    """`masked_softmax_fusion`: the local backend's `FusedScaleMaskSoftmax` uses Apex's
    `scaled_*_masked_softmax_cuda` kernels for half-precision CUDA inputs (it fails with an
    ImportError without them, so asking without them is refused). Transformer Engine's attention
    fuses its own softmax and does not read it. null: on with the local backend where the kernels
    are installed"""

    apply_rope_fusion: bool | None = setting(
        None, target="TransformerConfig", policy="machine", training_only=True
    )
    """`apply_rope_fusion`: Transformer Engine's fused RoPE kernel (megatron-core refuses it without
    TE; needs `position_embedding_type: rope`). null: on with `transformer_engine: true` on CUDA"""

    gradient_accumulation_fusion: bool | None = setting(
        None,
        target="TransformerConfig",
        policy="machine",
        training_only=True,
    )
    """`gradient_accumulation_fusion`: weight-gradient GEMMs accumulate straight into megatron DDP's
    fp32 `main_grad` buffer. Needs Apex's `fused_weight_gradient_mlp_cuda` on either backend
    (megatron-core's output layer is a `ColumnParallelLinear` that calls it). null: on where that
    kernel is installed"""

    cross_entropy_loss_fusion: bool | None = setting(
        None,
        target="TransformerConfig",
        policy="machine",
        training_only=True,
    )
    """`cross_entropy_loss_fusion` with megatron-core's `native` implementation (TorchScript; the
    `te` one has known stability issues). null: on with CUDA"""

    use_flash_attention: bool | None = setting(
        None, target="TransformerConfig.attention_backend", policy="machine", training_only=True
    )
    """`TransformerConfig.attention_backend` of the TE spec: true `flash` (FlashAttention), false
    `fused` (cuDNN fused attention, no FlashAttention: NeMo's false), null `auto` (TE picks per GPU
    and shape). True needs `transformer_engine: true` (the local backend's attention is
    megatron-core's unfused `DotProductAttention`)"""

    overlap_p2p_comm: bool = setting(False, target="TransformerConfig")
    """`overlap_p2p_comm`: pipeline send/receive overlap compute; megatron-core does it in the
    interleaved schedule only, so it needs `virtual_pipeline_model_parallel_size`"""

    batch_p2p_comm: bool | None = setting(
        None, target="TransformerConfig", policy="machine", training_only=True
    )
    """`batch_p2p_comm`: send/receive batched with `batch_isend_irecv`. Cannot be on with
    `overlap_p2p_comm`. On gloo (CPU) with a pipeline it is refused: gloo matches batched sends and
    receives between the same two ranks FIFO and can swap activations with gradients (silently wrong
    loss). null: on, except on gloo or with `overlap_p2p_comm`"""

    fp32_residual_connection: bool = setting(False, target="TransformerConfig")
    """`fp32_residual_connection`: the residual stream in fp32 (megatron-core then sends fp32
    between pipeline stages)"""

    sharp: bool = setting(False, target="ParallelLayout")
    """`initialize_model_parallel(use_sharp=True)`: megatron-core creates the data-parallel NCCL
    communicator first with `NCCL_COLLNET_ENABLE=1`, so its reductions run in the InfiniBand
    switches (SHARP). Needs NCCL on CUDA GPUs (refused at launch on gloo) and a fabric with SHARP
    (on SLURM often `cluster.sbatch_args: ["--network=sharp"]`); NCCL falls back to ordinary
    collectives where the switch has no SHARP groups left"""

    ub_tp_comm_overlap: bool = setting(
        False, target="TransformerConfig.tp_comm_overlap", training_only=True
    )
    """`TransformerConfig.tp_comm_overlap`: Transformer Engine's linears overlap the
    sequence-parallel all-gather and reduce-scatter with their GEMMs through userbuffers, which the
    trainer allocates before building the model (TE's `initialize_ub`, shape (encoder_seq_length x
    micro_batch_size / context_parallel_size, hidden_size), FP8 buffers with `model.fp8`), as
    Megatron-LM's `_initialize_tp_communicators` does. Needs `transformer_engine: true` and
    `sequence_parallel: true` (so TP > 1). Checked against a stand-in with TE 2.8-2.18's
    `initialize_ub` signature; not run on a GPU yet"""

    ub_tp_comm_overlap_cfg: Any = setting(None, free_form=True)
    """TE's `ub_cfgs`: per-GEMM userbuffer settings (`method`, `num_sm`, `cga_size`, `num_splits`,
    `set_sm_margin`, `aggregate`, `atomic_gemm`, `fp8_buf`, ...) keyed by GEMM (`qkv_fprop`,
    `qkv_dgrad`, `qkv_wgrad`, `proj_fprop`, `proj_dgrad`, `proj_wgrad`, `fc1_fprop`, `fc1_dgrad`,
    `fc1_wgrad`, `fc2_fprop`, `fc2_dgrad`, `fc2_wgrad`), as the path of a YAML file (NeMo's
    `ub_cfg_*.yaml`) or the mapping itself. null: TE's defaults. GEMM names TE does not know are
    refused (TE would skip them silently); NeMo's Hydra group
    `tp_overlap@model.ub_tp_comm_overlap_cfg` is not composed, give the file's path instead"""

    ub_tp_comm_bootstrap_backend: str = setting(
        "nccl",
        one_of(UB_BOOTSTRAP_BACKENDS),
        target="TransformerConfig.tp_comm_bootstrap_backend",
        training_only=True,
    )
    """`tp_comm_bootstrap_backend`: the collectives (`nccl`, `mpi` or `gloo`) TE uses to set
    userbuffers up"""

    cpu_offloading: bool = setting(False, target="TransformerConfig", training_only=True)
    """`TransformerConfig.cpu_offloading`: Transformer Engine's offload context moves the
    activations saved for backward of the first `cpu_offloading_num_layers` layers to CPU memory
    during forward and back before their backward, overlapped with compute. Needs
    `transformer_engine: true`; megatron-core refuses it with pipeline parallelism and with
    recomputation, and so does validation (by key). `tests/gpu/test_gpu.py` checks that it leaves
    loss and gradients unchanged (needs a GPU with TE; not run yet)"""

    cpu_offloading_num_layers: int | None = setting(
        None,
        non_negative,
        target="TransformerConfig",
        translate=_cpu_offloading_num_layers,
        training_only=True,
    )
    """`cpu_offloading_num_layers`, 1 to `num_layers - 1` (the last layer's activations are used at
    once). null: `num_layers - 1`, NeMo's `${sum:${.num_layers},-1}` (the `sum` resolver is
    registered)"""

    cpu_offloading_activations: bool = setting(True, target="TransformerConfig", training_only=True)
    """`cpu_offloading_activations`; false offloads nothing and is refused"""

    cpu_offloading_weights: bool = setting(False, target="TransformerConfig", training_only=True)
    """`cpu_offloading_weights`: true is refused. Transformer Engine deprecated weight offloading in
    2.3 and ignores the flag with a warning (megatron-lns needs TE >= 2.8). NeMo's YAML sets it
    true: set it to false together with `cpu_offloading: true`"""

    apply_query_key_layer_scaling: bool = setting(False, target="TransformerConfig")
    """`apply_query_key_layer_scaling`: attention scores divided by the layer number before the
    (then fp32) softmax and multiplied back, for fp16 range"""

    do_layer_norm_weight_decay: bool = setting(
        False,
        target="get_megatron_optimizer.config_overrides",
        translate=to("decay_norms_and_biases"),
        resume="optimizer",
    )
    """weight decay on every parameter. false is megatron's standard `config_overrides`, which
    exempts biases and 1-D tensors (norm weights); true passes none
    (`get_megatron_optimizer(config_overrides={})`)"""

    native_amp_init_scale: float = setting(
        2.0**32, positive, target="OptimizerConfig.initial_loss_scale"
    )
    """`OptimizerConfig.initial_loss_scale` of fp16 dynamic loss scaling"""

    native_amp_growth_interval: int = setting(
        1000, positive, target="OptimizerConfig.loss_scale_window"
    )
    """`OptimizerConfig.loss_scale_window`: overflow-free steps before the scale doubles"""

    hysteresis: int = setting(2, positive, target="OptimizerConfig")
    """`OptimizerConfig.hysteresis`: overflows tolerated before the scale halves"""
