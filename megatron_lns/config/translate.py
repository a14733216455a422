"""From the NeMo-style config to the typed components that build the run."""

from __future__ import annotations

from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.validate import PRECISIONS
from megatron_lns.model import GPTModelConfig, padded_vocab_size
from megatron_lns.runtime import ParallelLayout
from megatron_lns.training.optim import OptimSettings

_NORMALIZATION = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm", "layernorm1p": "LayerNorm"}
_SCHEDULE = {"CosineAnnealing": "cosine", "LinearAnnealing": "linear", "Constant": "constant"}


def parallel_layout(cfg: ExperimentConfig) -> ParallelLayout:
    m = cfg.model
    return ParallelLayout(
        tensor=m.tensor_model_parallel_size,
        pipeline=m.pipeline_model_parallel_size,
        virtual_pipeline=m.virtual_pipeline_model_parallel_size,
        sequence_parallel=m.sequence_parallel,
    )


def precision(cfg: ExperimentConfig) -> str:
    return PRECISIONS[str(cfg.trainer.precision)]


def model_config(cfg: ExperimentConfig, tokenizer_vocab_size: int) -> GPTModelConfig:
    m = cfg.model
    return GPTModelConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        vocab_size=padded_vocab_size(
            tokenizer_vocab_size, m.tensor_model_parallel_size, m.make_vocab_size_divisible_by
        ),
        seq_length=m.encoder_seq_length,
        ffn_hidden_size=m.ffn_hidden_size,
        num_query_groups=m.num_query_groups,
        max_position_embeddings=m.max_position_embeddings,
        norm_scaling=m.norm_scaling,
        normalization=_NORMALIZATION[m.normalization],
        norm_affine=m.norm_affine,
        layernorm_epsilon=m.layernorm_epsilon,
        layernorm_zero_centered_gamma=m.normalization == "layernorm1p",
        activation=m.activation,
        bias=m.bias,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
        init_method_std=m.init_method_std,
        output_layer_init=m.output_layer_init,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        precision=precision(cfg),
        backend="te" if m.transformer_engine else "local",
        fp8=m.fp8,
        fp8_format=m.fp8_format,
        fp8_param=m.fp8_param,
        fp8_margin=m.fp8_margin,
        fp8_amax_history_len=m.fp8_amax_history_len,
        fp8_amax_compute_algo=m.fp8_amax_compute_algo,
    )


def optim_settings(cfg: ExperimentConfig) -> OptimSettings:
    o, sched = cfg.model.optim, cfg.model.optim.sched
    return OptimSettings(
        name="sgd" if o.name == "sgd" else "adam",
        lr=o.lr,
        min_lr=sched.min_lr,
        betas=(float(o.betas[0]), float(o.betas[1])),
        eps=o.eps,
        weight_decay=o.weight_decay,
        clip_grad=float(cfg.trainer.gradient_clip_val or 0.0),
        warmup_steps=sched.warmup_steps,
        decay_steps=cfg.trainer.max_steps - sched.constant_steps,
        decay_style=_SCHEDULE[sched.name],
        use_distributed_optimizer=o.name == "distributed_fused_adam",
    )
