"""A run's plan: its parameters, memory on the GPU that holds the most, FLOPs and time,
whether it fits the GPU and, when it does not, the changes that would make it fit."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_lns.base.errors import UserError
from megatron_lns.config import layout, model_derived
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.planning.fixes import ranked_fixes
from megatron_lns.planning.gpus import GPU
from megatron_lns.planning.memory import MemoryEstimate, heaviest, stage_estimates
from megatron_lns.planning.shape import (
    ParameterCounts,
    model_shape,
    parameter_counts,
    world_and_data_parallel,
)
from megatron_lns.planning.throughput import DEFAULT_MFU, MFU_SOURCE, Throughput, throughput


class PlanDoesNotFitError(UserError):
    pass


class PlanArgumentError(UserError):
    pass


# What a GPU needs besides the estimate's items: the CUDA context, NCCL and Transformer
# Engine workspaces and the allocator's fragmentation. Not measured here: a margin smaller
# than this is called tight.
TIGHT_MARGIN_GB = 5.0


@dataclass(frozen=True)
class Plan:
    vocab_size: int
    vocab_source: str
    gpus: int
    data_parallel: int
    micro_batches: int
    gpu: GPU
    parameters: ParameterCounts
    stages: tuple[MemoryEstimate, ...]
    heaviest: MemoryEstimate
    throughput: Throughput
    mfu_source: str
    notes: tuple[str, ...] = ()  # what the plan cannot promise on this GPU
    fixes: tuple = field(default=())  # fixes.Fix, when it does not fit

    @property
    def margin_gb(self) -> float:
        return self.gpu.memory_gb - self.heaviest.total_gb

    @property
    def fits(self) -> bool:
        return self.margin_gb >= 0

    def to_json(self) -> str:
        data = asdict(self)
        data["heaviest"]["total_gb"] = self.heaviest.total_gb
        for stage, estimate in zip(data["stages"], self.stages, strict=True):
            stage["total_gb"] = estimate.total_gb
        data["margin_gb"], data["fits"] = self.margin_gb, self.fits
        return json.dumps(data, indent=2)


def make_plan(
    cfg: ExperimentConfig,
    vocab_size: int,
    gpu: GPU,
    mfu: float | None = None,
    vocab_source: str = "given",
    with_fixes: bool = True,
) -> Plan:
    """The plan of ``cfg`` (validated) on ``gpu``; the fixes only when it does not fit."""
    m = cfg.model
    shape = model_shape(cfg, vocab_size)
    world, dp = world_and_data_parallel(cfg)
    stages = stage_estimates(cfg, shape)
    plan = Plan(
        vocab_size=vocab_size,
        vocab_source=vocab_source,
        gpus=world,
        data_parallel=dp,
        micro_batches=layout.micro_batches_per_step(m.global_batch_size, m.micro_batch_size, dp),
        gpu=gpu,
        parameters=parameter_counts(shape, m.tensor_model_parallel_size),
        stages=tuple(stages),
        heaviest=heaviest(stages),
        throughput=throughput(cfg, shape, gpu, world, mfu or DEFAULT_MFU),
        mfu_source="--mfu" if mfu else MFU_SOURCE,
        notes=tuple(_notes(cfg, gpu)),
    )
    if plan.fits or not with_fixes:
        return plan

    def replan(changed: ExperimentConfig) -> Plan:
        return make_plan(changed, vocab_size, gpu, mfu, vocab_source, with_fixes=False)

    return Plan(**{**plan.__dict__, "fixes": tuple(ranked_fixes(cfg, plan, replan))})


def _notes(cfg: ExperimentConfig, gpu: GPU) -> list[str]:
    notes = []
    if cfg.model.fp8 and gpu.fp8_tflops is None:
        notes.append(
            f"model.fp8 is set but the {gpu.name} has no FP8 tensor cores (Transformer "
            "Engine's FP8 needs compute capability 8.9+): the run would stop; set model.fp8=null"
        )
    return notes


def plan_text(plan: Plan, config: str | Path, cfg: ExperimentConfig) -> str:
    """The table ``megatron-lns plan`` prints."""
    m, e, p, t = cfg.model, plan.heaviest, plan.parameters, plan.throughput
    pp = m.pipeline_model_parallel_size
    parallel = (
        f"TP {m.tensor_model_parallel_size} x PP {pp}"
        + (
            f" (VP {m.virtual_pipeline_model_parallel_size})"
            if m.virtual_pipeline_model_parallel_size
            else ""
        )
        + f" x CP {m.context_parallel_size} x DP {plan.data_parallel}"
        + (f", EP {m.expert_model_parallel_size}" if model_derived.has_experts(m) else "")
    )
    lines = [
        f"plan: {config} on {plan.gpus} x {plan.gpu.name} ({parallel})",
        f"  vocabulary {plan.vocab_size} ({plan.vocab_source})",
        "parameters",
        f"  model                        {p.total / 1e9:9.3f} B",
    ]
    if p.active != p.total:
        lines.append(f"  active per token             {p.active / 1e9:9.3f} B")
    if pp > 1:
        per_stage = ", ".join(f"{n / 1e9:.3f}" for n in p.per_stage)
        lines.append(f"  per pipeline stage           {per_stage} B")
    lines += [
        f"memory per GPU: pipeline stage {e.stage} of {pp}, the GPUs that hold the most "
        "(arithmetic, not measured)",
        f"  parameters on this GPU       {e.parameters / 1e9:9.3f} B",
    ]
    if e.expert_parameters:
        lines.append(f"    of which routed experts    {e.expert_parameters / 1e9:9.3f} B")
    distributed = m.optim.name == "distributed_fused_adam"
    other = e.optimizer_gb_replicated if distributed else e.optimizer_gb_distributed
    lines += [
        f"  weights                      {e.weights_gb:9.1f} GB",
        f"  gradient buffer              {e.grads_gb:9.1f} GB",
        f"  optimizer state              {e.optimizer_gb:9.1f} GB  "
        f"({'distributed' if distributed else 'not distributed'}; "
        f"{other:.1f} GB {'without' if distributed else 'with'} the distributed optimizer)",
        f"  FP8 weight copies            {e.fp8_weight_copies_gb:9.1f} GB",
        f"  activations                  {e.activations_gb:9.1f} GB  ({e.layer_microbatches} "
        f"{'layer' if _units_are_layers(cfg) else 'sublayer'} x micro-batches in flight, "
        f"mbs {m.micro_batch_size}, seq {m.encoder_seq_length}, recompute "
        f"{m.activations_checkpoint_granularity or 'none'})",
        f"  total                        {e.total_gb:9.1f} GB  of {plan.gpu.memory_gb:g} GB",
        _verdict(plan),
        "compute (model FLOPs: Megatron-LM's num_floating_point_operations)",
        f"  FLOPs per token              {t.flops_per_token / 1e9:9.2f} GFLOP",
        f"  FLOPs per step               {t.flops_per_step / 1e15:9.2f} PFLOP  "
        f"({m.global_batch_size} x {m.encoder_seq_length} tokens)",
        f"  at MFU {t.mfu:.0%} of {plan.gpu.bf16_tflops:g} TFLOP/s (dense BF16): {plan.mfu_source}",
        f"  time per step                {t.step_seconds:9.2f} s",
        f"  tokens/s per GPU             {t.tokens_per_second_per_gpu:9.0f}",
        f"  to max_steps {t.max_steps}: {_duration(t.total_seconds)}, {t.gpu_hours:,.0f} GPU-hours",
    ]
    lines += [f"note: {note}" for note in plan.notes]
    if plan.fixes:
        lines.append("changes that make it fit, cheapest first (step-time cost, estimated):")
        for fix in plan.fixes:
            lines.append(f"  {fix.summary()}")
            lines.append(f"      {' '.join(fix.overrides)}")
    elif not plan.fits:
        lines.append("no single change or combination of the known ones makes it fit")
    return "\n".join(lines)


def summary_line(plan: Plan) -> str:
    """One line for ``submit``."""
    e = plan.heaviest
    assumed = " (vocabulary assumed)" if plan.vocab_source.startswith("ASSUMED") else ""
    return (
        f"plan{assumed}: {e.total_gb:.1f} of {plan.gpu.memory_gb:g} GB per {plan.gpu.name} "
        f"({'fits' if plan.fits else 'DOES NOT FIT'}, margin {plan.margin_gb:+.1f} GB), "
        f"{plan.throughput.step_seconds:.2f} s/step at {plan.throughput.mfu:.0%} MFU, "
        f"{plan.throughput.gpu_hours:,.0f} GPU-hours to max_steps"
    )


def _verdict(plan: Plan) -> str:
    if not plan.fits:
        return f"  DOES NOT FIT: {-plan.margin_gb:.1f} GB over"
    tight = (
        f" (tight: under {TIGHT_MARGIN_GB:g} GB for the CUDA context, NCCL/TE workspaces and "
        "fragmentation, which the estimate does not count)"
        if plan.margin_gb < TIGHT_MARGIN_GB
        else ""
    )
    return f"  fits: {plan.margin_gb:.1f} GB to spare{tight}"


def _units_are_layers(cfg: ExperimentConfig) -> bool:
    m = cfg.model
    return not (m.architecture == "hybrid" and m.hybrid_layer_pattern)


def _duration(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours / 24:.1f} days" if hours >= 48 else f"{hours:.1f} h"
