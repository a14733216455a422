"""From the validated experiment config to the components of a run: the build seam.

The one place where the NeMo-style config meets the components: the model config,
parallel layout, optimizer settings and dataset settings are translated here, and
the one place that assembles them. Every command and benchmark builds through it:

- :func:`build_model_chunks`: a ``GPTModelConfig`` -> this rank's model chunks as a
  forward pass runs them (``Float16Module`` for bf16/fp16); analysis, checks.
- :func:`build_trainable`: the same chunks -> megatron DDP -> optimizer and LR
  schedule; benchmarks and GPU tests, which build from a ``GPTModelConfig``.
- :func:`build_trainable_from_config`: a training run's trainable stack from its
  config (userbuffers, optimizer, schedule and DDP settings); the trainer.
- :func:`build_weights_model`: a bare model to hold weights being converted; import.

``tests/test_build.py`` keeps it the only module that wraps chunks in ``Float16Module``
or megatron DDP or builds an optimizer (``model.build_model`` constructs ``GPTModel``).
The components themselves (``model.py``, ``optim.py``, ``data/``) know nothing of YAML.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron_lns.config.fast_paths import FastPaths
from megatron_lns.config.performance import userbuffer_settings
from megatron_lns.config.schema import (
    ACCELERATORS,
    PRECISIONS,
    ExperimentConfig,
    uses_distributed_optimizer,
)
from megatron_lns.config.settings import (
    DDP_TARGETS,
    MODEL_TARGETS,
    OPTIMIZER_TARGETS,
    VARIANT_TARGETS,
    target_values,
)
from megatron_lns.config.userbuffers import UserbufferLayout, initialize_userbuffers
from megatron_lns.config.validate import data_blend
from megatron_lns.data.datasets import DatasetSettings
from megatron_lns.model.language_model import (
    PARAMS_DTYPES,
    GPTModelConfig,
    build_model,
    padded_vocab_size,
)
from megatron_lns.runtime import ParallelLayout
from megatron_lns.training.machine import fast_paths_here
from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler


def parallel_layout(cfg: ExperimentConfig) -> ParallelLayout:
    """The parallel sizes, from the declarations whose target is ``ParallelLayout``."""
    return ParallelLayout(**target_values(cfg, ("ParallelLayout",), training=True))


def device_setting(cfg: ExperimentConfig) -> str:
    """``trainer.accelerator`` as the device runtime.init_distributed takes."""
    return ACCELERATORS[cfg.trainer.accelerator]


def tokenizer_spec(cfg: ExperimentConfig) -> tuple[str, str | None, str | None]:
    tok = cfg.model.tokenizer
    return tok.library, tok.type, tok.model


def fast_paths(cfg: ExperimentConfig, device: torch.device) -> FastPaths:
    """The fusions, attention backend and overlaps this run uses on ``device``."""
    return fast_paths_here(cfg, cuda=device.type == "cuda")


def embedding_rows(cfg: ExperimentConfig, tokenizer_vocab_size: int) -> int:
    """The embedding (and output layer) rows of ``cfg``'s model: the tokenizer's vocabulary
    padded for ``model.make_vocab_size_divisible_by`` and tensor parallelism."""
    m = cfg.model
    return padded_vocab_size(
        tokenizer_vocab_size, m.tensor_model_parallel_size, m.make_vocab_size_divisible_by
    )


def model_config(
    cfg: ExperimentConfig, tokenizer_vocab_size: int, fast: FastPaths | None = None
) -> GPTModelConfig:
    """The model's config, from the declarations of the keys whose target is the model
    (``settings.MODEL_TARGETS``): a field of ``GPTModelConfig`` is set by name, any other
    ``TransformerConfig`` field goes to megatron-core as it is; the layer variants' own keys
    (``settings.VARIANT_TARGETS``) go to ``variant_options``.

    ``fast`` is for training runs: their fusions, and then also the training-only keys
    (tensor-parallel communication overlap, activation offloading), which need the run's
    set-up (userbuffers) and a backward pass. Without it (a model built to convert or
    analyse weights) all of those are off and pipeline send/receive is batched except on
    gloo; the model computes the same function either way."""
    values = target_values(cfg, MODEL_TARGETS, training=fast is not None)
    # The layer variants' own keys (declared in their registrations), by key name.
    values["variant_options"] = target_values(cfg, VARIANT_TARGETS, training=fast is not None)
    if fast is not None:
        values.update(fast.model_fields())
    fields = {f.name for f in dataclasses.fields(GPTModelConfig)}
    passed_on = {name: values.pop(name) for name in list(values) if name not in fields}
    values["vocab_size"] = embedding_rows(cfg, tokenizer_vocab_size)
    return GPTModelConfig(**values, extra_transformer_config=passed_on)


def initialize_tp_comm_overlap(cfg: ExperimentConfig) -> None:
    """Transformer Engine's userbuffers for ``model.ub_tp_comm_overlap``, sized for one
    micro-batch; every rank calls it before the model is built."""
    m = cfg.model
    precision = PRECISIONS[str(cfg.trainer.precision)]
    initialize_userbuffers(
        UserbufferLayout(
            seq_length=m.encoder_seq_length,
            micro_batch_size=m.micro_batch_size,
            hidden_size=m.hidden_size,
            tensor_parallel=m.tensor_model_parallel_size,
            context_parallel=m.context_parallel_size,
        ),
        dtype=PARAMS_DTYPES[precision],
        fp8=m.fp8 is not None,
        settings=userbuffer_settings(cfg),
        bootstrap_backend=m.ub_tp_comm_bootstrap_backend,
    )


def optim_settings(cfg: ExperimentConfig) -> OptimSettings:
    """The optimizer and LR schedule, from the declarations of the keys whose target is
    megatron's optimizer or scheduler (``settings.OPTIMIZER_TARGETS``)."""
    values = target_values(cfg, OPTIMIZER_TARGETS, training=True)
    fields = {f.name for f in dataclasses.fields(OptimSettings)}
    passed_on = {name: values.pop(name) for name in list(values) if name not in fields}
    return OptimSettings(**values, extra_optimizer_config=passed_on)


