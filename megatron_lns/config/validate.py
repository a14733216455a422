"""Checks run before any process group or model exists.

The rule for each single value is declared next to its field in ``schema.py``; this
module runs them and adds the rules that relate several keys (divisibility, world
size, schedule length, files). Each failure is a :class:`ConfigError` whose one-line
message names the key.
"""

from __future__ import annotations

from megatron_lns.base.path_kind import not_a_directory, not_a_file
from megatron_lns.config import layout, model_derived
from megatron_lns.config.choices import PRE_NORM_VARIANTS, lns_combines_with, warmup_fits
from megatron_lns.config.cluster import validate_cluster
from megatron_lns.config.data_checks import check_datasets, check_tokenizer
from megatron_lns.config.hybrid_rules import check_hybrid, hybrid_segments
from megatron_lns.config.layer_variants import variant_info
from megatron_lns.config.layout import ParallelLayout, micro_batches_per_step
from megatron_lns.config.loader import ConfigError
from megatron_lns.config.moe_rules import check_moe
from megatron_lns.config.norm_scalings import UNSCALED
from megatron_lns.config.output_inits import resolved_output_init
from megatron_lns.config.paths import check_writable_paths
from megatron_lns.config.performance import (
    check_performance_keys,
)
from megatron_lns.config.schema import PRECISIONS, SCHEDULES, ExperimentConfig
from megatron_lns.config.settings import value_errors
from megatron_lns.data.blend import DataBlend, DataBlendError
from megatron_lns.data.tokenizer import HUGGING_FACE_DIRECTORY_HINT, TOKENIZER_FILE_FIELD


def _divisible(key: str, value: int, by_key: str, by: int, shown: str | None = None) -> None:
    if value % by:
        raise ConfigError(f"{key} ({value}) is not divisible by {by_key} ({shown or by})")


def _held_out_split_problem(problem: str, split: str) -> bool:
    """Whether ``problem`` is only that ``split`` gives training no share (three
    non-negative weights, the validation one positive)."""
    from megatron_lns.data.splits import split_weights

    weights = split_weights(split) if len(str(split).split(",")) == 3 else None
    return problem.startswith("model.data.splits_string ") and bool(weights) and weights[1] > 0


def data_blend(data_prefix) -> DataBlend:
    """``model.data.data_prefix`` as a blend; a malformed list names the key."""
    try:
        blend = DataBlend.parse(data_prefix)
        blend.check_builtin_names()
        return blend
    except DataBlendError as err:
        raise ConfigError(f"model.data.{err}") from None


