"""The NeMo-style experiment config as typed dataclasses.

Section and key names follow NeMo 1.x's ``megatron_gpt_config.yaml`` (``trainer``,
``exp_manager``, ``model`` with ``model.optim``, ``model.data``, ``model.tokenizer``),
so a NeMo user's YAML reads the same here. Every key listed is honoured; the
docstrings say what megatron-core setting each one drives (docs/configuration.md
is the reference). OmegaConf checks types against these annotations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerConfig:
    num_nodes: int = 1
    devices: int = 1
    accelerator: str = "auto"  # auto | cpu | gpu
    max_steps: int = 1000
    val_check_interval: int = 100
    limit_val_batches: int = 10
    log_every_n_steps: int = 10
    precision: str = "bf16-mixed"  # bf16-mixed | 16-mixed | 32 (and NeMo spellings bf16, 16)
    gradient_clip_val: float = 1.0
    # Not in NeMo: Megatron-LM's --exit-interval. Checkpoint and exit when the step is a
    # multiple of it (time-sliced jobs; the next job resumes).
    exit_interval: int | None = None


@dataclass
class CheckpointCallbackParams:
    every_n_train_steps: int = 1000
    save_last: bool = True


@dataclass
class ExpManagerConfig:
    exp_dir: str | None = None  # null: ./runs (NeMo: ./nemo_experiments)
    name: str = "megatron_gpt"
    resume_if_exists: bool = True
    create_tensorboard_logger: bool = True
    create_wandb_logger: bool = False
    wandb_logger_kwargs: dict[str, Any] = field(default_factory=dict)
    checkpoint_callback_params: CheckpointCallbackParams = field(
        default_factory=CheckpointCallbackParams
    )


@dataclass
class SchedConfig:
    name: str = "CosineAnnealing"  # CosineAnnealing | LinearAnnealing | Constant
    warmup_steps: int = 0
    constant_steps: int = 0
    min_lr: float = 0.0


@dataclass
class OptimConfig:
    name: str = "fused_adam"  # fused_adam | adam | adamw | distributed_fused_adam | sgd
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    sched: SchedConfig = field(default_factory=SchedConfig)


@dataclass
class DataConfig:
    # [weight, prefix, weight, prefix, ...] or [prefix, ...] or a single prefix.
    # "builtin:pydoc" is the embedded demo corpus (prepared and cached on first use).
    data_prefix: list[Any] = field(default_factory=list)
    splits_string: str = "949,50,1"
    seq_length: int = 512
    index_mapping_dir: str | None = None
    num_workers: int = 2
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class TokenizerConfig:
    library: str = "byte"  # byte | huggingface | sentencepiece
    type: str | None = None  # huggingface: local directory of the tokenizer
    model: str | None = None  # sentencepiece: the .model file


@dataclass
class ModelConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 8
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False

    encoder_seq_length: int = 512
    max_position_embeddings: int | None = None
    num_layers: int = 12
    hidden_size: int = 768
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 12
    num_query_groups: int | None = None
    position_embedding_type: str = "rope"  # rope | learned_absolute
    rotary_base: int = 10000
    normalization: str = "rmsnorm"  # rmsnorm | layernorm | layernorm1p (zero-centred gamma)
    norm_affine: bool = True  # false: parameter-free norms (OLMo)
    layernorm_epsilon: float = 1e-5
    bias: bool = False
    activation: str = "swiglu"  # swiglu | gelu
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128
    seed: int = 1234

    # LayerNorm Scaling.
    norm_scaling: str = "lns"  # lns | none
    output_layer_init: str | None = None  # normal | scaled | null (normal with LNS)

    # Transformer Engine and FP8 (GPU only).
    transformer_engine: bool = False
    fp8: str | None = None  # null | delayed | tensorwise | blockwise | mxfp8
    fp8_format: str = "hybrid"  # hybrid (E4M3 forward, E5M2 gradients) | e4m3
    fp8_param: bool = False  # keep weights in FP8 too (else bf16 weights, fp32 main copy)
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"

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
    gpus_per_node: int | None = None  # null: trainer.devices with accelerator=gpu, else none
    cpus_per_task: int | None = None
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
    preemption_signal_lead_s: int = 300
    max_requeues: int = 5  # self-requeues after a preemption warning (SLURM_RESTART_COUNT)


@dataclass
class ExperimentConfig:
    name: str = "megatron_gpt"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
