"""The NeMo-style experiment config as typed dataclasses.

Section and key names follow NeMo 1.x's ``megatron_gpt_config.yaml`` (``trainer``,
``exp_manager``, ``model`` with ``model.optim``, ``model.data``, ``model.tokenizer``),
so a NeMo user's YAML reads the same here. Every key listed is honoured; the
docstrings say what megatron-core setting each one drives (docs/configuration.md
is the reference). OmegaConf checks types against these annotations; the rule each
value must meet beyond its type is declared with it (``checked(default, rule)``, read
by ``rules.value_errors``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_lns.config.rules import (
    CHECK,
    adam_betas,
    checked,
    global_ranks,
    non_empty,
    non_negative,
    one_of,
    positive,
    probability,
    rampup_batch_sizes,
    rng_seed,
    signal_lead_seconds,
    split_weights,
)
from megatron_lns.data.tokenizer import TOKENIZER_LIBRARIES
from megatron_lns.model import (
    ACTIVATIONS,
    OUTPUT_LAYER_INITS,
    POSITION_EMBEDDINGS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
)
from megatron_lns.scaling import NORM_SCALING_CHOICES
from megatron_lns.variants import LAYER_VARIANTS

# The NeMo spellings a value may take, and what each means in megatron-core terms. The
# build (build.py) translates through these maps; validation checks
# values against their keys.
PRECISIONS = {
    "32": "fp32",
    "32-true": "fp32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "16": "fp16",
    "16-mixed": "fp16",
}
NORMALIZATIONS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm", "layernorm1p": "LayerNorm"}
SCHEDULES = {"CosineAnnealing": "cosine", "LinearAnnealing": "linear", "Constant": "constant"}
OPTIMIZERS = {
    "fused_adam": "adam",
    "adam": "adam",
    "adamw": "adam",
    "distributed_fused_adam": "adam",
    "sgd": "sgd",
}
ACCELERATORS = {"auto": "auto", "cpu": "cpu", "gpu": "cuda"}
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# model.optim.grad_sync_dtype: the dtype megatron DDP reduces gradients in.
GRAD_SYNC_DTYPES = ("fp32", "bf16", "fp16")
# Field metadata of a key whose value may be a mapping with keys of its own (checked by the
# key's own validation, not as config keys).
FREE_FORM = "free_form"
# model.ub_tp_comm_bootstrap_backend: the collectives that set up TE's userbuffers.
UB_BOOTSTRAP_BACKENDS = ("nccl", "mpi", "gloo")
# megatron.core.timers.Timers' log_option: the maximum over ranks, the minimum and maximum,
# or every rank's time.
TIMER_LOG_OPTIONS = ("max", "minmax", "all")


@dataclass
class TrainerConfig:
    num_nodes: int = checked(1, positive)
    devices: int = checked(1, positive)
    accelerator: str = checked("auto", one_of(ACCELERATORS))
    max_steps: int = checked(1000, positive)
    val_check_interval: int = checked(100, positive)
    limit_val_batches: int = checked(10, non_negative)
    log_every_n_steps: int = checked(10, positive)
    # bf16-mixed | 16-mixed | 32 (and NeMo spellings bf16, 16)
    precision: str = checked("bf16-mixed", one_of(PRECISIONS))
    gradient_clip_val: float = checked(1.0, non_negative)
    # Not in NeMo: Megatron-LM's --exit-interval. Checkpoint and exit when the step is a
    # multiple of it (time-sliced jobs; the next job resumes).
    exit_interval: int | None = checked(None, positive)


@dataclass
class CheckpointCallbackParams:
    every_n_train_steps: int = checked(1000, positive)
    save_last: bool = True
    # Write checkpoints in the background (megatron-core's asynchronous dist_checkpointing
    # save); a checkpoint counts once every rank has written it (docs/resuming.md).
    async_save: bool = False


@dataclass
class ExpManagerConfig:
    exp_dir: str | None = None  # null: ./runs (NeMo: ./nemo_experiments)
    name: str = checked("megatron_gpt", non_empty)
    resume_if_exists: bool = True
    # A checkpoint directory (iter_NNNNNNN) to resume from instead of the newest one.
    resume_from_checkpoint: str | None = None
    # Not in NeMo: when the newest complete checkpoint cannot be read, resume from the
    # newest one that can (each skipped one is named) instead of stopping.
    resume_past_unreadable: bool = False
    # Not in NeMo: Megatron-LM's --override-opt_param-scheduler. Resume with this config's
    # LR schedule and weight decay (lr, min_lr, warmup, decay style, max_steps) instead of
    # refusing a checkpoint whose schedule differs.
    override_opt_param_scheduler: bool = False
    create_tensorboard_logger: bool = True
    create_wandb_logger: bool = False
    wandb_logger_kwargs: dict[str, Any] = field(default_factory=dict)
    checkpoint_callback_params: CheckpointCallbackParams = field(
        default_factory=CheckpointCallbackParams
    )


@dataclass
class SchedConfig:
    name: str = checked("CosineAnnealing", one_of(SCHEDULES))
    warmup_steps: int = checked(0, non_negative)
    constant_steps: int = checked(0, non_negative)
    min_lr: float = checked(0.0, non_negative)


@dataclass
class OptimConfig:
    name: str = checked("fused_adam", one_of(OPTIMIZERS))
    lr: float = checked(1e-4, positive)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata={CHECK: adam_betas})
    eps: float = checked(1e-8, positive)
    weight_decay: float = checked(0.0, non_negative)
    sched: SchedConfig = field(default_factory=SchedConfig)
    # megatron DDP (fast_paths.py decides the null defaults: on CUDA on, on CPU off).
    overlap_grad_sync: bool | None = None  # overlap_grad_reduce
    overlap_param_sync: bool | None = None  # overlap_param_gather (distributed optimizer)
    bucket_cap_mb: float | None = checked(None, positive)  # DDP bucket_size, in MB of grads
    grad_sync_dtype: str | None = checked(None, one_of(GRAD_SYNC_DTYPES))  # null: fp32


@dataclass
class DataConfig:
    # [weight, prefix, weight, prefix, ...] or [prefix, ...] or a single prefix.
    # "builtin:pydoc" is the embedded demo corpus (prepared and cached on first use).
    data_prefix: list[Any] = field(default_factory=list)
    splits_string: str = checked("949,50,1", split_weights)
    seq_length: int = checked(512, positive)
    index_mapping_dir: str | None = None
    num_workers: int = checked(2, non_negative)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class TokenizerConfig:
    library: str = checked("byte", one_of(TOKENIZER_LIBRARIES))
    type: str | None = None  # huggingface: local directory of the tokenizer
    model: str | None = None  # sentencepiece: the .model file


@dataclass
class NsysProfileConfig:
    """A profiling window over training steps (``training/profiling.py``)."""

    enabled: bool = False
    # First and last profiled step, inclusive, numbered as logged (the first step is 1).
    start_step: int = checked(10, positive)
    end_step: int = checked(10, positive)
    ranks: list[int] = field(default_factory=lambda: [0], metadata={CHECK: global_ranks})
    gen_shape: bool = False  # record operator input shapes
    # Not in NeMo: also write a torch.profiler trace to <run_dir>/profile/. null: on CPU
    # yes, on CUDA no (nsys records the window there).
    torch_trace: bool | None = None


@dataclass
class MegatronTimerKwargs:
    """How megatron-core's own timers are reported (``training/timers.py``)."""

    log_every_n_steps: int | None = checked(None, positive)  # null: trainer.log_every_n_steps
    # max | minmax | all; null: minmax. NeMo's YAML spells it log_mode while NeMo's code
    # reads log_option: either key sets it.
    log_mode: str | None = checked(None, one_of(TIMER_LOG_OPTIONS))
    log_option: str | None = checked(None, one_of(TIMER_LOG_OPTIONS))
    barrier: bool = False  # a barrier on every rank before the times are read