def validate(
    cfg: ExperimentConfig,
    world_size: int | None = None,
    check_files: bool = True,
    held_out_only: bool = False,
) -> None:
    """Every declared value rule (``schema.py``), then the rules that relate keys; with
    ``check_files`` also the files the run reads and the directories it writes.

    ``held_out_only`` validates for a command that reads only the held-out data
    (``analyze``): a split string that gives training no share is then accepted."""
    problem = next(
        (
            p
            for p in value_errors(cfg)
            if not (held_out_only and _held_out_split_problem(p, cfg.model.data.splits_string))
        ),
        None,
    )
    if problem:
        raise ConfigError(problem)
    t, m = cfg.trainer, cfg.model
    if m.normalization == "layernorm1p" and not m.norm_affine:
        raise ConfigError("model.normalization=layernorm1p needs model.norm_affine=true")

    tp, pp, vp = (
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
    )
    heads, groups = m.num_attention_heads, model_derived.query_groups(m)
    tp_key = "model.tensor_model_parallel_size"
    _check_head_size(m)
    _divisible("model.num_attention_heads", heads, "model.num_query_groups", groups)
    _divisible("model.num_attention_heads", heads, tp_key, tp)
    _divisible("model.num_query_groups", groups, tp_key, tp)
    if m.ffn_hidden_size is not None:
        _divisible("model.ffn_hidden_size", m.ffn_hidden_size, tp_key, tp)
    if vp is not None and pp < 2:
        raise ConfigError(
            "model.virtual_pipeline_model_parallel_size needs "
            "model.pipeline_model_parallel_size > 1"
        )
    if m.hybrid_layer_pattern is None:  # a pattern's '|' split it (check_hybrid)
        _divisible(
            "model.num_layers",
            m.num_layers,
            "model.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size",
            pp * (vp or 1),
            shown=f"{pp} x {vp or 1}",
        )
    check_hybrid(m)
    if m.sequence_parallel and tp < 2:
        raise ConfigError("model.sequence_parallel needs model.tensor_model_parallel_size > 1")
    _check_recompute(m)
    check_performance_keys(cfg, check_files)
    if float(str(m.data.splits_string).split(",")[1]) == 0 and t.limit_val_batches > 0:
        raise ConfigError(
            f"model.data.splits_string={m.data.splits_string} leaves validation no data but "
            f"trainer.limit_val_batches={t.limit_val_batches} asks for it: give the second "
            "(valid) weight a share, or set trainer.limit_val_batches=0 to train without "
            "validation"
        )
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
    if not lns_combines_with(m.norm_scaling, m.layer_variant):
        raise ConfigError(
            f"model.norm_scaling={m.norm_scaling} scales pre-norm outputs and "
            f"model.layer_variant={m.layer_variant} {variant_info(m.layer_variant).lns_refusal}: "
            f"set model.norm_scaling={' or '.join(UNSCALED)} or choose one of "
            f"{', '.join(PRE_NORM_VARIANTS)}"
        )
    if m.transformer_engine and variant_info(m.layer_variant).changes_layer:
        raise ConfigError(
            f"model.layer_variant={m.layer_variant} needs model.transformer_engine=false: "
            "Transformer Engine fuses each norm into the next linear"
        )
    init = resolved_output_init(m.output_layer_init, m.norm_scaling)
    if m.transformer_engine and init.per_layer:
        raise ConfigError(
            f"model.output_layer_init={init.name} needs model.transformer_engine=false: each "
            "layer's std is set by megatron-lns's local layer"
        )
    if m.fp8 is not None:
        if not m.transformer_engine:
            raise ConfigError(
                "model.fp8 needs model.transformer_engine=true (FP8 runs in Transformer Engine)"
            )
        if PRECISIONS[str(t.precision)] != "bf16":
            raise ConfigError(
                f"model.fp8 needs trainer.precision=bf16-mixed (got {t.precision}): FP8 GEMMs "
                "run inside bf16 mixed precision"
            )

    world = world_size if world_size is not None else layout.world_size(t.num_nodes, t.devices)
    cp = m.context_parallel_size
    try:
        dp = ParallelLayout(tensor=tp, pipeline=pp, context=cp).data_parallel(world)
    except ValueError:
        raise ConfigError(
            f"world size {world} (trainer.num_nodes x trainer.devices) is not divisible by "
            f"tensor x pipeline x context parallel size ({tp} x {pp} x {cp})"
        ) from None
    try:
        microbatches = micro_batches_per_step(m.global_batch_size, m.micro_batch_size, dp)
    except ValueError:
        raise ConfigError(
            f"model.global_batch_size ({m.global_batch_size}) is not divisible by "
            f"model.micro_batch_size x data-parallel size ({m.micro_batch_size} x {dp})"
        ) from None
    if m.rampup_batch_size is not None:
        _check_rampup(m, dp)
    elif vp is not None and microbatches % pp:
        raise ConfigError(
            f"model.global_batch_size / (model.micro_batch_size x data-parallel size) = "
            f"{microbatches} micro-batches per step is not a multiple of "
            f"model.pipeline_model_parallel_size ({pp}): megatron's interleaved schedule "
            "(virtual pipeline) runs micro-batches in groups of the pipeline size"
        )
    check_moe(m, world)
    _check_profile_window(m.nsys_profile, world, t.max_steps)
    _check_timers(m, t)
    _check_learnt_timeouts(cfg.exp_manager)
    sched = m.optim.sched
    decay_steps = t.max_steps - sched.constant_steps
    if not warmup_fits(sched.warmup_steps, decay_steps, SCHEDULES[sched.name]):
        raise ConfigError(
            f"model.optim.sched.warmup_steps + constant_steps ({sched.warmup_steps} + "
            f"{sched.constant_steps}) must be smaller than trainer.max_steps ({t.max_steps})"
        )
    if sched.min_lr > m.optim.lr:
        raise ConfigError(
            f"model.optim.sched.min_lr ({sched.min_lr}) exceeds model.optim.lr ({m.optim.lr})"
        )

    tok = m.tokenizer
    _check_tokenizer_fields(tok)
    if tok.library == "huggingface" and not tok.type:
        raise ConfigError(
            "model.tokenizer.type must be the local directory of a Hugging Face tokenizer"
        )
    if tok.library == "sentencepiece" and not tok.model:
        raise ConfigError("model.tokenizer.model must be the path of a SentencePiece .model file")
    blend = data_blend(m.data.data_prefix)
    if check_files:
        if tok.library == "huggingface" and (problem := not_a_directory(tok.type)):
            raise ConfigError(
                f"model.tokenizer.type: {tok.type} {problem}: {HUGGING_FACE_DIRECTORY_HINT}"
            )
        if tok.library == "sentencepiece" and (problem := not_a_file(tok.model)):
            raise ConfigError(f"model.tokenizer.model: {tok.model} {problem}")
        vocab_size = check_tokenizer(cfg)
        for problem in blend.file_problems():
            raise ConfigError(f"model.data.data_prefix: {problem}")
        check_datasets(cfg, blend, vocab_size)
        check_writable_paths(cfg, blend)
    validate_cluster(cfg)


