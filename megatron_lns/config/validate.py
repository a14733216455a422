"""Consistency checks, run before any process group or model exists.

Each failure is a :class:`ConfigError` whose one-line message names the key.
"""

from __future__ import annotations

from pathlib import Path

from megatron_lns.config.cluster import validate_cluster
from megatron_lns.config.loader import ConfigError
from megatron_lns.config.schema import ExperimentConfig

PRECISIONS = {
    "32": "fp32",
    "32-true": "fp32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "16": "fp16",
    "16-mixed": "fp16",
}
NORMALIZATIONS = ("rmsnorm", "layernorm", "layernorm1p")
ACTIVATIONS = ("swiglu", "gelu")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
TOKENIZER_LIBRARIES = ("byte", "huggingface", "sentencepiece")
OPTIMIZERS = ("fused_adam", "adam", "adamw", "distributed_fused_adam", "sgd")
SCHEDULES = ("CosineAnnealing", "LinearAnnealing", "Constant")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# Minimum CUDA compute capability per FP8 recipe (Ada/Hopper for FP8, Blackwell for MXFP8).
FP8_MIN_CAPABILITY = {
    "delayed": (8, 9),
    "tensorwise": (8, 9),
    "blockwise": (9, 0),
    "mxfp8": (10, 0),
}
BUILTIN_PREFIX = "builtin:"


def _choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def _divisible(key: str, value: int, by_key: str, by: int, shown: str | None = None) -> None:
    if value % by:
        raise ConfigError(f"{key} ({value}) is not divisible by {by_key} ({shown or by})")


def _positive(key: str, value) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def data_blend(prefix_list: list) -> tuple[list[str], list[float] | None]:
    """NeMo's data_prefix ([w, path, w, path, ...] or [path, ...]) as megatron's blend."""
    items = list(prefix_list)
    if not items:
        raise ConfigError("model.data.data_prefix is empty: give at least one dataset prefix")
    if all(isinstance(x, str) for x in items):
        return items, None
    if len(items) % 2 or not all(isinstance(w, (int, float)) for w in items[0::2]):
        raise ConfigError(
            "model.data.data_prefix must be [path, ...] or [weight, path, weight, path, ...]"
        )
    weights = [float(w) for w in items[0::2]]
    if any(w <= 0 for w in weights):
        raise ConfigError(f"model.data.data_prefix weights must be positive, got {weights}")
    return [str(p) for p in items[1::2]], weights


