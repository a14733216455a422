"""The performance and memory keys: what they ask of megatron-core, and their rules.

:func:`fast_path_request` reads the fusion, attention and overlap switches for
``fast_paths.resolve_fast_paths``; :func:`check_performance_keys` holds the rules that
relate these keys to the rest of the config (context parallelism, precision-bound keys,
pipeline communication, tensor-parallel communication overlap, activation offloading).
Both are used by ``validate.py`` and the run assembly.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from megatron_lns.config import model_derived
from megatron_lns.config.fast_paths import (
    FastPathError,
    FastPathRequest,
    FastPaths,
    MachineFacts,
    resolve_fast_paths,
)
from megatron_lns.config.loader import ConfigError
from megatron_lns.config.schema import (
    PRECISIONS,
    ExperimentConfig,
    ModelConfig,
    cpu_offloading_num_layers,
    uses_distributed_optimizer,
)
from megatron_lns.config.settings import declared_settings, section
from megatron_lns.config.userbuffers import UserbufferSettingsError, read_userbuffer_settings

# fp16 loss-scaling keys and the values megatron-core uses when they are not set.
LOSS_SCALE_DEFAULTS = {
    "native_amp_init_scale": 2.0**32,
    "native_amp_growth_interval": 1000,
    "hysteresis": 2,
}


def fast_path_request(cfg: ExperimentConfig) -> FastPathRequest:
    """The user's value of every key whose null default is the machine's (declared
    ``policy="machine"``), and the facts of the model they depend on."""
    switches = {
        item.name: getattr(section(cfg, item.key), item.name)
        for item in declared_settings(ExperimentConfig)
        if item.setting.policy == "machine"
    }
    m = cfg.model
    return FastPathRequest(
        **switches,
        bucket_cap_mb=m.optim.bucket_cap_mb,
        overlap_p2p_comm=m.overlap_p2p_comm,
        pipeline_parallel=m.pipeline_model_parallel_size > 1,
        transformer_engine=m.transformer_engine,
        rope=m.position_embedding_type == "rope",
        gelu_without_bias=m.activation == "gelu" and not m.bias,
        distributed_optimizer=uses_distributed_optimizer(cfg),
        moe=model_derived.has_experts(m),
    )


def resolved_fast_paths(cfg: ExperimentConfig, facts: MachineFacts) -> FastPaths:
    """The fast paths of this config on a machine with ``facts``; a refusal names its key."""
    try:
        return resolve_fast_paths(fast_path_request(cfg), facts)
    except FastPathError as err:
        raise ConfigError(str(err)) from None


def userbuffer_settings(cfg: ExperimentConfig) -> dict | None:
    """``model.ub_tp_comm_overlap_cfg`` read and checked (a YAML path or a mapping)."""
    source = cfg.model.ub_tp_comm_overlap_cfg
    if isinstance(source, DictConfig):
        source = OmegaConf.to_container(source, resolve=True)
    try:
        return read_userbuffer_settings(source, "model.ub_tp_comm_overlap_cfg")
    except UserbufferSettingsError as err:
        raise ConfigError(str(err)) from None


def check_performance_keys(cfg: ExperimentConfig, check_files: bool = True) -> None:
    """Rules of the performance keys that hold on any machine (``check_files``: also read
    the files they name)."""
    m, precision = cfg.model, PRECISIONS[str(cfg.trainer.precision)]
    # Checked against the most capable machine this config can ask for: what is refused
    # here is refused everywhere; what depends on the machine is check_environment's.
    resolved_fast_paths(
        cfg,
        MachineFacts(
            cuda=True,
            transformer_engine=m.transformer_engine,
            softmax_kernels=True,
            wgrad_accumulation_kernel=True,
        ),
    )
    cp = m.context_parallel_size
    if cp > 1:
        if not m.transformer_engine:
            raise ConfigError(
                f"model.context_parallel_size={cp} needs model.transformer_engine=true: "
                "megatron-core's context parallelism runs in Transformer Engine's attention"
            )
        if m.encoder_seq_length % (2 * cp):
            raise ConfigError(
                f"model.encoder_seq_length ({m.encoder_seq_length}) is not divisible by "
                f"2 x model.context_parallel_size ({2 * cp}): each rank holds two chunks of "
                "every sequence (load-balanced causal attention)"
            )
    if m.overlap_p2p_comm and m.virtual_pipeline_model_parallel_size is None:
        raise ConfigError(
            "model.overlap_p2p_comm=true needs model.virtual_pipeline_model_parallel_size "
            "(megatron-core overlaps pipeline communication in the interleaved schedule only)"
        )
    _check_tp_comm_overlap(cfg, check_files)
    _check_cpu_offloading(m)
    dtype = cfg.model.optim.grad_sync_dtype
    if dtype is not None and dtype != "fp32" and dtype != precision:
        raise ConfigError(
            f"model.optim.grad_sync_dtype={dtype} needs trainer.precision={dtype}-mixed: "
            "gradients are reduced in fp32 or in the model's own dtype"
        )
    if precision != "fp16":
        for key, default in LOSS_SCALE_DEFAULTS.items():
            value = getattr(m, key)
            if value != default:
                raise ConfigError(
                    f"model.{key}={value} applies to fp16 loss scaling only "
                    f"(trainer.precision=16-mixed); trainer.precision={cfg.trainer.precision}"
                )


def _check_tp_comm_overlap(cfg: ExperimentConfig, check_files: bool) -> None:
    m = cfg.model
    if not m.ub_tp_comm_overlap:
        if m.ub_tp_comm_overlap_cfg is not None:
            raise ConfigError(
                "model.ub_tp_comm_overlap_cfg is set but model.ub_tp_comm_overlap=false: "
                "the userbuffer settings would not be used"
            )
        return
    if not m.transformer_engine:
        raise ConfigError(
            "model.ub_tp_comm_overlap=true needs model.transformer_engine=true: the overlap "
            "runs inside Transformer Engine's linear layers"
        )
    if not m.sequence_parallel:
        raise ConfigError(
            "model.ub_tp_comm_overlap=true needs model.sequence_parallel=true: it overlaps "
            "the sequence-parallel all-gather and reduce-scatter with the GEMMs"
        )
    if check_files or not isinstance(m.ub_tp_comm_overlap_cfg, str):
        userbuffer_settings(cfg)


def _check_cpu_offloading(m: ModelConfig) -> None:
    """megatron-core's and Transformer Engine's rules for activation offloading."""
    if not m.cpu_offloading:
        return
    if not m.transformer_engine:
        raise ConfigError(
            "model.cpu_offloading=true needs model.transformer_engine=true: megatron-core "
            "offloads through Transformer Engine's offload context"
        )
    if m.pipeline_model_parallel_size > 1:
        raise ConfigError(
            "model.cpu_offloading=true needs model.pipeline_model_parallel_size=1 "
            "(megatron-core does not offload with pipeline parallelism)"
        )
    if m.activations_checkpoint_granularity is not None:
        raise ConfigError(
            "model.cpu_offloading=true and model.activations_checkpoint_granularity="
            f"{m.activations_checkpoint_granularity} cannot be combined (megatron-core does "
            "not offload recomputed layers); choose one"
        )
    layers = cpu_offloading_num_layers(m)
    if not 1 <= layers <= m.num_layers - 1:
        raise ConfigError(
            f"model.cpu_offloading_num_layers={layers} must be between 1 and "
            f"model.num_layers - 1 ({m.num_layers - 1}): the last layer is never offloaded"
        )
    if m.cpu_offloading_weights:
        raise ConfigError(
            "model.cpu_offloading_weights=true: Transformer Engine no longer offloads weights "
            "(deprecated since 2.3, the flag is ignored; megatron-lns needs >= 2.8); set it "
            "to false"
        )
    if not m.cpu_offloading_activations:
        raise ConfigError(
            "model.cpu_offloading=true with model.cpu_offloading_activations=false offloads nothing"
        )


def check_performance_environment(cfg: ExperimentConfig, cuda: bool) -> None:
    """What the performance keys need of the machine (beyond Transformer Engine, which
    check_environment checks): NCCL for SHARP."""
    if cfg.model.sharp and not (cuda and cfg.trainer.accelerator != "cpu"):
        raise ConfigError(
            "model.sharp=true needs NCCL on CUDA GPUs: SHARP reduces NCCL's data-parallel "
            "collectives in the InfiniBand switches (gloo has no SHARP)"
        )