def ddp_config(cfg: ExperimentConfig, fast: FastPaths) -> DistributedDataParallelConfig:
    """megatron DDP's settings: the declared keys whose target is
    ``DistributedDataParallelConfig`` and the overlaps resolved for this machine."""
    return DistributedDataParallelConfig(
        **target_values(cfg, DDP_TARGETS, training=True),
        overlap_grad_reduce=fast.overlap_grad_reduce,
        overlap_param_gather=fast.overlap_param_gather,
        use_distributed_optimizer=uses_distributed_optimizer(cfg),
    )


def dataset_settings(cfg: ExperimentConfig) -> DatasetSettings:
    m, d = cfg.model, cfg.model.data
    return DatasetSettings(
        blend=data_blend(d.data_prefix),
        split=d.splits_string,
        seq_length=d.seq_length,
        seed=m.seed,
        cache_dir=d.index_mapping_dir,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
    )


def wrap_with_ddp(
    chunks: Sequence[torch.nn.Module], ddp_config: DistributedDataParallelConfig | None = None
) -> list[DistributedDataParallel]:
    """megatron DDP around each model chunk (contiguous grad buffers, bucketed all-reduce).

    Also installs the model-config hooks the pipeline schedules call after backward:
    ``finalize_model_grads`` (data-parallel grad sync, sequence-parallel norm-grad
    all-reduce across TP, tied-embedding grads across pipeline stages) and ``no_sync``.
    """
    ddp_config = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    model = [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=chunk,
            # Only the first chunk's grads overlap with the backward of later ones.
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(chunks)
    ]
    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return model


@dataclasses.dataclass
class Trainable:
    """What a training step needs: DDP-wrapped model chunks, optimizer, LR schedule."""

    model: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler


def build_model_chunks(
    model_cfg: GPTModelConfig,
    layout: ParallelLayout = ParallelLayout(),
    device: torch.device | None = None,
    chunk_transform: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> list[torch.nn.Module]:
    """This rank's model chunks as a forward pass runs them: built at ``layout`` on
    ``device``, ``chunk_transform`` applied to each, then each in megatron's
    ``Float16Module`` for bf16/fp16 (it casts the inputs to the model's dtype and the
    logits back to fp32, as training does). Needs megatron's parallel state."""
    chunks = build_model(model_cfg, layout, device)
    if chunk_transform is not None:
        chunks = [chunk_transform(chunk) for chunk in chunks]
    if model_cfg.precision != "fp32":
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    return chunks


def build_trainable(
    model_cfg: GPTModelConfig,
    layout: ParallelLayout,
    device: torch.device,
    settings: OptimSettings,
    total_steps: int,
    chunk_transform: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    ddp: DistributedDataParallelConfig | None = None,
) -> Trainable:
    """Model chunks (:func:`build_model_chunks`) -> megatron DDP -> optimizer and
    schedule. Needs megatron's parallel state (``init_distributed``).

    ``ddp`` defaults to fp32 reduction, overlapped with backward on CUDA."""
    chunks = build_model_chunks(model_cfg, layout, device, chunk_transform)
    ddp = ddp or DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=device.type == "cuda",
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    model = wrap_with_ddp(chunks, ddp)
    optimizer, scheduler = build_optimizer_and_scheduler(
        model, settings, total_steps, chunks[0].config.params_dtype
    )
    return Trainable(model, optimizer, scheduler)


def build_trainable_from_config(
    cfg: ExperimentConfig, model_cfg: GPTModelConfig, device: torch.device, fast: FastPaths
) -> Trainable:
    """A training run's model, optimizer and schedule: ``model_cfg`` is
    ``model_config(cfg, vocab, fast)`` (the caller needs it first: its padded vocabulary
    sizes the datasets). Transformer Engine's userbuffers are set up first when
    ``model.ub_tp_comm_overlap`` asks; the optimizer, the schedule over
    ``trainer.max_steps`` and DDP's overlap and buckets come from ``cfg``."""
    if cfg.model.ub_tp_comm_overlap:
        initialize_tp_comm_overlap(cfg)
    return build_trainable(
        model_cfg,
        parallel_layout(cfg),
        device,
        optim_settings(cfg),
        cfg.trainer.max_steps,
        ddp=ddp_config(cfg, fast),
    )


def build_weights_model(cfg: ExperimentConfig, tokenizer_vocab_size: int) -> torch.nn.Module:
    """``cfg``'s model as a home for weights being converted: one bare chunk on the CPU
    at TP=PP=1, local backend, no FP8, experts one by one (SequentialMLP, whose
    checkpoint keys TEGroupedMLP shares). The checkpoint keys are the same for every
    backend and parallel layout, so what is saved from it loads into any of them.
    Needs megatron's parallel state for one process."""
    model_cfg = dataclasses.replace(
        model_config(cfg, tokenizer_vocab_size),
        backend="local",
        fp8=None,
        fp8_param=False,
        moe_grouped_gemm=False,
    )
    return build_model(model_cfg)[0]