def validate(
    cfg: ExperimentConfig, world_size: int | None = None, check_files: bool = True
) -> None:
    t, m = cfg.trainer, cfg.model
    _choice("trainer.precision", str(t.precision), PRECISIONS)
    _choice("trainer.accelerator", t.accelerator, ("auto", "cpu", "gpu"))
    for key in ("num_nodes", "devices", "max_steps", "val_check_interval", "log_every_n_steps"):
        _positive(f"trainer.{key}", getattr(t, key))
    if t.exit_interval is not None:
        _positive("trainer.exit_interval", t.exit_interval)
    if t.limit_val_batches < 0:
        raise ConfigError(f"trainer.limit_val_batches must be >= 0, got {t.limit_val_batches}")
    _positive(
        "exp_manager.checkpoint_callback_params.every_n_train_steps",
        cfg.exp_manager.checkpoint_callback_params.every_n_train_steps,
    )

    _choice("model.norm_scaling", m.norm_scaling, ("lns", "none"))
    _choice("model.normalization", m.normalization, NORMALIZATIONS)
    _choice("model.activation", m.activation, ACTIVATIONS)
    _choice("model.position_embedding_type", m.position_embedding_type, POSITION_EMBEDDINGS)
    if m.output_layer_init is not None:
        _choice("model.output_layer_init", m.output_layer_init, ("normal", "scaled"))
    _choice("model.tokenizer.library", m.tokenizer.library, TOKENIZER_LIBRARIES)
    _choice("model.optim.name", m.optim.name, OPTIMIZERS)
    _choice("model.optim.sched.name", m.optim.sched.name, SCHEDULES)
    if m.normalization == "layernorm1p" and not m.norm_affine:
        raise ConfigError("model.normalization=layernorm1p needs model.norm_affine=true")

    for key in (
        "micro_batch_size",
        "global_batch_size",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "encoder_seq_length",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
    ):
        _positive(f"model.{key}", getattr(m, key))
    tp, pp, vp = (
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
    )
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    tp_key = "model.tensor_model_parallel_size"
    _divisible("model.hidden_size", m.hidden_size, "model.num_attention_heads", heads)
    _divisible("model.num_attention_heads", heads, "model.num_query_groups", groups)
    _divisible("model.num_attention_heads", heads, tp_key, tp)
    _divisible("model.num_query_groups", groups, tp_key, tp)
    if m.ffn_hidden_size is not None:
        _divisible("model.ffn_hidden_size", m.ffn_hidden_size, tp_key, tp)
    if vp is not None:
        _positive("model.virtual_pipeline_model_parallel_size", vp)
        if pp < 2:
            raise ConfigError(
                "model.virtual_pipeline_model_parallel_size needs "
                "model.pipeline_model_parallel_size > 1"
            )
    _divisible(
        "model.num_layers",
        m.num_layers,
        "model.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size",
        pp * (vp or 1),
        shown=f"{pp} x {vp or 1}",
    )
    if m.sequence_parallel and tp < 2:
        raise ConfigError("model.sequence_parallel needs model.tensor_model_parallel_size > 1")
    if m.data.seq_length != m.encoder_seq_length:
        raise ConfigError(
            f"model.data.seq_length ({m.data.seq_length}) differs from "
            f"model.encoder_seq_length ({m.encoder_seq_length})"
        )
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.encoder_seq_length:
        raise ConfigError(
            f"model.max_position_embeddings ({m.max_position_embeddings}) is smaller than "
            f"model.encoder_seq_length ({m.encoder_seq_length})"
        )
    if m.fp8 is not None:
        _choice("model.fp8", m.fp8, FP8_RECIPES)
        if not m.transformer_engine:
            raise ConfigError(
                "model.fp8 needs model.transformer_engine=true (FP8 runs in Transformer Engine)"
            )
        _choice("model.fp8_format", m.fp8_format, ("hybrid", "e4m3"))
        _choice("model.fp8_amax_compute_algo", m.fp8_amax_compute_algo, ("max", "most_recent"))
        if PRECISIONS[str(t.precision)] != "bf16":
            raise ConfigError(
                f"model.fp8 needs trainer.precision=bf16-mixed (got {t.precision}): FP8 GEMMs "
                "run inside bf16 mixed precision"
            )

    world = world_size if world_size is not None else t.num_nodes * t.devices
    if world % (tp * pp):
        raise ConfigError(
            f"world size {world} (trainer.num_nodes x trainer.devices) is not divisible by "
            f"tensor x pipeline parallel size ({tp} x {pp})"
        )
    dp = world // (tp * pp)
    if m.global_batch_size % (m.micro_batch_size * dp):
        raise ConfigError(
            f"model.global_batch_size ({m.global_batch_size}) is not divisible by "
            f"model.micro_batch_size x data-parallel size ({m.micro_batch_size} x {dp})"
        )
    sched = m.optim.sched
    if sched.name != "Constant" and sched.warmup_steps + sched.constant_steps >= t.max_steps:
        raise ConfigError(
            f"model.optim.sched.warmup_steps + constant_steps ({sched.warmup_steps} + "
            f"{sched.constant_steps}) must be smaller than trainer.max_steps ({t.max_steps})"
        )
    if sched.min_lr > m.optim.lr:
        raise ConfigError(
            f"model.optim.sched.min_lr ({sched.min_lr}) exceeds model.optim.lr ({m.optim.lr})"
        )

    tok = m.tokenizer
    if tok.library == "huggingface" and not tok.type:
        raise ConfigError(
            "model.tokenizer.type must be the local directory of a Hugging Face tokenizer"
        )
    if tok.library == "sentencepiece" and not tok.model:
        raise ConfigError("model.tokenizer.model must be the path of a SentencePiece .model file")
    paths, _ = data_blend(m.data.data_prefix)
    if check_files:
        if tok.library == "huggingface" and not Path(tok.type).exists():
            raise ConfigError(
                f"model.tokenizer.type: {tok.type} does not exist (give a local path)"
            )
        if tok.library == "sentencepiece" and not Path(tok.model).is_file():
            raise ConfigError(f"model.tokenizer.model: {tok.model} does not exist")
        for prefix in paths:
            if prefix.startswith(BUILTIN_PREFIX):
                continue
            for suffix in (".bin", ".idx"):
                if not Path(prefix + suffix).is_file():
                    raise ConfigError(f"model.data.data_prefix: {prefix}{suffix} does not exist")
    validate_cluster(cfg)


def check_environment(cfg: ExperimentConfig) -> None:
    """What the machine must offer for this config (CUDA, Transformer Engine, FP8 support).

    Separate from :func:`validate` so a config can be checked on any machine; the
    launcher runs both before any process starts.
    """
    import torch

    m = cfg.model
    cuda = torch.cuda.is_available()
    if cfg.trainer.accelerator == "gpu" and not cuda:
        raise ConfigError("trainer.accelerator=gpu but CUDA is not available on this machine")
    if m.transformer_engine:
        from megatron_lns.te import INSTALL_HINT, te_available

        if not cuda:
            raise ConfigError("model.transformer_engine=true needs a CUDA GPU")
        if not te_available():
            raise ConfigError(f"model.transformer_engine=true: {INSTALL_HINT}")
    if m.optim.name == "distributed_fused_adam":
        from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

        if not HAVE_APEX_OR_TE:
            # megatron-core's DistributedOptimizer cannot rebuild its state for a
            # checkpoint load with plain torch optimizers (empty-state assertion).
            raise ConfigError(
                "model.optim.name=distributed_fused_adam needs Transformer Engine or Apex "
                "(megatron's distributed optimizer cannot resume from a checkpoint without "
                "them); use fused_adam, or install Transformer Engine on a CUDA machine"
            )
    if m.fp8 is not None:
        needed = FP8_MIN_CAPABILITY[m.fp8]
        capability = torch.cuda.get_device_capability() if cuda else None
        if capability is None or tuple(capability) < needed:
            if capability is None:
                have = "no CUDA GPU"
            else:
                major, minor = capability
                have = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"
            raise ConfigError(
                f"model.fp8={m.fp8} needs compute capability >= {needed[0]}.{needed[1]}, "
                f"this machine has {have}"
            )
