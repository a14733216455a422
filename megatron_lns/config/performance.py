"""The performance and memory keys: what they ask of megatron-core, and their rules.

:func:`fast_path_request` reads the fusion, attention and overlap switches for
``fast_paths.resolve_fast_paths``; :func:`check_performance_keys` holds the rules that
relate these keys to the rest of the config (context parallelism, precision-bound keys,
pipeline communication). Both are used by ``validate.py`` and the run assembly.
"""

from __future__ import annotations

from megatron_lns.config.loader import ConfigError
from megatron_lns.config.schema import PRECISIONS, ExperimentConfig
from megatron_lns.fast_paths import (
    FastPathError,
    FastPathRequest,
    FastPaths,
    MachineFacts,
    resolve_fast_paths,
)

# fp16 loss-scaling keys and the values megatron-core uses when they are not set.
LOSS_SCALE_DEFAULTS = {
    "native_amp_init_scale": 2.0**32,
    "native_amp_growth_interval": 1000,
    "hysteresis": 2,
}


def fast_path_request(cfg: ExperimentConfig) -> FastPathRequest:
    m, o = cfg.model, cfg.model.optim
    return FastPathRequest(
        bias_activation_fusion=m.bias_activation_fusion,
        bias_dropout_add_fusion=m.bias_dropout_add_fusion,
        masked_softmax_fusion=m.masked_softmax_fusion,
        apply_rope_fusion=m.apply_rope_fusion,
        gradient_accumulation_fusion=m.gradient_accumulation_fusion,
        cross_entropy_loss_fusion=m.cross_entropy_loss_fusion,
        use_flash_attention=m.use_flash_attention,
        overlap_grad_sync=o.overlap_grad_sync,
        overlap_param_sync=o.overlap_param_sync,
        bucket_cap_mb=o.bucket_cap_mb,
        batch_p2p_comm=m.batch_p2p_comm,
        overlap_p2p_comm=m.overlap_p2p_comm,
        pipeline_parallel=m.pipeline_model_parallel_size > 1,
        transformer_engine=m.transformer_engine,
        rope=m.position_embedding_type == "rope",
        gelu_without_bias=m.activation == "gelu" and not m.bias,
        distributed_optimizer=o.name == "distributed_fused_adam",
    )


def resolved_fast_paths(cfg: ExperimentConfig, facts: MachineFacts) -> FastPaths:
    """The fast paths of this config on a machine with ``facts``; a refusal names its key."""
    try:
        return resolve_fast_paths(fast_path_request(cfg), facts)
    except FastPathError as err:
        raise ConfigError(str(err)) from None


def check_performance_keys(cfg: ExperimentConfig) -> None:
    """Rules of the performance keys that hold on any machine."""
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