@dataclass
class ModelConfig:
    micro_batch_size: int = checked(4, positive)
    global_batch_size: int = checked(8, positive)
    # Batch-size ramp-up (Megatron-LM's --rampup-batch-size): [start_batch_size,
    # batch_size_increment, ramp_up_samples]; null trains at global_batch_size throughout.
    rampup_batch_size: list[int] | None = field(default=None, metadata={CHECK: rampup_batch_sizes})
    tensor_model_parallel_size: int = checked(1, positive)
    pipeline_model_parallel_size: int = checked(1, positive)
    virtual_pipeline_model_parallel_size: int | None = checked(None, positive)
    sequence_parallel: bool = False

    encoder_seq_length: int = checked(512, positive)
    max_position_embeddings: int | None = checked(None, positive)
    num_layers: int = checked(12, positive)
    hidden_size: int = checked(768, positive)
    ffn_hidden_size: int | None = checked(None, positive)
    num_attention_heads: int = checked(12, positive)
    # The attention head size (megatron-core's kv_channels): the width of each query, key
    # and value head. null: hidden_size / num_attention_heads.
    kv_channels: int | None = checked(None, positive)
    num_query_groups: int | None = checked(None, positive)
    position_embedding_type: str = checked("rope", one_of(POSITION_EMBEDDINGS))
    rotary_base: int = checked(10000, positive)
    # rmsnorm | layernorm | layernorm1p (zero-centred gamma)
    normalization: str = checked("rmsnorm", one_of(NORMALIZATIONS))
    norm_affine: bool = True  # false: parameter-free norms (OLMo)
    layernorm_epsilon: float = checked(1e-5, positive)
    bias: bool = False
    activation: str = checked("swiglu", one_of(ACTIVATIONS))
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = checked(0.02, positive)
    hidden_dropout: float = checked(0.0, probability)
    attention_dropout: float = checked(0.0, probability)
    make_vocab_size_divisible_by: int = checked(128, positive)
    seed: int = checked(1234, rng_seed)

    # Activation recomputation: megatron-core's recompute_granularity / recompute_method /
    # recompute_num_layers. null | selective (core attention) | full (whole layers).
    activations_checkpoint_granularity: str | None = checked(None, one_of(RECOMPUTE_GRANULARITIES))
    # full only: uniform (every layer group of num_layers) | block (the first num_layers)
    activations_checkpoint_method: str | None = checked(None, one_of(RECOMPUTE_METHODS))
    activations_checkpoint_num_layers: int | None = checked(None, positive)
    # Megatron-LM's manual GC: Python's automatic collector off, gc.collect() every
    # gc_interval steps on every rank at once; 0 leaves automatic collection on.
    gc_interval: int = checked(0, non_negative)
    nsys_profile: NsysProfileConfig = field(default_factory=NsysProfileConfig)
    # Checkpoint I/O spread over the data-parallel ranks (megatron-core's fully parallel
    # save / load strategy wrappers): which rank writes or reads a replicated shard, not
    # what the checkpoint holds.
    dist_ckpt_parallel_save: bool = False
    dist_ckpt_parallel_load: bool = False
    # megatron-core's timers (pipeline schedule, communication, gradient sync, optimizer),
    # reported every megatron_timer_kwargs.log_every_n_steps steps.
    enable_megatron_timers: bool = False
    megatron_timer_kwargs: MegatronTimerKwargs = field(default_factory=MegatronTimerKwargs)

    # LayerNorm Scaling.
    norm_scaling: str = checked("lns", one_of(NORM_SCALING_CHOICES))
    # normal | scaled | depth_scaled (std/sqrt(2l) in layer l) | null (normal with LNS)
    output_layer_init: str | None = checked(None, one_of(OUTPUT_LAYER_INITS))
    # The LNS paper's baselines (docs/variants.md): pre_ln | post_ln | deepnorm | mix_ln |
    # layerscale | skipinit. norm_scaling=lns only with pre_ln, layerscale, skipinit.
    layer_variant: str = checked("pre_ln", one_of(LAYER_VARIANTS))
    mix_ln_post_fraction: float = checked(0.25, probability)  # Mix-LN: Post-LN layers' share
    layerscale_init: float = checked(1e-3, positive)  # LayerScale: initial per-channel scale

    # Performance and memory (docs/configuration.md#model-performance-and-memory). Fusion
    # and overlap switches left null are on where megatron-core and the installed kernels
    # run them (CUDA) and off on CPU (fast_paths.py).
    context_parallel_size: int = checked(1, positive)
    bias_activation_fusion: bool | None = None
    bias_dropout_add_fusion: bool | None = None
    masked_softmax_fusion: bool | None = None
    apply_rope_fusion: bool | None = None
    gradient_accumulation_fusion: bool | None = None
    cross_entropy_loss_fusion: bool | None = None
    use_flash_attention: bool | None = None  # TE's attention_backend: flash | fused | auto
    overlap_p2p_comm: bool = False  # interleaved pipeline only
    batch_p2p_comm: bool | None = None  # null: batched on NCCL, unbatched on gloo
    fp32_residual_connection: bool = False
    # NCCL SHARP: data-parallel reductions in the InfiniBand switches (megatron's use_sharp).
    sharp: bool = False
    # Tensor-parallel all-gather / reduce-scatter overlapped with the GEMMs through Transformer
    # Engine's userbuffers (megatron's tp_comm_overlap); needs sequence parallelism.
    ub_tp_comm_overlap: bool = False
    # Userbuffers settings per GEMM (qkv_fprop, fc2_dgrad, ...): a YAML file or the mapping
    # itself; null: Transformer Engine's defaults.
    ub_tp_comm_overlap_cfg: Any = field(default=None, metadata={FREE_FORM: True})
    ub_tp_comm_bootstrap_backend: str = checked("nccl", one_of(UB_BOOTSTRAP_BACKENDS))
    # Transformer Engine moves the activations of the first cpu_offloading_num_layers layers
    # to CPU memory after their forward and back before their backward (megatron's
    # cpu_offloading*); null: every layer but the last (NeMo's default).
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int | None = checked(None, non_negative)
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    apply_query_key_layer_scaling: bool = False
    do_layer_norm_weight_decay: bool = False  # true: weight decay on norms and biases too
    # fp16 dynamic loss scaling (megatron's OptimizerConfig).
    native_amp_init_scale: float = checked(2.0**32, positive)  # initial_loss_scale
    native_amp_growth_interval: int = checked(1000, positive)  # loss_scale_window
    hysteresis: int = checked(2, positive)

    # Transformer Engine and FP8 (GPU only).
    transformer_engine: bool = False
    # null | delayed | tensorwise | blockwise | mxfp8 (NeMo's boolean: false = null)
    fp8: str | None = checked(None, one_of(FP8_RECIPES))
    # hybrid (E4M3 forward, E5M2 gradients) | e4m3; null: hybrid (NeMo: fp8_hybrid/fp8_e4m3)
    fp8_format: str | None = checked(None, one_of(FP8_FORMATS))
    fp8_param: bool = False  # keep weights in FP8 too (else bf16 weights, fp32 main copy)
    fp8_margin: int = checked(0, non_negative)
    fp8_amax_history_len: int = checked(1024, positive)
    fp8_amax_compute_algo: str = checked("max", one_of(FP8_AMAX_COMPUTE_ALGOS))

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class ClusterConfig:
    """What SLURM needs to run the job (``megatron-lns submit``; ``train`` ignores it).

    Key names are NeMo-Launcher's cluster config and NeMo-Run's ``SlurmExecutor``.
    Nodes and tasks are not here: they are ``trainer.num_nodes`` and ``trainer.devices``
    (one task per GPU). docs/cluster.md says how each key reaches the sbatch script.
    """

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    # SLURM time as a quoted string: "1-12:00:00", "04:00:00", "90" (minutes). Typed Any
    # so that YAML's base-60 reading of an unquoted 4:00:00 (= 14400) is caught, not sent.
    time_limit: Any = None
    exclusive: bool = False
    # null: trainer.devices with accelerator=gpu, else none
    gpus_per_node: int | None = checked(None, non_negative)
    cpus_per_task: int | None = checked(None, positive)
    mem: str | None = None  # e.g. "0" (all of the node's memory), "200G"
    job_name_prefix: str = "megatron_lns-"  # job name: prefix + top-level `name`
    container_image: str | None = None  # pyxis/enroot: srun --container-image
    container_mounts: list[str] = field(default_factory=list)  # "src:dst[:flags]"
    env_vars: dict[str, str] = field(default_factory=dict)  # exported before srun (NCCL, ...)
    srun_args: list[str] = field(default_factory=list)  # one argument per item
    sbatch_args: list[str] = field(default_factory=list)  # one "#SBATCH" option per item
    dependency: str | None = None  # sbatch --dependency, e.g. "singleton", "afterok:123"
    # SLURM sends SIGUSR1 this long before the time limit; it must cover one training
    # step plus one checkpoint save. The job then saves, stops and requeues itself.
    preemption_signal_lead_s: int = checked(300, signal_lead_seconds)
    # Self-requeues after a preemption warning (SLURM_RESTART_COUNT).
    max_requeues: int = checked(5, non_negative)


@dataclass
class ExperimentConfig:
    name: str = "megatron_gpt"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
