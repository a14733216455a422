"""What NeMo 1.x ``megatron_gpt_config.yaml`` keys mean here.

Keys that map onto megatron-core are in the schema (``schema.py``) and honoured. Every
other key of NeMo's GPT config has one entry in :data:`NEMO_KEYS`:

* ``Inert``: no value it can take changes the model or the run here (Lightning
  internals, ``.nemo`` naming, sub-keys of refused features, kernel choices that
  compute the same function). Accepted and listed together in one warning.
* ``Fixed``: megatron-lns always does one thing; the key is accepted silently when
  its value asks for that, and refused by name otherwise.
* ``When``: as ``Fixed``, but what is accepted depends on other settings.
* ``Translated``: honoured by setting a schema key.

OmegaConf types none of these keys, so each rule says which types its value may have
(``kinds``; a ``Fixed`` rule's are those of the values it accepts) and a value of
another type is refused, naming the key, before any rule reads it: ``'false'`` is no
boolean, ``abc`` no epoch count.

Keys in neither the schema nor this table are errors.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megatron_lns.config.output_inits import REGISTRY as OUTPUT_INIT_REGISTRY
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.settings import declared_settings, section
from megatron_lns.config.value_kinds import kind_problem, kinds_of_hint, shown


class NemoSettingError(ValueError):
    """A NeMo key whose value megatron-lns cannot honour (the loader turns it into a
    ConfigError)."""


def _refusal(key: str, value: Any, why: str) -> NemoSettingError:
    return NemoSettingError(f"{key}={value!r} is not supported ({why})")


@dataclass(frozen=True)
class Inert:
    why: str


@dataclass(frozen=True)
class Fixed:
    accepted: tuple[Any, ...]
    why: str

    @property
    def kinds(self) -> tuple[type, ...]:
        return tuple(dict.fromkeys(type(value) for value in self.accepted if value is not None))

    def apply(self, key: str, value: Any, cfg: ExperimentConfig) -> None:
        if value not in self.accepted:
            raise _refusal(key, value, self.why)


@dataclass(frozen=True)
class When:
    accepts: Callable[[Any, ExperimentConfig], bool]
    why: str
    kinds: tuple[type, ...]

    def apply(self, key: str, value: Any, cfg: ExperimentConfig) -> None:
        if not self.accepts(value, cfg):
            raise _refusal(key, value, self.why)


@dataclass(frozen=True)
class Translated:
    onto: Callable[[Any, ExperimentConfig], None]
    kinds: tuple[type, ...]

    def apply(self, key: str, value: Any, cfg: ExperimentConfig) -> None:
        self.onto(value, cfg)


def _scaled_init_onto_output_layer_init(value: Any, cfg: ExperimentConfig) -> None:
    """NeMo's ``use_scaled_init_method`` is megatron's N(0, std/sqrt(2L)) for the residual
    output projections, i.e. ``output_layer_init: scaled``; false is ``normal``."""
    wanted = next(
        name
        for name, init in OUTPUT_INIT_REGISTRY.items()
        if init.nemo_use_scaled_init_method == bool(value)
    )
    current = cfg.model.output_layer_init
    if current is None:
        cfg.model.output_layer_init = wanted
    elif current != wanted:
        raise NemoSettingError(
            f"model.use_scaled_init_method={value!r} contradicts "
            f"model.output_layer_init={current!r}: keep one of them"
        )


def _alias_of(key: str, alias: str) -> Translated:
    """Another name (megatron-core's ``model.recompute_granularity``) for the schema key it
    means (``model.activations_checkpoint_granularity``): the same setting, set either way."""
    name = key.rpartition(".")[2]

    def onto(value: Any, cfg: ExperimentConfig) -> None:
        holder = section(cfg, key)
        current = getattr(holder, name)
        if current is None:
            setattr(holder, name, value)
        elif current != value:
            raise NemoSettingError(
                f"{alias}={value!r} contradicts {key}={current!r}: they are the same setting; "
                "keep one of them"
            )

    return Translated(onto, kinds_of_hint(_schema_hint(key)))


def _schema_hint(key: str) -> Any:
    """The type of the schema key ``key`` (``model.optim.lr`` -> float)."""
    *sections, name = key.split(".")
    holder: Any = ExperimentConfig
    for part in sections:
        holder = typing.get_type_hints(holder)[part]
    return typing.get_type_hints(holder)[name]


def _alias_names() -> dict[str, str]:
    """Every alias a key declares (``settings.setting(aliases=...)``) -> that key."""
    names = {}
    for item in declared_settings(ExperimentConfig):
        parent = item.key.rpartition(".")[0]
        for alias in item.setting.aliases:
            names[f"{parent}.{alias}" if parent else alias] = item.key
    return names


# ``model.recompute_granularity`` -> ``model.activations_checkpoint_granularity``, ...: a
# key the schema holds under another name, so a command line sets it as it sets that key.
ALIASES = _alias_names()


def _aliases() -> dict[str, Translated]:
    """The rule of every alias."""
    return {alias: _alias_of(key, alias) for alias, key in ALIASES.items()}


def _hydra_defaults_without_groups(value: Any, cfg: ExperimentConfig) -> bool:
    """NeMo's ``defaults: [_self_, optional tp_overlap@...: null]`` composes nothing."""

    def composes_nothing(item: Any) -> bool:
        if item == "_self_":
            return True
        return isinstance(item, dict) and all(
            isinstance(k, str) and k.startswith("optional ") and v is None for k, v in item.items()
        )

    return isinstance(value, list) and all(composes_nothing(item) for item in value)


def _fp8_e4m3_onto_fp8_format(value: Any, cfg: ExperimentConfig) -> None:
    """NeMo's ``fp8_e4m3: true`` is ``model.fp8_format: e4m3``; false says nothing.

    NeMo picks E4M3 when ``fp8_e4m3`` is true and HYBRID otherwise when ``fp8_hybrid`` is
    (its own YAML sets ``fp8_hybrid: True``); ``model.fp8_format`` null means hybrid, so
    ``fp8_hybrid`` never changes anything and only ``fp8_e4m3`` can contradict it.
    """
    if not value:
        return
    current = cfg.model.fp8_format
    if current is None:
        cfg.model.fp8_format = "e4m3"
    elif current != "e4m3":
        raise NemoSettingError(
            f"model.fp8_e4m3=True contradicts model.fp8_format={current!r}: they are the "
            "same setting; keep one of them"
        )


LIGHTNING = Inert("PyTorch Lightning internals; megatron-lns runs its own loop")
ONLY_WITH_REFUSED = Inert("read only when a feature refused here is switched on")

# Dotted key -> rule. A key "x.*" covers every key below x that has no entry of its own.
NEMO_KEYS: dict[str, Inert | Fixed | When | Translated] = {
    "defaults": When(
        _hydra_defaults_without_groups,
        "Hydra config groups are not composed here; merge the group's YAML into the file",
        (list,),
    ),
    "restore_from_path": Fixed((None,), "starting from a .nemo file"),
    # trainer
    "trainer.logger": LIGHTNING,
    "trainer.enable_checkpointing": LIGHTNING,
    "trainer.replace_sampler_ddp": LIGHTNING,
    "trainer.use_distributed_sampler": LIGHTNING,
    "trainer.limit_test_batches": Inert("megatron-lns runs no test loop"),
    "trainer.benchmark": LIGHTNING,
    "trainer.enable_model_summary": LIGHTNING,
    "trainer.enable_progress_bar": LIGHTNING,
    "trainer.num_sanity_val_steps": LIGHTNING,
    "trainer.strategy": LIGHTNING,
    "trainer.plugins": LIGHTNING,
    "trainer.max_epochs": When(
        lambda v, cfg: v is None or v == -1 or v >= 1,
        "an epoch of NeMo's megatron sampler is the whole run; its length is trainer.max_steps",
        (int,),
    ),
    "trainer.max_time": Fixed(
        (None,), "no wall-clock limit: use trainer.exit_interval or the job's time limit"
    ),
    "trainer.accumulate_grad_batches": Fixed(
        (1,), "accumulation is model.global_batch_size / (micro_batch_size x data-parallel size)"
    ),
    # exp_manager
    "exp_manager.explicit_log_dir": Fixed(
        (None,), "the run directory is <exp_manager.exp_dir>/<exp_manager.name>"
    ),
    "exp_manager.resume_ignore_no_checkpoint": Fixed(
        (True,), "without a checkpoint to resume, a fresh run starts"
    ),
    "exp_manager.create_checkpoint_callback": Fixed(
        (True,), "runs always checkpoint, every checkpoint_callback_params.every_n_train_steps"
    ),
    "exp_manager.create_neptune_logger": Fixed((False,), "loggers: TensorBoard and W&B"),
    "exp_manager.create_mlflow_logger": Fixed((False,), "loggers: TensorBoard and W&B"),
    "exp_manager.create_dllogger_logger": Fixed((False,), "loggers: TensorBoard and W&B"),
    "exp_manager.create_clearml_logger": Fixed((False,), "loggers: TensorBoard and W&B"),
    "exp_manager.neptune_logger_kwargs": ONLY_WITH_REFUSED,
    "exp_manager.mlflow_logger_kwargs": ONLY_WITH_REFUSED,
    "exp_manager.dllogger_logger_kwargs": ONLY_WITH_REFUSED,
    "exp_manager.clearml_logger_kwargs": ONLY_WITH_REFUSED,
    "exp_manager.log_step_timing": Inert("step time and throughput are always logged"),
    "exp_manager.step_timing_kwargs": Inert("step time and throughput are always logged"),
    "exp_manager.seconds_to_sleep": Inert("a NeMo start-up pause"),
    "exp_manager.checkpoint_callback_params.monitor": Inert(
        "every checkpoint is kept; none is chosen by validation loss"
    ),
    "exp_manager.checkpoint_callback_params.save_top_k": Inert(
        "every checkpoint is kept; none is chosen by validation loss"
    ),
    "exp_manager.checkpoint_callback_params.mode": Inert(
        "every checkpoint is kept; none is chosen by validation loss"
    ),
    "exp_manager.checkpoint_callback_params.filename": Inert(
        "checkpoint directories are named by step"
    ),
    "exp_manager.checkpoint_callback_params.model_parallel_size": Inert(
        "derived from the parallel sizes"
    ),
    "exp_manager.checkpoint_callback_params.always_save_nemo": Fixed(
        (False,), "checkpoints are dist_checkpointing directories, no .nemo files"
    ),
    "exp_manager.checkpoint_callback_params.save_nemo_on_train_end": Fixed(
        (False,), "checkpoints are dist_checkpointing directories, no .nemo files"
    ),
    "exp_manager.checkpoint_callback_params.save_weights_only": Fixed(
        (False,), "checkpoints hold the optimizer state so that runs can resume"
    ),
    # exp_manager: NeMo hands these to nvidia-resiliency-ext; megatron-lns runs its own
    # watchdog and restarts (docs/resilience.md), whose keys are in the schema.
    "exp_manager.fault_tolerance.rank_termination_signal": Inert(
        "the watchdog ends a hung attempt itself: its ranks exit and the launcher kills the rest"
    ),
    "exp_manager.fault_tolerance.log_level": Inert(
        "ft_launcher's log level; the watchdog writes to the run's log"
    ),
    "exp_manager.fault_tolerance.max_subsequent_job_failures": Fixed(
        (0,),
        "no continuation job is prescheduled: a SLURM job restarts in-job (exp_manager."
        "fault_tolerance.max_rank_restarts) and requeues itself (cluster.max_requeues)",
    ),
    "exp_manager.fault_tolerance.additional_ft_launcher_args": Fixed(
        ("",), "megatron-lns does not run ft_launcher"
    ),
    "exp_manager.fault_tolerance.simulated_fault": Fixed(
        (None,), "faults are injected with the MEGATRON_LNS_INJECT_FAULT environment variable"
    ),
    "exp_manager.straggler_detection_params.report_time_interval": Inert(
        "reports come every straggler_detection_params.report_every_n_steps steps"
    ),
    "exp_manager.straggler_detection_params.calc_relative_gpu_perf": Inert(
        "each rank's compute time per step is always compared with the median rank's"
    ),
    "exp_manager.straggler_detection_params.calc_individual_gpu_perf": Inert(
        "a GPU's own kernel timings (CUPTI) are not measured"
    ),
    "exp_manager.straggler_detection_params.num_gpu_perf_scores_to_log": Inert(
        "every rank's compute time goes to TensorBoard; the log names the stragglers"
    ),
    "exp_manager.straggler_detection_params.gpu_relative_perf_threshold": Inert(
        "the threshold here is straggler_detection_params.slower_than_median"
    ),
    "exp_manager.straggler_detection_params.gpu_individual_perf_threshold": Inert(
        "a GPU's own kernel timings (CUPTI) are not measured"
    ),
    "exp_manager.straggler_detection_params.stop_if_detected": Fixed(
        (False,), "a straggler is named, not stopped: the run goes on"
    ),
    # model: what is built
    "model.mcore_gpt": Fixed((True,), "the model is megatron-core's GPTModel"),
    "model.transformer_block_type": Fixed(
        ("pre_ln",),
        "blocks are pre-LN unless model.layer_variant says otherwise: Post-LN is "
        "model.layer_variant=post_ln, which needs model.norm_scaling=none and "
        "model.transformer_engine=false; NormFormer is not built",
    ),
    "model.rotary_percentage": Fixed((1.0,), "RoPE rotates the whole head dimension"),
    "model.headscale": Fixed((False,), "no learned per-head output scales"),
    "model.openai_gelu": Fixed((False,), "model.activation=gelu is the exact GELU"),
    "model.normalize_attention_scores": Fixed(
        (True,), "attention scores are scaled by 1/sqrt(head dim)"
    ),
    "model.attention_type": Fixed(("multihead",), "attention is multi-head (or grouped-query)"),
    "model.ffn_dropout": Fixed((0.0,), "no dropout inside the MLP; use model.hidden_dropout"),
    "model.pre_process": Fixed((True,), "every model has its embedding"),
    "model.post_process": Fixed((True,), "every model has its output layer"),
    "model.use_scaled_init_method": Translated(_scaled_init_onto_output_layer_init, (bool,)),
    "model.resume_from_checkpoint": Fixed(
        (None,),
        "NeMo's Lightning .ckpt; choose a megatron-lns checkpoint directory with "
        "exp_manager.resume_from_checkpoint",
    ),
    "model.fsdp": Fixed((False,), "PyTorch FSDP; shard with optim.name=distributed_fused_adam"),
    "model.fsdp_sharding_strategy": ONLY_WITH_REFUSED,
    "model.fsdp_grad_reduce_dtype": ONLY_WITH_REFUSED,
    "model.fsdp_sharded_checkpoint": ONLY_WITH_REFUSED,
    # model: precision
    "model.megatron_amp_O2": Inert(
        "bf16/fp16 always train megatron's way: half-precision model, fp32 main weights "
        "in the optimizer (NeMo's O2)"
    ),
    "model.fp8_e4m3": Translated(_fp8_e4m3_onto_fp8_format, (bool,)),
    # Accepted either way: true is the default format, false defers to fp8_e4m3 (as NeMo).
    "model.fp8_hybrid": Fixed((True, False), "model.fp8_format picks the FP8 format"),
    "model.fp16_lm_cross_entropy": Fixed(
        (False,),
        "megatron-core 0.19's GPTModel takes fp16_lm_cross_entropy but never reads it: its "
        "vocab-parallel cross entropy always computes in fp32",
    ),
    "model.fp8_interval": Fixed(
        (1,),
        "FP8 scaling factors update every step: Transformer Engine >= 1.8 ignores "
        "megatron-core's fp8_interval",
    ),
    "model.reduce_amax": Fixed((True,), "FP8 amax is reduced across ranks"),
    "model.use_emha": Fixed((False,), "NeMo itself does not support it"),
    # model: performance and memory (megatron-core names of schema keys; keys without a
    # megatron-core 0.19 counterpart)
    "model.grad_allreduce_chunk_size_mb": Inert(
        "the chunk size of NeMo's own gradient all-reduce in its fp32 main-params wrapper, "
        "which megatron-core does not have; megatron DDP's buckets are model.optim.bucket_cap_mb"
    ),
    "model.num_micro_batches_with_partial_activation_checkpoints": Fixed(
        (None,),
        "megatron-core 0.19's pipeline schedules compute the per-micro-batch flag but its "
        "GPTModel has no input that takes it (only Megatron-LM's legacy model did)",
    ),
    "model.activations_checkpoint_layers_per_pipeline": Fixed(
        (None,),
        "megatron-core 0.19 has no per-pipeline-stage recompute layer count; use "
        "model.activations_checkpoint_num_layers",
    ),
    "model.dist_ckpt_format": Inert("checkpoints are written in torch_dist format"),
    "model.dist_ckpt_load_on_device": Inert("where a checkpoint is read into"),
    # model: kernels and communication no megatron-core component here reads
    "model.persist_layer_norm": Inert(
        "megatron-core reads it only in Apex's FusedLayerNorm, which neither layer spec here "
        "uses (local: megatron-lns's norms; TE: the norm fused into TE's LayerNormLinear)"
    ),
    "model.grad_div_ar_fusion": Inert(
        "NeMo's distributed Adam fuses the gradient division into its all-reduce; megatron "
        "DDP scales gradients itself"
    ),
    "model.get_attention_mask_from_fusion": Inert(
        "NeMo's switch for building the causal mask inside its fused softmax; megatron-core "
        "builds it from the attention mask type"
    ),
    "model.sync_batch_comm": Inert("a stream synchronisation after pipeline communication"),
    "model.use_cpu_initialization": Inert("where weights are initialised (CPU without CUDA)"),
    "model.gradient_as_bucket_view": Inert("megatron DDP always uses contiguous grad buffers"),
    "model.onnx_safe": Inert("ONNX export workarounds"),
    "model.apex_transformer_log_level": Inert("a log level"),
    # model.tokenizer
    "model.tokenizer.vocab_file": Fixed(
        (None,), "give a Hugging Face tokenizer directory in model.tokenizer.type"
    ),
    "model.tokenizer.merge_file": Fixed(
        (None,), "give a Hugging Face tokenizer directory in model.tokenizer.type"
    ),
    "model.tokenizer.delimiter": Inert("used by NeMo's tabular tokenizer only"),
    "model.tokenizer.sentencepiece_legacy": Fixed((False,), "legacy SentencePiece special tokens"),
    # model.data
    "model.data.data_impl": Fixed(("mmap",), "megatron-core reads mmap indexed datasets"),
    "model.data.mmap_bin_files": Inert("whether .bin files are mapped or read; same samples"),
    "model.data.skip_warmup": Inert("megatron-core's datasets have no warm-up"),
    "model.data.dataloader_type": Fixed(("single",), "samples follow megatron's shuffled index"),
    "model.data.validation_drop_last": Fixed(
        (True,), "a partial last validation sequence is dropped"
    ),
    "model.data.no_seqlen_plus_one_input_tokens": Fixed(
        (False,), "samples hold seq_length + 1 tokens (inputs and shifted labels)"
    ),
    "model.data.pad_samples_to_global_batch_size": Fixed((False,), "every global batch is full"),
    "model.data.shuffle_documents": Fixed((True,), "megatron-core shuffles documents"),
    "model.data.exchange_indices_distributed": Inert(
        "how ranks share the index mappings; they are the same either way"
    ),
    "model.data.num_dataset_builder_threads": Inert("threads building the same datasets"),
    # model.optim
    "model.optim.contiguous_grad_buffer": Fixed((True,), "gradients live in contiguous buffers"),
    "model.optim.sched.max_steps": When(
        lambda v, cfg: v is None or v == cfg.trainer.max_steps,
        "the schedule spans trainer.max_steps",
        (int,),
    ),
}


# megatron-core 0.19's MoE settings that megatron-lns does not honour: accepted at their
# megatron-core default only, refused by name otherwise.
_CUDA_KERNELS = "it runs CUDA-only kernels (DeepEP, HybridEP, NCCL EP, TE fusions) not tested here"
_UNBUILT = "a mixture-of-experts design megatron-lns does not build or export"
MOE_NOT_HONOURED: dict[str, Fixed] = {
    f"model.{name}": Fixed(accepted, why)
    for name, accepted, why in [
        ("moe_enable_deepep", (False,), _CUDA_KERNELS),
        ("moe_flex_dispatcher_backend", ("deepep",), _CUDA_KERNELS),
        ("moe_permute_fusion_into_hybridep", (False,), _CUDA_KERNELS),
        ("moe_hybridep_pad_uneven_dispatch_inputs", (False,), _CUDA_KERNELS),
        ("moe_expert_rank_capacity_factor", (None,), _CUDA_KERNELS),
        ("moe_router_fusion", (False,), _CUDA_KERNELS),
        ("moe_paged_stash", (False,), _CUDA_KERNELS),
        ("overlap_moe_expert_parallel_comm", (False,), _CUDA_KERNELS),
        ("overlap_dispatch_backward_with_experts_wgrad", (False,), _CUDA_KERNELS),
        ("moe_pad_experts_for_cuda_graph_inference", (False,), _CUDA_KERNELS),
        ("use_grouped_gemm_for_shared_expert", (False,), _CUDA_KERNELS),
        ("moe_single_grouped_weight", (False,), _CUDA_KERNELS),
        ("moe_single_grouped_bias", (False,), _CUDA_KERNELS),
        ("moe_latent_size", (None,), _UNBUILT),
        ("moe_apply_probs_on_input", (False,), _UNBUILT),
        ("moe_router_num_groups", (None,), _UNBUILT + " (device-limited routing)"),
        ("moe_router_group_topk", (None,), _UNBUILT + " (device-limited routing)"),
        ("moe_router_topk_limited_devices", (None,), _UNBUILT + " (device-limited routing)"),
        ("moe_router_padding_for_fp8", (False,), _UNBUILT),
        ("moe_router_padding_for_quantization", (False,), _UNBUILT),
        ("moe_shared_expert_glu_interleave_size", (None,), _UNBUILT),
        ("moe_mlp_glu_interleave_size", (None,), _UNBUILT),
        ("moe_input_jitter_eps", (None,), "training-time router input noise, not tested here"),
        ("moe_router_force_load_balancing", (False,), "a benchmarking mode, not training"),
        ("moe_enable_routing_replay", (False,), "routing replay is for RL rollouts"),
        ("moe_token_dropping", (False,), "deprecated; use model.moe_expert_capacity_factor"),
        ("moe_layer_recompute", (False,), "deprecated; use model.recompute_modules: [moe]"),
        ("expert_tensor_parallel_num_weight_shards", (None,), _UNBUILT),
        ("inference_moe_token_dispatcher_type", ("nvls",), "megatron-core inference only"),
    ]
}
NEMO_KEYS.update(MOE_NOT_HONOURED)

# megatron-core's deprecated ways to ask for a hybrid pattern (NeMo's Mamba configs use
# them): accepted unset only, the pattern is model.hybrid_layer_pattern.
_RATIO = "deprecated in megatron-core 0.19; give model.hybrid_layer_pattern"
NEMO_KEYS.update(
    {
        "model.hybrid_attention_ratio": Fixed((None, 0.0), _RATIO),
        "model.hybrid_mlp_ratio": Fixed((None, 0.0), _RATIO),
    }
)

# Other names of schema keys, from the keys' declarations.
NEMO_KEYS.update(_aliases())


def nemo_rule(dotted: str) -> Inert | Fixed | When | Translated | None:
    """The entry for ``dotted``: its own, else the nearest ``ancestor.*`` above it."""
    if dotted in NEMO_KEYS:
        return NEMO_KEYS[dotted]
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        rule = NEMO_KEYS.get(".".join(parts[:i]) + ".*")
        if rule is not None:
            return rule
    return None


def has_nemo_keys_below(dotted: str) -> bool:
    return any(key.startswith(dotted + ".") for key in NEMO_KEYS)


def apply_nemo_settings(cfg: ExperimentConfig, values: dict[str, Any]) -> None:
    """Honour or refuse each non-inert NeMo key, in the order given; a value of a type
    its rule does not take is refused before the rule reads it."""
    for key, value in values.items():
        rule = nemo_rule(key)
        assert rule is not None and not isinstance(rule, Inert), key
        if problem := kind_problem(value, rule.kinds):
            raise NemoSettingError(f"{key} {problem}, got {shown(value)}")
        rule.apply(key, value, cfg)


def normalize_nemo_spellings(raw: DictConfig) -> None:
    """NeMo values spelled differently here. ``model.fp8`` is a boolean switch in NeMo
    and the FP8 recipe's name here: false means off; true has no single meaning."""
    model = raw.get("model")
    if not isinstance(model, DictConfig) or "fp8" not in model:
        return
    if OmegaConf.is_interpolation(model, "fp8"):
        return
    if model.fp8 is False:
        model.fp8 = None
    elif model.fp8 is True:
        raise NemoSettingError(
            "model.fp8=True: here model.fp8 names the FP8 recipe; NeMo's fp8: True is "
            "model.fp8=delayed (with model.fp8_format=hybrid or e4m3)"
        )


def register_nemo_resolvers() -> None:
    """NeMo's custom OmegaConf resolvers used inside its YAML files (``multiply``;
    ``sum`` in ``cpu_offloading_num_layers: ${sum:${.num_layers},-1}``)."""
    if not OmegaConf.has_resolver("multiply"):
        OmegaConf.register_resolver("multiply", _multiply, replace=True)
    if not OmegaConf.has_resolver("sum"):
        OmegaConf.register_resolver("sum", _sum, replace=True)


def _multiply(x: Any, y: Any) -> Any:
    return x * y


def _sum(*values: Any) -> Any:
    return sum(values)