def _check_tokenizer_fields(tok) -> None:
    """Refuse a tokenizer file the library does not read (``model.tokenizer.model`` with
    ``byte``, the default): the run would tokenize otherwise than the user thinks."""
    for reader, field in TOKENIZER_FILE_FIELD.items():
        value = getattr(tok, field)
        if value and tok.library != reader:
            raise ConfigError(
                f"model.tokenizer.{field}={value!r} is read only by model.tokenizer.library="
                f"{reader}, not {tok.library}: drop it, or set the library"
            )


def _check_head_size(m) -> None:
    """The head size is model.kv_channels, or hidden_size / num_attention_heads when that
    is null (which must then divide, as Megatron-LM requires); RoPE rotates pairs of
    channels, so with it the head size must be even."""
    heads = m.num_attention_heads
    if m.kv_channels is None:
        _divisible("model.hidden_size", m.hidden_size, "model.num_attention_heads", heads)
    head_size = model_derived.head_size(m)
    if m.position_embedding_type == "rope" and head_size % 2:
        source = (
            f"model.kv_channels={head_size}"
            if m.kv_channels is not None
            else f"the head size hidden_size / num_attention_heads = {head_size}"
        )
        raise ConfigError(
            f"{source} is odd: model.position_embedding_type=rope rotates pairs of channels "
            "and needs an even head size"
        )


def _check_recompute(m) -> None:
    """megatron-core's recompute rules, named by the NeMo keys that set them."""
    granularity, method, num_layers = (
        m.activations_checkpoint_granularity,
        m.activations_checkpoint_method,
        m.activations_checkpoint_num_layers,
    )
    key = "model.activations_checkpoint_"
    if "layernorm" in (m.recompute_modules or ()) and not m.transformer_engine:
        raise ConfigError(
            "model.recompute_modules: layernorm needs model.transformer_engine=true "
            "(megatron-core recomputes the norms in CheckpointWithoutOutput, which reads "
            "Transformer Engine's FP8 state)"
        )
    if m.recompute_modules is not None and granularity != "selective":
        raise ConfigError(
            f"model.recompute_modules={list(m.recompute_modules)} needs "
            f"{key}granularity=selective (got {granularity})"
        )
    if granularity is None:
        for name, value in (("method", method), ("num_layers", num_layers)):
            if value is not None:
                raise ConfigError(
                    f"{key}{name}={value!r} needs {key}granularity=full (recomputation is off)"
                )
    elif granularity == "selective":
        for name, value in (("method", method), ("num_layers", num_layers)):
            if value is not None:
                raise ConfigError(
                    f"{key}{name}={value!r} applies to {key}granularity=full only (selective "
                    "recomputes the core attention of every layer); set it to null"
                )
    else:
        if method is None or num_layers is None:
            raise ConfigError(
                f"{key}granularity=full needs {key}method (uniform or block) and {key}num_layers"
            )
        per_stage = m.num_layers // m.pipeline_model_parallel_size
        if num_layers > per_stage and not hybrid_segments(m):  # segments: check_hybrid
            raise ConfigError(
                f"{key}num_layers ({num_layers}) exceeds the layers per pipeline stage "
                f"({per_stage} = model.num_layers / model.pipeline_model_parallel_size)"
            )


