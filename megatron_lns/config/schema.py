"""The NeMo-style experiment config as typed dataclasses, one declaration per key.

Section and key names follow NeMo 1.x's ``megatron_gpt_config.yaml`` (``trainer``,
``exp_manager``, ``model`` with ``model.optim``, ``model.data``, ``model.tokenizer``),
so a NeMo user's YAML reads the same here. Every key is declared once, with
``settings.setting``: its default, the rule its value must meet beyond its type, where
it goes in megatron-core, how its null default is decided and what it means. Validation,
the megatron-core configs (``build.py``), the NeMo aliases (``nemo_compat.py``) and the key
tables of docs/configuration.md are derived from these declarations. A value that needs
translating rather than passing through names a small function defined here, above the
dataclasses. OmegaConf checks types against the annotations.

Nothing here imports torch or megatron-core (``tests/config/test_light_imports.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_lns.config.choices import (
    ACTIVATIONS,
    ARCHITECTURES,
    LAYER_VARIANTS,
    MOE_DISPATCHERS,
    MOE_DROP_POLICIES,
    MOE_LOAD_BALANCING,
    MOE_ROUTER_DTYPES,
    MOE_SCORE_FUNCTIONS,
    NORM_SCALING_CHOICES,
    OUTPUT_LAYER_INITS,
    POSITION_EMBEDDINGS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
)
from megatron_lns.config.moe_layers import parse_moe_layer_freq
from megatron_lns.config.rules import (
    adam_betas,
    global_ranks,
    module_list,
    moe_layer_frequency,
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
from megatron_lns.config.settings import setting
from megatron_lns.data.tokenizer import TOKENIZER_LIBRARIES

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
# model.ub_tp_comm_bootstrap_backend: the collectives that set up TE's userbuffers.
UB_BOOTSTRAP_BACKENDS = ("nccl", "mpi", "gloo")
# megatron.core.timers.Timers' log_option: the maximum over ranks, the minimum and maximum,
# or every rank's time.
TIMER_LOG_OPTIONS = ("max", "minmax", "all")


# Translations: the value a key gives its target, where that is not the value itself.
# Each takes (value, whole config) and returns {target field: value}.


def to(target_field: str):
    """The value unchanged, under the name its target uses (``bias`` -> ``add_bias_linear``
    is GPTModelConfig's ``bias``, which sets both of megatron-core's bias switches)."""
    return lambda value, cfg: {target_field: value}


def _precision(value: Any, cfg: Any) -> dict[str, Any]:
    return {"precision": PRECISIONS[str(value)]}


def _clip_grad(value: Any, cfg: Any) -> dict[str, Any]:
    return {"clip_grad": float(value or 0.0)}


def _normalization(value: str, cfg: Any) -> dict[str, Any]:
    """layernorm1p is LayerNorm with zero-centred gamma (``1 + g``)."""
    return {
        "normalization": NORMALIZATIONS[value],
        "layernorm_zero_centered_gamma": value == "layernorm1p",
    }


def _backend(value: bool, cfg: Any) -> dict[str, Any]:
    return {"backend": "te" if value else "local"}


def _fp8_format(value: str | None, cfg: Any) -> dict[str, Any]:
    return {"fp8_format": value or "hybrid"}


def _moe_layer_freq(value: Any, cfg: Any) -> dict[str, Any]:
    """Plain Python for megatron-core: the int, or the list (an expression evaluated)."""
    return {"moe_layer_freq": parse_moe_layer_freq(value)}


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


def uses_distributed_optimizer(cfg: Any) -> bool:
    """NeMo names the distributed optimizer as an optimizer of its own."""
    return cfg.model.optim.name == "distributed_fused_adam"


def _optimizer(value: str, cfg: Any) -> dict[str, Any]:
    return {"name": OPTIMIZERS[value], "use_distributed_optimizer": uses_distributed_optimizer(cfg)}


def _betas(value: list[float], cfg: Any) -> dict[str, Any]:
    return {"betas": (float(value[0]), float(value[1]))}


def _decay_style(value: str, cfg: Any) -> dict[str, Any]:
    return {"decay_style": SCHEDULES[value]}


def _decay_steps(constant_steps: int, cfg: Any) -> dict[str, Any]:
    """The decay ends ``constant_steps`` before ``trainer.max_steps``."""
    return {"decay_steps": cfg.trainer.max_steps - constant_steps}


def _grad_reduce_in_fp32(value: str | None, cfg: Any) -> dict[str, Any]:
    return {"grad_reduce_in_fp32": (value or "fp32") == "fp32"}


def _bucket_size(value: float | None, cfg: Any) -> dict[str, Any]:
    """megatron counts a bucket in parameters; NeMo sizes it in MB of reduced gradients."""
    if value is None:
        return {"bucket_size": None}
    reduce_in_fp32 = _grad_reduce_in_fp32(cfg.model.optim.grad_sync_dtype, cfg)[
        "grad_reduce_in_fp32"
    ]
    return {"bucket_size": int(value * 2**20 / (4 if reduce_in_fp32 else 2))}


@dataclass
class TrainerConfig:
    num_nodes: int = setting(
        1,
        positive,
        doc="nodes; world size = `num_nodes x devices` (must equal the launcher's `WORLD_SIZE`)",
    )
    devices: int = setting(
        1,
        positive,
        doc=(
            "processes per node (GPUs, or CPU ranks with gloo); on one node megatron-lns spawns "
            "them itself"
        ),
    )
    accelerator: str = setting(
        "auto",
        one_of(ACCELERATORS),
        doc="`gpu` (NCCL), `cpu` (gloo + the CPU compatibility layer) or `auto`",
    )
    max_steps: int = setting(
        1000, positive, doc="optimizer steps; also the length of the lr schedule"
    )
    val_check_interval: int = setting(100, positive, doc="validate every N steps (and at the end)")
    limit_val_batches: int = setting(
        10,
        non_negative,
        doc=(
            "global batches of the validation split per validation (always the same ones); 0 "
            "disables validation"
        ),
    )
    log_every_n_steps: int = setting(
        10, positive, doc="console / TensorBoard / `metrics.jsonl` interval"
    )
    precision: str = setting(
        "bf16-mixed",
        one_of(PRECISIONS),
        target="TransformerConfig.params_dtype",
        translate=_precision,
        doc=(
            "`bf16-mixed`/`bf16`: `TransformerConfig.bf16` + `Float16Module` + megatron's "
            "mixed-precision optimizer with fp32 main weights; `16-mixed`/`16`: the same in fp16 "
            "with dynamic loss scaling; `32`: fp32"
        ),
    )
    gradient_clip_val: float = setting(
        1.0,
        non_negative,
        target="OptimizerConfig.clip_grad",
        translate=_clip_grad,
        doc=(
            "`OptimizerConfig.clip_grad` (global-norm clipping across all model-parallel ranks); "
            "0 disables"
        ),
    )
    rendezvous_timeout_s: float = setting(
        600.0,
        positive,
        doc=(
            "not in NeMo: seconds each rank waits at start-up for the others to join rank 0's "
            "TCP store (`MASTER_ADDR:MASTER_PORT`) before it ends naming whom it waited for; "
            "SIGTERM or Ctrl-C during the wait ends it at once. Collectives keep torch's "
            "timeouts"
        ),
    )
    exit_interval: int | None = setting(
        None,
        positive,
        doc=(
            "not in NeMo: Megatron-LM's `--exit-interval`, checkpoint and exit when the step is a"
            " multiple of it"
        ),
    )


@dataclass
class CheckpointCallbackParams:
    every_n_train_steps: int = setting(
        1000, positive, doc="checkpoint interval (`dist_checkpointing`, torch_dist format)"
    )
    save_last: bool = setting(True, doc="also checkpoint at the end of training")
    async_save: bool = setting(
        False,
        doc=(
            "write checkpoints in the background: megatron-core's asynchronous "
            "`dist_checkpointing.save` (its `AsyncCallsQueue`; Megatron-LM's `--async-save`). A "
            "save stalls training only while the state is taken (copied to host memory on GPU; a "
            "`fork` on CPU); each rank's shards are written by a process it forks, and the "
            "checkpoint counts (`complete.json`, `iter_N.partial` renamed to `iter_N`) only once "
            "every rank has finished. The run waits for a pending save before the next one and "
            "before it stops or ends. Host memory holds one more copy of the rank's state while a"
            " save is written. See [resuming.md](resuming.md#asynchronous-and-parallel-saves)"
        ),
    )


@dataclass
class ExpManagerConfig:
    exp_dir: str | None = setting(None, null_means="`runs`", doc="root of experiment directories")
    name: str = setting(
        "megatron_gpt",
        non_empty,
        doc=(
            "run directory `<exp_dir>/<name>/` with `config.yaml`, `metrics.jsonl`, "
            "`tensorboard/`, `checkpoints/` (`metrics.jsonl`: every step's loss, the full metrics"
            " every `log_every_n_steps`)"
        ),
    )
    resume_if_exists: bool = setting(
        True,
        doc=(
            "resume from the newest **complete** checkpoint in `checkpoints/` (partial saves are "
            "never picked); false refuses a directory that already holds a run (see "
            "[resuming.md](resuming.md))"
        ),
    )
    resume_from_checkpoint: str | None = setting(
        None,
        doc=(
            "an `iter_NNNNNNN` checkpoint directory to resume from instead of the newest; "
            "once: a rerun of the same command continues the branch it started (see "
            "[resuming.md](resuming.md))"
        ),
    )
    resume_past_unreadable: bool = setting(
        False,
        doc=(
            "not in NeMo: if the newest complete checkpoint cannot be read, resume from the "
            "newest one that can"
        ),
    )
    override_opt_param_scheduler: bool = setting(
        False,
        doc=(
            "not in NeMo: Megatron-LM's `--override-opt_param-scheduler`; resume with this "
            "config's LR schedule and weight decay instead of refusing a changed one"
        ),
    )
    create_tensorboard_logger: bool = setting(True, doc="TensorBoard scalars under `tensorboard/`")
    create_wandb_logger: bool = setting(
        False, doc="Weights & Biases, if `wandb` is installed (a message says so if not)"
    )
    wandb_logger_kwargs: dict[str, Any] = setting(
        default_factory=dict, doc="passed to `wandb.init` (`project`, `name`, ...)"
    )
    checkpoint_callback_params: CheckpointCallbackParams = field(
        default_factory=CheckpointCallbackParams
    )


@dataclass
class SchedConfig:
    name: str = setting(
        "CosineAnnealing",
        one_of(SCHEDULES),
        target="OptimizerParamScheduler.lr_decay_style",
        translate=_decay_style,
        doc=(
            "`OptimizerParamScheduler` decay style: `CosineAnnealing` -> cosine, "
            "`LinearAnnealing` -> linear, `Constant` -> constant"
        ),
    )
    warmup_steps: int = setting(
        0,
        non_negative,
        target="OptimizerParamScheduler.lr_warmup_steps",
        translate=to("warmup_steps"),
        doc="linear warmup steps",
    )
    constant_steps: int = setting(
        0,
        non_negative,
        target="OptimizerParamScheduler.lr_decay_steps",
        translate=_decay_steps,
        doc="steps held at `min_lr` at the end (decay spans `max_steps - constant_steps`)",
    )
    min_lr: float = setting(
        0.0, non_negative, target="OptimizerConfig.min_lr", doc="final learning rate"
    )


@dataclass
class OptimConfig:
    name: str = setting(
        "fused_adam",
        one_of(OPTIMIZERS),
        target="OptimizerConfig.optimizer",
        translate=_optimizer,
        doc=(
            "`fused_adam`, `adam`, `adamw`: megatron's `adam` (decoupled weight decay, i.e. "
            "AdamW); `distributed_fused_adam`: the same with the distributed optimizer "
            "(`use_distributed_optimizer`); `sgd`"
        ),
    )
    lr: float = setting(1e-4, positive, target="OptimizerConfig.lr", doc="peak learning rate")
    betas: list[float] = setting(
        check=adam_betas,
        default_factory=lambda: [0.9, 0.95],
        target="OptimizerConfig.adam_beta1",
        translate=_betas,
        doc="`adam_beta1`, `adam_beta2`",
    )
    eps: float = setting(
        1e-8, positive, target="OptimizerConfig.adam_eps", translate=to("eps"), doc="`adam_eps`"
    )
    weight_decay: float = setting(
        0.0, non_negative, target="OptimizerConfig.weight_decay", doc="`weight_decay`"
    )
    sched: SchedConfig = field(default_factory=SchedConfig)
    overlap_grad_sync: bool | None = setting(
        None,
        target="DistributedDataParallelConfig.overlap_grad_reduce",
        policy="machine",
        doc=(
            "`DistributedDataParallelConfig.overlap_grad_reduce`: each gradient bucket's "
            "all-reduce (reduce-scatter with the distributed optimizer) starts as soon as "
            "backward has filled it. Runs on gloo too. null: on with CUDA"
        ),
    )
    overlap_param_sync: bool | None = setting(
        None,
        target="DistributedDataParallelConfig.overlap_param_gather",
        policy="machine",
        doc=(
            "`overlap_param_gather`: the distributed optimizer's all-gather of updated weights "
            "overlaps the next forward pass (forward pre-hooks); before a checkpoint the weights "
            "are gathered synchronously. Needs `name: distributed_fused_adam` and "
            "`overlap_grad_sync`. null: on with CUDA and the distributed optimizer"
        ),
    )
    bucket_cap_mb: float | None = setting(
        None,
        positive,
        target="DistributedDataParallelConfig.bucket_size",
        translate=_bucket_size,
        doc=(
            "`bucket_size` = MB x 2^20 / bytes per reduced gradient (4 in fp32, 2 in bf16/fp16); "
            "null is megatron's max(40M, 1M x DP) parameters. Needs `overlap_grad_sync` (without "
            "overlap megatron DDP reduces everything in one bucket, so a size would be ignored)"
        ),
    )
    grad_sync_dtype: str | None = setting(
        None,
        one_of(GRAD_SYNC_DTYPES),
        target="DistributedDataParallelConfig.grad_reduce_in_fp32",
        translate=_grad_reduce_in_fp32,
        null_means="`fp32`",
        doc=(
            "`grad_reduce_in_fp32`: `fp32` accumulates and reduces gradients in fp32; `bf16` / "
            "`fp16` in the model's dtype (half the buffer and traffic), only with the matching "
            "`trainer.precision`"
        ),
    )


@dataclass
class DataConfig:
    data_prefix: list[Any] = setting(
        default_factory=list,
        target="GPTDatasetConfig.blend",
        doc=(
            "`[prefix, ...]` or `[weight, prefix, weight, prefix, ...]`: "
            "`GPTDatasetConfig.blend`; `builtin:pydoc` is the embedded demo corpus"
        ),
    )
    splits_string: str = setting(
        "949,50,1",
        split_weights,
        target="GPTDatasetConfig.split",
        doc=(
            "train/valid/test document split, three non-negative numbers, the train weight "
            "positive (`GPTDatasetConfig.split`)"
        ),
    )
    seq_length: int = setting(
        512,
        positive,
        target="GPTDatasetConfig.sequence_length",
        doc="must equal `model.encoder_seq_length` (NeMo interpolates it)",
    )
    index_mapping_dir: str | None = setting(
        None,
        target="GPTDatasetConfig.path_to_cache",
        doc="where `BlendedMegatronDatasetBuilder` caches its index mappings (`path_to_cache`)",
    )
    num_workers: int = setting(2, non_negative, doc="`torch` DataLoader workers per rank")
    reset_position_ids: bool = setting(
        False,
        target="GPTDatasetConfig.reset_position_ids",
        doc="`GPTDatasetConfig.reset_position_ids`",
    )
    reset_attention_mask: bool = setting(
        False,
        target="GPTDatasetConfig.reset_attention_mask",
        doc="`GPTDatasetConfig.reset_attention_mask`",
    )
    eod_mask_loss: bool = setting(
        False, target="GPTDatasetConfig.eod_mask_loss", doc="`GPTDatasetConfig.eod_mask_loss`"
    )


@dataclass
class TokenizerConfig:
    library: str = setting(
        "byte",
        one_of(TOKENIZER_LIBRARIES),
        doc="`byte` (UTF-8 bytes + EOD, vocab 257), `huggingface`, `sentencepiece`",
    )
    type: str | None = setting(
        None, doc="Hugging Face: a local tokenizer directory (never downloaded)"
    )
    model: str | None = setting(None, doc="SentencePiece: the `.model` file")


@dataclass
class NsysProfileConfig:
    """A profiling window over training steps (``training/profiling.py``)."""

    enabled: bool = setting(
        False,
        group="operations",
        doc=(
            "profile the window below (`training/profiling.py`). On CUDA: "
            "`torch.cuda.profiler.start()`/`stop()` around the window, for `nsys profile "
            "--capture-range=cudaProfilerApi --capture-range-end=stop`, an NVTX range `step N` "
            "per step and, via `torch.autograd.profiler.emit_nvtx`, one per operator. A PyTorch "
            "profiler trace (Chrome trace format; Perfetto or chrome://tracing) goes to "
            "`<run_dir>/profile/rank<R>_steps<A>-<B>.json`, see `torch_trace`"
        ),
    )
    start_step: int = setting(
        10,
        positive,
        group="operations",
        doc=(
            "first profiled step, numbered as the log numbers steps (the first step is 1; NeMo "
            "counts completed steps, so its 10 is step 11 here). A run resumed inside the window "
            "profiles the rest of it; one stopped inside it writes what it profiled"
        ),
    )
    end_step: int = setting(
        10,
        positive,
        group="operations",
        doc=(
            "last profiled step (inclusive); refused if before `start_step`, and a `start_step` "
            "after `trainer.max_steps` is refused"
        ),
    )
    ranks: list[int] = setting(
        check=global_ranks,
        default_factory=lambda: [0],
        group="operations",
        doc="global ranks that profile; refused if not ranks of the run",
    )
    gen_shape: bool = setting(
        False,
        group="operations",
        doc=(
            "record operator input shapes (`record_shapes` of the NVTX ranges and of the torch "
            "trace)"
        ),
    )
    torch_trace: bool | None = setting(
        None,
        group="operations",
        doc=(
            "not in NeMo: write the torch profiler trace (CPU and CUDA activity on a GPU). null: "
            "on CPU yes, on CUDA no (nsys records the window). The autograd profiler records one "
            "way at a time, so with a torch trace on CUDA the per-operator NVTX ranges are left "
            "out (the step ranges and the capture window stay)"
        ),
    )


@dataclass
class MegatronTimerKwargs:
    """How megatron-core's own timers are reported (``training/timers.py``)."""

    log_every_n_steps: int | None = setting(
        None,
        positive,
        group="operations",
        doc=(
            "report after every N-th applied update (step numbers, so a resumed run keeps the "
            "grid); null: `trainer.log_every_n_steps`. An interval longer than "
            "`trainer.max_steps` is refused (no report would be made)"
        ),
    )
    log_mode: str | None = setting(
        None,
        one_of(TIMER_LOG_OPTIONS),
        group="operations",
        doc=(
            "megatron's `log_option`: `minmax` (the fastest and slowest rank), `max`, or `all` "
            "(every rank); null: `minmax`. NeMo's YAML spells the key `log_mode` while NeMo's "
            "code reads `log_option`: either key sets it, and the two set differently are refused"
        ),
    )
    log_option: str | None = setting(
        None, one_of(TIMER_LOG_OPTIONS), group="operations", doc="the same setting as `log_mode`"
    )
    barrier: bool = setting(
        False,
        group="operations",
        doc=(
            "a barrier across all ranks before the times are read (megatron's "
            "`get_all_timers_string(barrier=...)`)"
        ),
    )


