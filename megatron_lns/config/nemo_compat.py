"""What NeMo 1.x ``megatron_gpt_config.yaml`` keys mean here.

Keys that map onto megatron-core are in the schema (``schema.py``) and honoured.
The keys below are valid in a NeMo 1.x config but drive PyTorch Lightning, NeMo's
own file formats or kernels megatron-core picks by itself: they are accepted and
listed together in one warning, never silently dropped. Anything else is an error.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

# Dotted paths; a trailing ".*" covers a whole sub-tree.
NEMO_KEYS_WITHOUT_MEANING_HERE: frozenset[str] = frozenset(
    {
        "restore_from_path",
        # PyTorch Lightning trainer internals.
        "trainer.logger",
        "trainer.enable_checkpointing",
        "trainer.replace_sampler_ddp",
        "trainer.use_distributed_sampler",
        "trainer.max_epochs",
        "trainer.max_time",
        "trainer.limit_test_batches",
        "trainer.accumulate_grad_batches",
        "trainer.benchmark",
        "trainer.enable_model_summary",
        "trainer.enable_progress_bar",
        "trainer.num_sanity_val_steps",
        "trainer.strategy",
        "trainer.plugins",
        # NeMo experiment manager internals and .nemo files.
        "exp_manager.explicit_log_dir",
        "exp_manager.resume_ignore_no_checkpoint",
        "exp_manager.create_checkpoint_callback",
        "exp_manager.create_neptune_logger",
        "exp_manager.neptune_logger_kwargs",
        "exp_manager.create_mlflow_logger",
        "exp_manager.mlflow_logger_kwargs",
        "exp_manager.log_step_timing",
        "exp_manager.step_timing_kwargs.*",
        "exp_manager.seconds_to_sleep",
        "exp_manager.checkpoint_callback_params.monitor",
        "exp_manager.checkpoint_callback_params.save_top_k",
        "exp_manager.checkpoint_callback_params.mode",
        "exp_manager.checkpoint_callback_params.always_save_nemo",
        "exp_manager.checkpoint_callback_params.save_nemo_on_train_end",
        "exp_manager.checkpoint_callback_params.filename",
        "exp_manager.checkpoint_callback_params.model_parallel_size",
        "exp_manager.checkpoint_callback_params.save_weights_only",
        # Model keys for NeMo's legacy (non-mcore) model, fusions megatron-core picks
        # itself, profiling and memory knobs.
        "model.mcore_gpt",
        "model.rampup_batch_size",
        "model.resume_from_checkpoint",
        "model.context_parallel_size",
        "model.kv_channels",
        "model.apply_query_key_layer_scaling",
        "model.use_scaled_init_method",
        "model.ffn_dropout",
        "model.do_layer_norm_weight_decay",
        "model.pre_process",
        "model.post_process",
        "model.persist_layer_norm",
        "model.headscale",
        "model.transformer_block_type",
        "model.openai_gelu",
        "model.normalize_attention_scores",
        "model.rotary_percentage",
        "model.attention_type",
        "model.overlap_p2p_comm",
        "model.batch_p2p_comm",
        "model.native_amp_init_scale",
        "model.native_amp_growth_interval",
        "model.hysteresis",
        "model.fp32_residual_connection",
        "model.fp16_lm_cross_entropy",
        "model.megatron_amp_O2",
        "model.grad_allreduce_chunk_size_mb",
        "model.grad_div_ar_fusion",
        "model.gradient_accumulation_fusion",
        "model.bias_activation_fusion",
        "model.bias_dropout_add_fusion",
        "model.masked_softmax_fusion",
        "model.get_attention_mask_from_fusion",
        "model.apply_rope_fusion",
        "model.cross_entropy_loss_fusion",
        "model.use_cpu_initialization",
        "model.onnx_safe",
        "model.apex_transformer_log_level",
        "model.gradient_as_bucket_view",
        "model.sync_batch_comm",
        "model.activations_checkpoint_granularity",
        "model.activations_checkpoint_method",
        "model.activations_checkpoint_num_layers",
        "model.num_micro_batches_with_partial_activation_checkpoints",
        "model.activations_checkpoint_layers_per_pipeline",
        "model.fp8_e4m3",
        "model.fp8_hybrid",
        "model.fp8_interval",
        "model.reduce_amax",
        "model.use_emha",
        "model.ub_tp_comm_overlap",
        "model.use_flash_attention",
        "model.gc_interval",
        "model.nsys_profile.*",
        "model.dist_ckpt_format",
        "model.dist_ckpt_load_on_device",
        "model.dist_ckpt_parallel_save",
        "model.tokenizer.vocab_file",
        "model.tokenizer.merge_file",
        "model.tokenizer.delimiter",
        "model.tokenizer.sentencepiece_legacy",
        "model.data.data_impl",
        "model.data.skip_warmup",
        "model.data.dataloader_type",
        "model.data.num_dataset_builder_threads",
        "model.optim.bucket_cap_mb",
        "model.optim.overlap_grad_sync",
        "model.optim.overlap_param_sync",
        "model.optim.contiguous_grad_buffer",
        "model.optim.grad_sync_dtype",
        "model.optim.sched.max_steps",
    }
)


def is_nemo_key_without_meaning(dotted: str) -> bool:
    if dotted in NEMO_KEYS_WITHOUT_MEANING_HERE:
        return True
    parts = dotted.split(".")
    return any(
        ".".join(parts[:i]) + ".*" in NEMO_KEYS_WITHOUT_MEANING_HERE
        for i in range(1, len(parts) + 1)
    )


def register_nemo_resolvers() -> None:
    """NeMo's custom OmegaConf resolvers used inside its YAML files."""
    if not OmegaConf.has_resolver("multiply"):
        OmegaConf.register_resolver("multiply", _multiply, replace=True)


def _multiply(x: Any, y: Any) -> Any:
    return x * y