def _check_rampup(m, dp: int) -> None:
    """Every batch size of the ramp must split into whole micro-batches on every
    data-parallel rank (and, with a virtual pipeline, into a multiple of the pipeline
    size): that holds for all of them when it holds for the start and the increment."""
    start, increment, _ = m.rampup_batch_size
    key = f"model.rampup_batch_size={list(m.rampup_batch_size)}"
    unit, shown = m.micro_batch_size * dp, f"{m.micro_batch_size} x {dp}"
    by = "model.micro_batch_size x data-parallel size"
    if m.virtual_pipeline_model_parallel_size is not None:
        # megatron's interleaved schedule runs micro-batches in groups of the pipeline size.
        unit *= m.pipeline_model_parallel_size
        shown += f" x {m.pipeline_model_parallel_size}"
        by += " x model.pipeline_model_parallel_size (virtual pipeline)"
    for name, value in (("start_batch_size", start), ("batch_size_increment", increment)):
        if value % unit:
            raise ConfigError(f"{key}: {name} ({value}) is not divisible by {by} ({shown})")
    if start > m.global_batch_size:
        raise ConfigError(
            f"{key}: start_batch_size ({start}) exceeds model.global_batch_size "
            f"({m.global_batch_size})"
        )
    if (m.global_batch_size - start) % increment:
        raise ConfigError(
            f"{key}: model.global_batch_size - start_batch_size ({m.global_batch_size} - "
            f"{start}) is not divisible by batch_size_increment ({increment})"
        )


def _check_profile_window(profile, world_size: int, max_steps: int) -> None:
    if not profile.enabled:
        return
    key = "model.nsys_profile."
    if profile.end_step < profile.start_step:
        raise ConfigError(
            f"{key}end_step ({profile.end_step}) is before {key}start_step ({profile.start_step})"
        )
    if profile.start_step > max_steps:
        raise ConfigError(
            f"{key}start_step ({profile.start_step}) is after trainer.max_steps ({max_steps}): "
            "nothing would be profiled"
        )
    outside = [rank for rank in profile.ranks if rank >= world_size]
    if outside:
        raise ConfigError(
            f"{key}ranks {outside} are not ranks of this run (world size {world_size})"
        )


def _check_timers(m, t) -> None:
    """NeMo's YAML names it log_mode, NeMo's code log_option: one setting, two keys. And
    timers asked for must report at least once."""
    kwargs, key = m.megatron_timer_kwargs, "model.megatron_timer_kwargs."
    mode, option = kwargs.log_mode, kwargs.log_option
    if mode is not None and option is not None and mode != option:
        raise ConfigError(
            f"{key}log_option={option!r} contradicts {key}log_mode={mode!r}: they are the "
            "same setting; keep one of them"
        )
    every = kwargs.log_every_n_steps or t.log_every_n_steps
    if m.enable_megatron_timers and every > t.max_steps:
        source = (
            f"{key}log_every_n_steps" if kwargs.log_every_n_steps else ("trainer.log_every_n_steps")
        )
        raise ConfigError(
            f"model.enable_megatron_timers=true reports every {every} steps ({source}), "
            f"more than trainer.max_steps ({t.max_steps}): no report would be made"
        )


def _check_learnt_timeouts(em) -> None:
    """A learnt timeout is at least ``min_timeout`` and at most its phase's configured one:
    a floor above a cap leaves nothing to learn, and says the user meant otherwise."""
    ft = em.fault_tolerance
    if not (em.create_fault_tolerance_callback and ft.calculate_timeouts):
        return
    for cap in ("rank_heartbeat_timeout", "checkpoint_save_timeout"):
        if ft.min_timeout > getattr(ft, cap):
            raise ConfigError(
                f"exp_manager.fault_tolerance.min_timeout ({ft.min_timeout:g}) exceeds "
                f"exp_manager.fault_tolerance.{cap} ({getattr(ft, cap):g}), the most a learnt "
                "timeout may be: lower min_timeout, or set calculate_timeouts=false to keep "
                "the configured timeouts"
            )