@dataclass
class ModelConfig:
    micro_batch_size: int = setting(
        4, positive, group="parallelism", doc="sequences per forward pass per data-parallel rank"
    )
    global_batch_size: int = setting(
        8,
        positive,
        group="parallelism",
        doc=(
            "sequences per optimizer step; megatron's num-microbatches calculator derives "
            "gradient accumulation = global / (micro x DP)"
        ),
    )
    rampup_batch_size: list[int] | None = setting(
        None,
        rampup_batch_sizes,
        group="parallelism",
        doc=(
            "`[start_batch_size, batch_size_increment, ramp_up_samples]`: batch-size ramp-up, "
            "Megatron-LM's `--rampup-batch-size` (below)"
        ),
    )
    tensor_model_parallel_size: int = setting(
        1,
        positive,
        target="ParallelLayout.tensor",
        group="parallelism",
        doc="`TransformerConfig.tensor_model_parallel_size`",
    )
    pipeline_model_parallel_size: int = setting(
        1,
        positive,
        target="ParallelLayout.pipeline",
        group="parallelism",
        doc="`pipeline_model_parallel_size`; layers split evenly across stages",
    )
    virtual_pipeline_model_parallel_size: int | None = setting(
        None,
        positive,
        target="ParallelLayout.virtual_pipeline",
        group="parallelism",
        doc="model chunks per pipeline stage (interleaved 1F1B schedule)",
    )
    sequence_parallel: bool = setting(
        False,
        target="ParallelLayout.sequence_parallel",
        group="parallelism",
        doc=(
            "megatron sequence parallelism (needs TP > 1); LNS norms mark their weights for the "
            "TP grad all-reduce"
        ),
    )

    encoder_seq_length: int = setting(
        512,
        positive,
        target="GPTModel.max_sequence_length",
        translate=to("seq_length"),
        group="architecture",
        doc="training sequence length (`GPTModel` / `GPTDataset` sequence length)",
    )
    max_position_embeddings: int | None = setting(
        None,
        positive,
        target="GPTModel.max_sequence_length",
        translate=to("max_position_embeddings"),
        null_means="= seq length",
        group="architecture",
        doc="`GPTModel.max_sequence_length`",
    )
    num_layers: int = setting(
        12,
        positive,
        target="TransformerConfig.num_layers",
        group="architecture",
        doc="`TransformerConfig.num_layers`",
    )
    architecture: str = setting(
        "gpt",
        one_of(ARCHITECTURES),
        target="layer_spec.architecture",
        group="architecture",
        doc=(
            "megatron-core's model class: `gpt` (`GPTModel`, deprecated in megatron-core 0.19) "
            "or `hybrid` (`HybridModel`, its successor: one module per sublayer of "
            "`hybrid_layer_pattern`). Without a pattern, `hybrid` builds the GPT model's twin "
            "(`*-` per layer, `*E` where `moe_layer_freq` puts experts), which computes the same "
            "function and resumes its checkpoints; LNS's depth is the paper's block index in both"
        ),
    )
    hybrid_layer_pattern: str | None = setting(
        None,
        target="HybridModel.hybrid_layer_pattern",
        aliases=("hybrid_override_pattern",),
        null_means="the GPT twin",
        group="architecture",
        doc=(
            "`architecture: hybrid` only: one symbol per sublayer, `*` attention, `-` MLP, `E` "
            "MoE, `|` between pipeline segments (one per stage and virtual chunk); `num_layers` "
            "then counts sublayers, as in megatron-core. An attention starts LNS block `l`; the "
            "MLP/MoE sublayers after it share its `l` (docs/design.md). Mamba (`M`), GDN (`G`), "
            "DSA (`D`), MLA (`+`) and MTP (`/`) are refused"
        ),
    )
    hidden_size: int = setting(
        768,
        positive,
        target="TransformerConfig.hidden_size",
        group="architecture",
        doc="`hidden_size`",
    )
    ffn_hidden_size: int | None = setting(
        None,
        positive,
        target="TransformerConfig.ffn_hidden_size",
        null_means="4 x hidden",
        group="architecture",
        doc="`ffn_hidden_size` (per gate/up half with SwiGLU)",
    )
    num_attention_heads: int = setting(
        12,
        positive,
        target="TransformerConfig.num_attention_heads",
        group="architecture",
        doc="`num_attention_heads`",
    )
    kv_channels: int | None = setting(
        None,
        positive,
        target="TransformerConfig.kv_channels",
        null_means="= hidden / heads",
        group="architecture",
        doc=(
            "`kv_channels`: the attention head size; queries, keys and values are `heads x "
            "kv_channels` wide, so attention may be wider or narrower than `hidden_size` (which "
            "then need not divide by the heads). With RoPE it must be even. Hugging Face export "
            "writes it as Llama's `head_dim`; StableLM has no head size of its own, so a "
            "LayerNorm model with another head size is refused"
        ),
    )
    num_query_groups: int | None = setting(
        None,
        positive,
        target="TransformerConfig.num_query_groups",
        null_means="= heads",
        group="architecture",
        doc="`num_query_groups` (grouped-query attention)",
    )
    position_embedding_type: str = setting(
        "rope",
        one_of(POSITION_EMBEDDINGS),
        target="GPTModel.position_embedding_type",
        group="architecture",
        doc="`rope` (rotate-half, as Hugging Face Llama) or `learned_absolute`",
    )
    rotary_base: int = setting(
        10000, positive, target="GPTModel.rotary_base", group="architecture", doc="RoPE theta"
    )
    normalization: str = setting(
        "rmsnorm",
        one_of(NORMALIZATIONS),
        target="TransformerConfig.normalization",
        translate=_normalization,
        group="architecture",
        doc=(
            "`rmsnorm`, `layernorm`, or `layernorm1p` (LayerNorm with zero-centred gamma, "
            "`layernorm_zero_centered_gamma`)"
        ),
    )
    norm_affine: bool = setting(
        True,
        target="layer_spec.norm_affine",
        group="architecture",
        doc=(
            "false: parameter-free norms (OLMo); with LNS the effective gamma is the constant "
            "`1/sqrt(l)`"
        ),
    )
    layernorm_epsilon: float = setting(
        1e-5,
        positive,
        target="TransformerConfig.layernorm_epsilon",
        group="architecture",
        doc="`layernorm_epsilon`",
    )
    bias: bool = setting(
        False,
        target="TransformerConfig.add_bias_linear",
        translate=to("bias"),
        group="architecture",
        doc="`add_bias_linear` and `add_qkv_bias`",
    )
    qk_layernorm: bool = setting(
        False,
        target="TransformerConfig.qk_layernorm",
        group="architecture",
        doc=(
            "`qk_layernorm`: megatron-core's QK-norm, a norm (`normalization`) on each head's "
            "queries and keys before RoPE (OLMo 2, Qwen3); never LNS-scaled. Not exported to "
            "Hugging Face (Llama, StableLM, Mixtral and Qwen2-MoE have none)"
        ),
    )
    activation: str = setting(
        "swiglu",
        one_of(ACTIVATIONS),
        target="TransformerConfig.activation_func",
        translate=to("activation"),
        group="architecture",
        doc="`swiglu` (`gated_linear_unit` + SiLU) or `gelu`",
    )
    share_embeddings_and_output_weights: bool = setting(
        False,
        target="GPTModel.share_embeddings_and_output_weights",
        group="architecture",
        doc="tie input embedding and LM head",
    )
    init_method_std: float = setting(
        0.02,
        positive,
        target="TransformerConfig.init_method_std",
        group="architecture",
        doc="`init_method_std`",
    )
    hidden_dropout: float = setting(
        0.0,
        probability,
        target="TransformerConfig.hidden_dropout",
        group="architecture",
        doc="`hidden_dropout`",
    )
    attention_dropout: float = setting(
        0.0,
        probability,
        target="TransformerConfig.attention_dropout",
        group="architecture",
        doc="`attention_dropout`",
    )
    make_vocab_size_divisible_by: int = setting(
        128,
        positive,
        group="architecture",
        doc=(
            "embedding rows = tokenizer vocab rounded up to a multiple of lcm(this, TP) "
            "(Megatron-LM multiplies by TP instead, which ties checkpoints to one TP size)"
        ),
    )
    seed: int = setting(
        1234,
        rng_seed,
        group="architecture",
        doc="init, data order and dropout seeds (`model_parallel_cuda_manual_seed`)",
    )

    activations_checkpoint_granularity: str | None = setting(
        None,
        one_of(RECOMPUTE_GRANULARITIES),
        target="TransformerConfig.recompute_granularity",
        aliases=("recompute_granularity",),
        group="recomputation",
        doc=(
            "`recompute_granularity`: null keeps every activation; `selective` recomputes the "
            "core attention (softmax, dropout, attention x V) of every layer, megatron's default "
            "`recompute_modules: [core_attn]`, a small cost that saves the "
            "sequence-length-squared activations; `full` recomputes whole layers, chosen by the "
            "next two keys"
        ),
    )
    activations_checkpoint_method: str | None = setting(
        None,
        one_of(RECOMPUTE_METHODS),
        target="TransformerConfig.recompute_method",
        aliases=("recompute_method",),
        group="recomputation",
        doc=(
            "`recompute_method`, `full` only: `uniform` splits each pipeline stage's layers into "
            "groups of `num_layers` and keeps only each group's input; `block` recomputes the "
            "first `num_layers` layers of each stage (or virtual chunk) and keeps the rest"
        ),
    )
    activations_checkpoint_num_layers: int | None = setting(
        None,
        positive,
        target="TransformerConfig.recompute_num_layers",
        aliases=("recompute_num_layers",),
        group="recomputation",
        doc=(
            "`recompute_num_layers`, `full` only: 1 .. layers per pipeline stage. With "
            "`architecture: hybrid` it counts what `num_layers` counts: blocks in the GPT twin "
            "(passed to megatron-core doubled, as sublayers), sublayers with a pattern (at most "
            "the longest `|` segment's)"
        ),
    )
    recompute_modules: list[str] | None = setting(
        None,
        module_list(RECOMPUTE_MODULES),
        target="TransformerConfig.recompute_modules",
        translate=_module_names,
        null_means="`[core_attn]`",
        group="recomputation",
        doc=(
            "`recompute_modules`, `selective` only: what megatron-core recomputes in backward: "
            "`core_attn`, `mlp` (a dense layer's MLP), `moe` (the whole MoE layer), `moe_act` "
            "(the experts' activation; needs `moe_grouped_gemm`), `shared_experts`, `layernorm` "
            "(the pre-norms, LNS factor included; needs `transformer_engine: true`, as "
            "megatron-core's CheckpointWithoutOutput reads Transformer Engine's FP8 state)"
        ),
    )
    gc_interval: int = setting(
        0,
        non_negative,
        group="operations",
        doc=(
            "Megatron-LM's manual garbage collection (`--manual-gc --manual-gc-interval`): with N"
            " > 0 Python's automatic collector is off for the run and every rank runs "
            "`gc.collect()` after every N-th step (step numbers, so a resumed run keeps the "
            "grid), so that no rank stalls the others at a collective by collecting on its own; 0"
            " leaves Python's automatic collection on"
        ),
    )
    nsys_profile: NsysProfileConfig = field(default_factory=NsysProfileConfig)
    dist_ckpt_parallel_save: bool = setting(
        False,
        target="dist_checkpointing.FullyParallelSaveStrategyWrapper",
        group="operations",
        doc=(
            "megatron-core's `FullyParallelSaveStrategyWrapper` over the data-parallel group "
            "(Megatron-LM's `--ckpt-fully-parallel-save`): the shards every data-parallel rank "
            "holds a copy of (weights; optimizer state without the distributed optimizer) are "
            "written by all of them, each a share, instead of all by the first; the checkpoint "
            "holds the same tensors and loads at any layout"
        ),
    )
    dist_ckpt_parallel_load: bool = setting(
        False,
        target="dist_checkpointing.FullyParallelLoadStrategyWrapper",
        group="operations",
        doc=(
            "megatron-core's `FullyParallelLoadStrategyWrapper` over the data-parallel group "
            "(Megatron-LM's `--ckpt-fully-parallel-load`): each data-parallel rank reads a share "
            "of the replicated shards and they exchange the rest (more communication, less "
            "storage traffic); the loaded state is the same"
        ),
    )
    enable_megatron_timers: bool = setting(
        False,
        target="timers.Timers",
        group="operations",
        doc=(
            "megatron-core's own timers (`megatron.core.timers.Timers` at log level 2, as NeMo "
            "builds them, set as the model config's and optimizer config's `timers`): the "
            "pipeline schedule (`forward-backward`, `forward-compute`, `backward-compute`), "
            "pipeline send and receive (`forward-recv`, `backward-send`, "
            "`forward-send-backward-recv`, ...), `finalize_model_grads` (`all-grads-sync`, "
            "`embedding-grads-all-reduce`, ...), the optimizer (`optimizer-inner-step`, "
            "`optimizer-clip-main-grad`, ...; `params-all-gather` with the distributed "
            "optimizer), and Megatron-LM's `optimizer` (the whole `optimizer.step()`) and "
            "`batch-generator` (reading the step's micro-batches). Validation is not timed. "
            "megatron-core's `barrier_with_L1_time` stays at its default (true): the level-1 "
            "timers start with a barrier across ranks, as in Megatron-LM"
        ),
    )
    megatron_timer_kwargs: MegatronTimerKwargs = field(default_factory=MegatronTimerKwargs)

    norm_scaling: str = setting(
        "lns",
        one_of(NORM_SCALING_CHOICES),
        target="layer_spec.norm_scaling",
        group="lns",
        doc=(
            "`lns`: both pre-norms of block `l` scaled by `1/sqrt(l)`; `none`: plain Pre-LN (same"
            " parameters and checkpoint keys)"
        ),
    )
    output_layer_init: str | None = setting(
        None,
        one_of(OUTPUT_LAYER_INITS),
        target="TransformerConfig.output_layer_init_method",
        translate=to("output_layer_init"),
        group="lns",
        doc=(
            "(NeMo: `use_scaled_init_method`) init of the residual output projections "
            "(`linear_proj`, `linear_fc2`): `normal` = N(0, init_method_std) (the paper's advice "
            "with LNS), `scaled` = megatron's N(0, std/sqrt(2L)), `depth_scaled` = N(0, "
            "std/sqrt(2l)) in layer l (local backend); null = `normal` with LNS, `scaled` without"
        ),
    )
    layer_variant: str = setting(
        "pre_ln",
        one_of(LAYER_VARIANTS),
        target="layer_spec.layer_variant",
        group="lns",
        doc=(
            "registered in `config/layer_variants.py` ([variants.md](variants.md)): `pre_ln`, "
            "`post_ln` (`LN(h + f(h))`), `deepnorm` (`LN(alpha*h + f(h))`, DeepNet's alpha and "
            "beta from `num_layers`), `mix_ln` (Post-LN in the first `mix_ln_post_fraction` of "
            "layers, Pre-LN after), `layerscale` (per-channel learnable branch scale), "
            "`skipinit` (scalar branch gate from 0), `peri_ln` (`h + LN(f(LN(h)))`), `gpas` "
            "(`x - SiLU(alpha_l)*sg(x)` after each add). `norm_scaling: lns` only with `pre_ln`,"
            " `layerscale`, `skipinit`, `gpas`; other than `pre_ln` needs `transformer_engine: "
            "false`"
        ),
    )
    mix_ln_post_fraction: float = setting(
        0.25,
        probability,
        target="layer_spec.mix_ln_post_fraction",
        group="lns",
        doc="Mix-LN: layers `l <= floor(fraction * num_layers)` are Post-LN; in [0, 1]",
    )
    layerscale_init: float = setting(
        1e-3,
        positive,
        target="layer_spec.layerscale_init",
        group="lns",
        doc="LayerScale: initial value of every channel's branch scale; > 0",
    )

    num_moe_experts: int | None = setting(
        None,
        positive,
        target="TransformerConfig.num_moe_experts",
        null_means="dense MLPs",
        group="moe",
        doc=(
            "`num_moe_experts`: routed experts per MoE layer. Each MoE layer is megatron-core's "
            "`MoELayer` (router, token dispatcher, experts, optional shared expert) behind the "
            "layer's pre-MLP norm, which LNS scales by 1/sqrt(l) like a dense layer's, so the "
            "router and the experts both see the scaled input"
        ),
    )
    moe_layer_freq: Any = setting(
        1,
        moe_layer_frequency,
        target="TransformerConfig.moe_layer_freq",
        translate=_moe_layer_freq,
        group="moe",
        doc=(
            "which layers are MoE: an int N (layers 1, N+1, 2N+1, ... counted from 1; 1 = all), "
            "a list of 0 (dense) / 1 (MoE) per layer, or megatron-lm's list expression such as "
            "`'[0]*1+[1]*15'`. Every layer keeps its global number l for LNS"
        ),
    )
    moe_ffn_hidden_size: int | None = setting(
        None,
        positive,
        target="TransformerConfig.moe_ffn_hidden_size",
        null_means="= ffn_hidden_size",
        group="moe",
        doc="`moe_ffn_hidden_size`: each routed expert's MLP width (per gate/up half with SwiGLU)",
    )
    moe_router_topk: int = setting(
        2,
        positive,
        target="TransformerConfig.moe_router_topk",
        group="moe",
        doc="`moe_router_topk`: experts each token is sent to; at most `num_moe_experts`",
    )
    moe_router_score_function: str = setting(
        "softmax",
        one_of(MOE_SCORE_FUNCTIONS),
        target="TransformerConfig.moe_router_score_function",
        group="moe",
        doc=(
            "`moe_router_score_function`: `softmax` (Mixtral, OLMoE, Qwen-MoE) or `sigmoid` "
            "(DeepSeek-V3; the top-k scores are renormalised to sum to 1 when k > 1)"
        ),
    )
    moe_router_pre_softmax: bool = setting(
        False,
        target="TransformerConfig.moe_router_pre_softmax",
        group="moe",
        doc=(
            "`moe_router_pre_softmax`: softmax over all experts before top-k (the chosen "
            "probabilities then do not sum to 1, as in OLMoE); false: softmax over the top-k "
            "logits (Mixtral's renormalised probabilities)"
        ),
    )
    moe_router_topk_scaling_factor: float | None = setting(
        None,
        positive,
        target="TransformerConfig.moe_router_topk_scaling_factor",
        null_means="1",
        group="moe",
        doc="`moe_router_topk_scaling_factor`: multiplies the routing weights (DeepSeek-V3's 2.5)",
    )
    moe_router_enable_expert_bias: bool = setting(
        False,
        target="TransformerConfig.moe_router_enable_expert_bias",
        group="moe",
        doc=(
            "`moe_router_enable_expert_bias`: DeepSeek-V3's aux-loss-free balancing, a per-expert "
            "bias added to the scores for selection only, updated after each step from the "
            "tokens each expert received; needs `moe_router_score_function: sigmoid`"
        ),
    )
    moe_router_bias_update_rate: float = setting(
        1e-3,
        positive,
        target="TransformerConfig.moe_router_bias_update_rate",
        training_only=True,
        group="moe",
        doc="`moe_router_bias_update_rate`: the expert-bias step size",
    )
    moe_router_dtype: str | None = setting(
        None,
        one_of(MOE_ROUTER_DTYPES),
        target="TransformerConfig.moe_router_dtype",
        null_means="the activations' dtype",
        group="moe",
        doc="`moe_router_dtype`: the router's GEMM and scores in `fp32` or `fp64`",
    )
    moe_router_load_balancing_type: str = setting(
        "aux_loss",
        one_of(MOE_LOAD_BALANCING),
        target="TransformerConfig.moe_router_load_balancing_type",
        training_only=True,
        group="moe",
        doc=(
            "`moe_router_load_balancing_type`: `aux_loss` (GShard/Switch, over the micro-batch), "
            "`seq_aux_loss` (per sequence), `global_aux_loss` (over the data-parallel group), "
            "`sinkhorn` (S-BASE routing, top-1 only), `none`"
        ),
    )
    moe_aux_loss_coeff: float = setting(
        0.0,
        non_negative,
        target="TransformerConfig.moe_aux_loss_coeff",
        training_only=True,
        group="moe",
        doc="`moe_aux_loss_coeff`: weight of the load-balancing loss (1e-2 is common)",
    )
    moe_z_loss_coeff: float | None = setting(
        None,
        non_negative,
        target="TransformerConfig.moe_z_loss_coeff",
        training_only=True,
        null_means="off",
        group="moe",
        doc="`moe_z_loss_coeff`: weight of the router z-loss (ST-MoE; 1e-3 is common)",
    )
    moe_per_layer_logging: bool = setting(
        False,
        target="TransformerConfig.moe_per_layer_logging",
        training_only=True,
        group="moe",
        doc="log the load-balancing and z losses and the expert load of every MoE layer too",
    )
    moe_token_dispatcher_type: str = setting(
        "allgather",
        one_of(MOE_DISPATCHERS),
        target="TransformerConfig.moe_token_dispatcher_type",
        group="moe",
        doc=(
            "`moe_token_dispatcher_type`: `allgather` (megatron-core's default) or `alltoall` "
            "(the usual choice with expert parallelism); same function, different "
            "communication. `flex` (DeepEP / HybridEP kernels) is refused: it needs CUDA-only "
            "kernels not tested here"
        ),
    )
    moe_grouped_gemm: bool | None = setting(
        None,
        target="TransformerConfig.moe_grouped_gemm",
        policy="machine",
        group="moe",
        doc=(
            "`moe_grouped_gemm`: the experts of a rank as one grouped GEMM (Transformer Engine's "
            "`TEGroupedMLP`) instead of one GEMM per expert (`SequentialMLP`). Needs "
            "`transformer_engine: true` on CUDA (megatron-core's local backend would silently "
            "run `SequentialMLP`). null: on with Transformer Engine on CUDA"
        ),
    )
    moe_permute_fusion: bool | None = setting(
        None,
        target="TransformerConfig.moe_permute_fusion",
        policy="machine",
        training_only=True,
        group="moe",
        doc=(
            "`moe_permute_fusion`: Transformer Engine's fused token permute/unpermute in the "
            "dispatcher. Needs Transformer Engine on CUDA. null: on with Transformer Engine "
            "on CUDA"
        ),
    )
    moe_shared_expert_intermediate_size: int | None = setting(
        None,
        positive,
        target="TransformerConfig.moe_shared_expert_intermediate_size",
        null_means="no shared expert",
        group="moe",
        doc=(
            "`moe_shared_expert_intermediate_size`: width of the shared expert every token "
            "passes through (all shared experts together, as in Qwen-MoE and DeepSeek)"
        ),
    )
    moe_shared_expert_gate: bool = setting(
        False,
        target="TransformerConfig.moe_shared_expert_gate",
        group="moe",
        doc="`moe_shared_expert_gate`: a sigmoid gate on the shared expert's output (Qwen2-MoE)",
    )
    moe_shared_expert_overlap: bool = setting(
        False,
        target="TransformerConfig.moe_shared_expert_overlap",
        training_only=True,
        group="moe",
        doc=(
            "`moe_shared_expert_overlap`: compute the shared expert while the dispatcher "
            "communicates; needs a shared expert and `moe_token_dispatcher_type: alltoall`"
        ),
    )
    moe_expert_capacity_factor: float | None = setting(
        None,
        positive,
        target="TransformerConfig.moe_expert_capacity_factor",
        null_means="no token dropping",
        group="moe",
        doc=(
            "`moe_expert_capacity_factor`: each expert takes at most factor x its even share of "
            "the tokens; the rest are dropped (their MoE output is 0, the residual carries them)"
        ),
    )
    moe_token_drop_policy: str = setting(
        "probs",
        one_of(MOE_DROP_POLICIES),
        target="TransformerConfig.moe_token_drop_policy",
        group="moe",
        doc="`moe_token_drop_policy`: over capacity, drop the least likely or the last tokens",
    )
    moe_pad_expert_input_to_capacity: bool = setting(
        False,
        target="TransformerConfig.moe_pad_expert_input_to_capacity",
        group="moe",
        doc=(
            "`moe_pad_expert_input_to_capacity`: pad every expert's input to its capacity "
            "(static shapes); needs `moe_expert_capacity_factor`"
        ),
    )
    expert_model_parallel_size: int = setting(
        1,
        positive,
        target="ParallelLayout.expert",
        group="moe",
        doc=(
            "`expert_model_parallel_size` (EP): the experts of each MoE layer are split over EP "
            "ranks, which come out of the data-parallel ranks (megatron-core's expert groups: "
            "world = PP x ETP x EP x expert-DP). Must divide `num_moe_experts`"
        ),
    )
    expert_tensor_parallel_size: int | None = setting(
        None,
        positive,
        target="ParallelLayout.expert_tensor",
        null_means="= TP",
        group="moe",
        doc=(
            "`expert_tensor_parallel_size` (ETP): each expert's weights split over ETP ranks; "
            "1 keeps experts whole while attention runs at TP"
        ),
    )

    context_parallel_size: int = setting(
        1,
        positive,
        target="ParallelLayout.context",
        group="parallelism",
        doc=(
            "`context_parallel_size` of `parallel_state` and `TransformerConfig`: each sequence "
            "is split into 2 x CP chunks and every rank of a CP group keeps two of them "
            "(megatron-core's load-balanced `get_batch_on_this_cp_rank`); attention exchanges "
            "keys and values in Transformer Engine's ring. Needs `model.transformer_engine: "
            "true`, a sequence length divisible by 2 x CP, and a world size divisible by TP x PP "
            "x CP (DP = world / (TP x PP x CP)); gradients are reduced, and the distributed "
            "optimizer sharded, over DP x CP. Not run on CPU (TE needs CUDA): the checks and the "
            "resolved configs are tested"
        ),
    )
    bias_activation_fusion: bool | None = setting(
        None,
        target="TransformerConfig.bias_activation_fusion",
        policy="machine",
        training_only=True,
        group="performance",
        doc=(
            "`TransformerConfig.bias_activation_fusion`: the MLP's bias + activation "
            "(SwiGLU/GELU) as one TorchScript-fused function. Runs on CPU and CUDA; refused with "
            "`activation: gelu` and no bias (megatron-core fuses the bias into GELU). null: on "
            "with CUDA"
        ),
    )
    bias_dropout_add_fusion: bool | None = setting(
        None,
        target="TransformerConfig.bias_dropout_fusion",
        policy="machine",
        training_only=True,
        group="performance",
        doc=(
            "`bias_dropout_fusion`: bias + dropout + residual add fused (TorchScript). null: on "
            "with CUDA"
        ),
    )
    masked_softmax_fusion: bool | None = setting(
        None,
        target="TransformerConfig.masked_softmax_fusion",
        policy="machine",
        training_only=True,
        group="performance",
        doc=(
            "`masked_softmax_fusion`: the local backend's `FusedScaleMaskSoftmax` uses Apex's "
            "`scaled_*_masked_softmax_cuda` kernels for half-precision CUDA inputs (it fails with"
            " an ImportError without them, so asking without them is refused). Transformer "
            "Engine's attention fuses its own softmax and does not read it. null: on with the "
            "local backend where the kernels are installed"
        ),
    )
    apply_rope_fusion: bool | None = setting(
        None,
        target="TransformerConfig.apply_rope_fusion",
        policy="machine",
        training_only=True,
        group="performance",
        doc=(
            "`apply_rope_fusion`: Transformer Engine's fused RoPE kernel (megatron-core refuses "
            "it without TE; needs `position_embedding_type: rope`). null: on with "
            "`transformer_engine: true` on CUDA"
        ),
    )
    gradient_accumulation_fusion: bool | None = setting(
        None,
        target="TransformerConfig.gradient_accumulation_fusion",
        policy="machine",
        training_only=True,
        group="performance",
        doc=(
            "`gradient_accumulation_fusion`: weight-gradient GEMMs accumulate straight into "
            "megatron DDP's fp32 `main_grad` buffer. Needs Apex's "
            "`fused_weight_gradient_mlp_cuda` on either backend (megatron-core's output layer is "
            "a `ColumnParallelLinear` that calls it). null: on where that kernel is installed"
        ),
    )
    cross_entropy_loss_fusion: bool | None = setting(
        None,
        target="TransformerConfig.cross_entropy_loss_fusion",
        policy="machine",
        training_only=True,
        group="performance",
        doc=(
            "`cross_entropy_loss_fusion` with megatron-core's `native` implementation "
            "(TorchScript; the `te` one has known stability issues). null: on with CUDA"
        ),
    )
    use_flash_attention: bool | None = setting(
        None,
        target="TransformerConfig.attention_backend",
        policy="machine",
        training_only=True,
        group="performance",
        doc=(
            "`TransformerConfig.attention_backend` of the TE spec: true `flash` (FlashAttention),"
            " false `fused` (cuDNN fused attention, no FlashAttention: NeMo's false), null `auto`"
            " (TE picks per GPU and shape). True needs `transformer_engine: true` (the local "
            "backend's attention is megatron-core's unfused `DotProductAttention`)"
        ),
    )
    overlap_p2p_comm: bool = setting(
        False,
        target="TransformerConfig.overlap_p2p_comm",
        group="performance",
        doc=(
            "`overlap_p2p_comm`: pipeline send/receive overlap compute; megatron-core does it in "
            "the interleaved schedule only, so it needs `virtual_pipeline_model_parallel_size`"
        ),
    )
    batch_p2p_comm: bool | None = setting(
        None,
        target="TransformerConfig.batch_p2p_comm",
        policy="machine",
        training_only=True,
        group="performance",
        doc=(
            "`batch_p2p_comm`: send/receive batched with `batch_isend_irecv`. Cannot be on with "
            "`overlap_p2p_comm`. On gloo (CPU) with a pipeline it is refused: gloo matches "
            "batched sends and receives between the same two ranks FIFO and can swap activations "
            "with gradients (silently wrong loss). null: on, except on gloo or with "
            "`overlap_p2p_comm`"
        ),
    )
    fp32_residual_connection: bool = setting(
        False,
        target="TransformerConfig.fp32_residual_connection",
        group="performance",
        doc=(
            "`fp32_residual_connection`: the residual stream in fp32 (megatron-core then sends "
            "fp32 between pipeline stages)"
        ),
    )
    sharp: bool = setting(
        False,
        target="ParallelLayout.sharp",
        group="performance",
        doc=(
            "`initialize_model_parallel(use_sharp=True)`: megatron-core creates the data-parallel"
            " NCCL communicator first with `NCCL_COLLNET_ENABLE=1`, so its reductions run in the "
            "InfiniBand switches (SHARP). Needs NCCL on CUDA GPUs (refused at launch on gloo) and"
            ' a fabric with SHARP (on SLURM often `cluster.sbatch_args: ["--network=sharp"]`); '
            "NCCL falls back to ordinary collectives where the switch has no SHARP groups left"
        ),
    )
    ub_tp_comm_overlap: bool = setting(
        False,
        target="TransformerConfig.tp_comm_overlap",
        translate=to("tp_comm_overlap"),
        training_only=True,
        group="performance",
        doc=(
            "`TransformerConfig.tp_comm_overlap`: Transformer Engine's linears overlap the "
            "sequence-parallel all-gather and reduce-scatter with their GEMMs through "
            "userbuffers, which the trainer allocates before building the model (TE's "
            "`initialize_ub`, shape (encoder_seq_length x micro_batch_size / "
            "context_parallel_size, hidden_size), FP8 buffers with `model.fp8`), as Megatron-LM's"
            " `_initialize_tp_communicators` does. Needs `transformer_engine: true` and "
            "`sequence_parallel: true` (so TP > 1). Checked against a stand-in with TE 2.8-2.18's"
            " `initialize_ub` signature; not run on a GPU yet"
        ),
    )
    ub_tp_comm_overlap_cfg: Any = setting(
        None,
        free_form=True,
        group="performance",
        doc=(
            "TE's `ub_cfgs`: per-GEMM userbuffer settings (`method`, `num_sm`, `cga_size`, "
            "`num_splits`, `set_sm_margin`, `aggregate`, `atomic_gemm`, `fp8_buf`, ...) keyed by "
            "GEMM (`qkv_fprop`, `qkv_dgrad`, `qkv_wgrad`, `proj_fprop`, `proj_dgrad`, "
            "`proj_wgrad`, `fc1_fprop`, `fc1_dgrad`, `fc1_wgrad`, `fc2_fprop`, `fc2_dgrad`, "
            "`fc2_wgrad`), as the path of a YAML file (NeMo's `ub_cfg_*.yaml`) or the mapping "
            "itself. null: TE's defaults. GEMM names TE does not know are refused (TE would skip "
            "them silently); NeMo's Hydra group `tp_overlap@model.ub_tp_comm_overlap_cfg` is not "
            "composed, give the file's path instead"
        ),
    )
    ub_tp_comm_bootstrap_backend: str = setting(
        "nccl",
        one_of(UB_BOOTSTRAP_BACKENDS),
        target="TransformerConfig.tp_comm_bootstrap_backend",
        translate=to("tp_comm_bootstrap_backend"),
        training_only=True,
        group="performance",
        doc=(
            "`tp_comm_bootstrap_backend`: the collectives (`nccl`, `mpi` or `gloo`) TE uses to "
            "set userbuffers up"
        ),
    )
    cpu_offloading: bool = setting(
        False,
        target="TransformerConfig.cpu_offloading",
        training_only=True,
        group="performance",
        doc=(
            "`TransformerConfig.cpu_offloading`: Transformer Engine's offload context moves the "
            "activations saved for backward of the first `cpu_offloading_num_layers` layers to "
            "CPU memory during forward and back before their backward, overlapped with compute. "
            "Needs `transformer_engine: true`; megatron-core refuses it with pipeline parallelism"
            " and with recomputation, and so does validation (by key). `tests/gpu/test_gpu.py` "
            "checks that it leaves loss and gradients unchanged (needs a GPU with TE; not run "
            "yet)"
        ),
    )
    cpu_offloading_num_layers: int | None = setting(
        None,
        non_negative,
        target="TransformerConfig.cpu_offloading_num_layers",
        translate=_cpu_offloading_num_layers,
        training_only=True,
        group="performance",
        doc=(
            "`cpu_offloading_num_layers`, 1 to `num_layers - 1` (the last layer's activations are"
            " used at once). null: `num_layers - 1`, NeMo's `${sum:${.num_layers},-1}` (the `sum`"
            " resolver is registered)"
        ),
    )
    cpu_offloading_activations: bool = setting(
        True,
        target="TransformerConfig.cpu_offloading_activations",
        training_only=True,
        group="performance",
        doc="`cpu_offloading_activations`; false offloads nothing and is refused",
    )
    cpu_offloading_weights: bool = setting(
        False,
        target="TransformerConfig.cpu_offloading_weights",
        training_only=True,
        group="performance",
        doc=(
            "`cpu_offloading_weights`: true is refused. Transformer Engine deprecated weight "
            "offloading in 2.3 and ignores the flag with a warning (megatron-lns needs TE >= "
            "2.8). NeMo's YAML sets it true: set it to false together with `cpu_offloading: true`"
        ),
    )
    apply_query_key_layer_scaling: bool = setting(
        False,
        target="TransformerConfig.apply_query_key_layer_scaling",
        group="performance",
        doc=(
            "`apply_query_key_layer_scaling`: attention scores divided by the layer number before"
            " the (then fp32) softmax and multiplied back, for fp16 range"
        ),
    )
    do_layer_norm_weight_decay: bool = setting(
        False,
        target="get_megatron_optimizer.config_overrides",
        translate=to("decay_norms_and_biases"),
        group="performance",
        doc=(
            "weight decay on every parameter. false is megatron's standard `config_overrides`, "
            "which exempts biases and 1-D tensors (norm weights); true passes none "
            "(`get_megatron_optimizer(config_overrides={})`)"
        ),
    )
    native_amp_init_scale: float = setting(
        2.0**32,
        positive,
        target="OptimizerConfig.initial_loss_scale",
        group="performance",
        doc="`OptimizerConfig.initial_loss_scale` of fp16 dynamic loss scaling",
    )
    native_amp_growth_interval: int = setting(
        1000,
        positive,
        target="OptimizerConfig.loss_scale_window",
        group="performance",
        doc="`OptimizerConfig.loss_scale_window`: overflow-free steps before the scale doubles",
    )
    hysteresis: int = setting(
        2,
        positive,
        target="OptimizerConfig.hysteresis",
        group="performance",
        doc="`OptimizerConfig.hysteresis`: overflows tolerated before the scale halves",
    )

    transformer_engine: bool = setting(
        False,
        target="layer_spec.backend",
        translate=_backend,
        group="transformer_engine",
        doc="Transformer Engine layer spec (fused norm + linear; LNS folded into the fused norm)",
    )
    fp8: str | None = setting(
        None,
        one_of(FP8_RECIPES),
        target="TransformerConfig.fp8_recipe",
        translate=to("fp8"),
        group="transformer_engine",
        doc=(
            "NeMo's `false` = null; `TransformerConfig.fp8_recipe` (needs `transformer_engine` "
            "and `trainer.precision: bf16-mixed`): `delayed` (amax history, compute capability >="
            " 8.9), `tensorwise` (current scaling, >= 8.9), `blockwise` (>= 9.0), `mxfp8` "
            "(Blackwell, >= 10.0); checked against the GPU at launch"
        ),
    )
    fp8_format: str | None = setting(
        None,
        one_of(FP8_FORMATS),
        target="TransformerConfig.fp8",
        translate=_fp8_format,
        null_means="`hybrid`",
        group="transformer_engine",
        doc=(
            "`TransformerConfig.fp8`: `hybrid` (E4M3 forward, E5M2 gradients) or `e4m3`. NeMo's "
            "`fp8_e4m3: true` sets `e4m3` (and contradicts an explicit `hybrid`); NeMo's "
            "`fp8_hybrid` is accepted either way (true is the default; as in NeMo, `fp8_e4m3` "
            "wins when both are true)"
        ),
    )
    fp8_param: bool = setting(
        False,
        target="TransformerConfig.fp8_param",
        group="transformer_engine",
        doc=(
            "`fp8_param`: keep the weights themselves in FP8; false keeps bf16 weights with fp32 "
            "main weights in the optimizer"
        ),
    )
    fp8_margin: int = setting(
        0,
        non_negative,
        target="TransformerConfig.fp8_margin",
        group="transformer_engine",
        doc="`TransformerConfig.fp8_margin`",
    )
    fp8_amax_history_len: int = setting(
        1024,
        positive,
        target="TransformerConfig.fp8_amax_history_len",
        group="transformer_engine",
        doc="`fp8_amax_history_len` (delayed scaling)",
    )
    fp8_amax_compute_algo: str = setting(
        "max",
        one_of(FP8_AMAX_COMPUTE_ALGOS),
        target="TransformerConfig.fp8_amax_compute_algo",
        group="transformer_engine",
        doc="`fp8_amax_compute_algo` (`max` or `most_recent`)",
    )

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

    partition: str | None = setting(None, doc="`#SBATCH --partition` (null: the cluster's default)")
    account: str | None = setting(None, doc="`#SBATCH --account`")
    qos: str | None = setting(None, doc="`#SBATCH --qos`")
    # Typed Any so that YAML's base-60 reading of an unquoted 4:00:00 (= 14400) reaches
    # config/cluster.py, which refuses it, instead of being sent to SLURM as a number.
    time_limit: Any = setting(
        None,
        doc=(
            '`#SBATCH --time`, a quoted SLURM time (`"04:00:00"`, `"1-12:00:00"`, `"90"` '
            "minutes); unquoted `4:00:00` is refused (YAML reads it as 14400)"
        ),
    )
    exclusive: bool = setting(False, doc="`#SBATCH --exclusive`")
    gpus_per_node: int | None = setting(
        None,
        non_negative,
        doc=(
            "`#SBATCH --gpus-per-node`; null: `trainer.devices` with `trainer.accelerator=gpu`, "
            "none otherwise; must equal `trainer.devices` (or be 0)"
        ),
    )
    cpus_per_task: int | None = setting(None, positive, doc="`--cpus-per-task` for sbatch and srun")
    mem: str | None = setting(None, doc='`#SBATCH --mem` (`"0"`: all of a node\'s memory)')
    job_name_prefix: str = setting(
        "megatron_lns-",
        doc=(
            "job name = prefix + top-level `name` + `-` + `exp_manager.name` + `-` + the "
            "submission's time stamp (its `slurm/<time>/` folder), unique per submission; "
            "names the log files"
        ),
    )
    container_image: str | None = setting(
        None,
        doc=(
            "pyxis/enroot image for `srun --container-image`; tasks run `python -m "
            "megatron_lns.launch.task` in it"
        ),
    )
    container_mounts: list[str] = setting(
        default_factory=list,
        doc=(
            "`srun --container-mounts`, one `src:dst[:flags]` per item; the experiment directory "
            "must be mounted at its own path"
        ),
    )
    env_vars: dict[str, str] = setting(
        default_factory=dict,
        doc=(
            "exported before `srun` (NCCL, network); not the rank variables, which come from SLURM"
        ),
    )
    srun_args: list[str] = setting(
        default_factory=list,
        doc=(
            "extra `srun` options, one per item; an option the script sets "
            "(`--kill-on-bad-exit`, the container's) is refused, also abbreviated (`--kill-on=0`)"
        ),
    )
    sbatch_args: list[str] = setting(
        default_factory=list,
        doc=(
            "extra `#SBATCH` options, one per item (`--constraint=h100`, `--hold`, ...); an "
            "option the script sets is refused, also abbreviated as sbatch allows (`--no-req` "
            "is `--no-requeue`)"
        ),
    )
    dependency: str | None = setting(
        None, doc="`#SBATCH --dependency` (`singleton`, `afterok:123`)"
    )
    preemption_signal_lead_s: int = setting(
        300,
        signal_lead_seconds,
        doc=(
            "`#SBATCH --signal=B:USR1@N`: SLURM warns the job N seconds before the time limit; "
            "must cover one step and one checkpoint save"
        ),
    )
    max_requeues: int = setting(
        5,
        non_negative,
        doc="how often the job may requeue itself after that warning (`SLURM_RESTART_COUNT`)",
    )


@dataclass
class ExperimentConfig:
    name: str = setting("megatron_gpt", doc="a label for the run (plots, logs)")
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
