"""Memory per GPU, by arithmetic (not measured), on each pipeline stage: weights,
gradients, optimizer state, FP8 weight copies and the activations kept for backward.

The model of memory, for megatron-core's mixed-precision training:

* weights in bf16/fp16 (2 bytes/parameter; fp32 runs 4), as ``shape.py`` places them;
* gradients in megatron DDP's buffer: 4 bytes/parameter when reduced in fp32
  (``grad_sync_dtype`` null/fp32), else 2;
* optimizer state: fp32 main weights and Adam's two moments, 12 bytes/parameter (8 for an
  fp32 run, which has no main copy), divided with the distributed optimizer by the
  data x context parallel ranks for dense parameters and by the expert-data-parallel
  ranks, world / (ETP x EP x PP), for the routed experts (megatron's
  ``compute_weight_and_optimizer_memory`` does the same; ``tests/planning/test_memory.py``
  checks the two agree);
* with FP8, Transformer Engine's FP8 copy of each GEMM weight and its transpose
  (2 bytes/parameter of the transformer layers' GEMMs);
* activations kept for backward, per micro-batch, in elements of the activation dtype
  (2 bytes; 4 in an fp32 run; the router's fp32 counted as two). Tensor parallelism
  divides what its GEMMs split (q, k, v, ffn-wide tensors, the attention probabilities);
  the h-wide ones (the pre-norms' and their GEMMs' inputs) only with sequence
  parallelism; context parallelism divides the sequence by CP. With Transformer Engine
  (the fused GPU path): per attention sublayer its pre-norm's input and output
  (2 x s*b*h), the query and the attention output (2 x s*b*q), key and value
  (2 x s*b*kv); per dense MLP its pre-norm's input and output (2 x s*b*h), fc1's output
  and the SwiGLU output ((glu + 1) x s*b*ffn); flash/fused attention keeps no s x s
  matrix. megatron-core's local backend (``transformer_engine: false``) keeps more: its
  torch norms also the normalised input (3 x s*b*h), the unfused attention contiguous
  copies of q and k, v as a view of the mixed QKV tensor, which stays whole (s*b*(q +
  2kv); under GQA the copy of v repeated to every head, s*b*q), the softmax
  probabilities (b*heads/TP*s*s, which selective recomputation drops) and the attention
  output; the unfused SwiGLU fc1's output, its two halves and activated gate, and its
  output (5 x s*b*ffn). ``tests/planning/test_activations_measured.py`` measures the local
  backend's on CPU. An MoE
  sublayer, for balanced routing: its pre-norm (as above), the router's logits and
  scores in fp32 (2 x s*b*experts, at 4 bytes), each token's ``topk`` copies through the
  experts, s*b*topk*ETP/SP tokens per rank (the dispatcher gathers tokens over ETP), each
  keeping the dispatched input and the expert's output (2 x h) and fc1's and SwiGLU's
  outputs ((glu + 1) x expert_ffn / ETP), and the shared expert's like a dense MLP.
  Dropless routing far from balanced puts more tokens on the busiest rank than this.
* in flight at the peak, on pipeline stage r of PP: with 1F1B, min(PP - r, micro-batches)
  micro-batches of the stage's units; interleaved (VP chunks), megatron-core's warm-up
  count + 1 chunk forwards, 2(PP - r - 1) + (VP - 1)PP + 1 (at most micro-batches x VP),
  each of the stage's units / VP. Full recomputation keeps only each recomputed group's
  input, plus one group's full activations while it is recomputed (its first input
  counted once); activation offloading keeps the units that are not offloaded.

Not counted: the CUDA context, NCCL and TE workspaces, the allocator's fragmentation,
the logits of the loss (s*b*vocab/TP fp32 for one micro-batch at a time), the
``recompute_modules`` other than the core attention, and per layer the rotary cos/sin
tables (4 x s*head_size), the norms' fp32 inverse RMS (s*b) and the causal mask (s*s
bytes): under 1% of a 7B layer's activations, 2-5% of the tiny test model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lns.config import layout
from megatron_lns.config.schema import PRECISIONS, ExperimentConfig, cpu_offloading_num_layers
from megatron_lns.config.sections.optim import reduced_gradient_bytes
from megatron_lns.planning.shape import (
    ModelShape,
    Unit,
    UnitCounts,
    parameter_counts,
    total,
    world_and_data_parallel,
)

GB = 1e9


@dataclass(frozen=True)
class MemoryEstimate:
    """One GPU of one pipeline stage, in GB (10^9 bytes)."""

    stage: int
    parameters: int  # on this GPU
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    fp8_weight_copies_gb: float
    activations_gb: float
    layer_microbatches: int  # units x micro-batches whose activations are held at the peak
    expert_parameters: int = 0  # of ``parameters``: the routed experts' share on this GPU
    optimizer_gb_distributed: float = 0.0  # the optimizer state with the distributed optimizer
    optimizer_gb_replicated: float = 0.0  # ... and without it

    @property
    def total_gb(self) -> float:
        return (
            self.weights_gb
            + self.grads_gb
            + self.optimizer_gb
            + self.fp8_weight_copies_gb
            + self.activations_gb
        )


def stage_estimates(cfg: ExperimentConfig, shape: ModelShape) -> list[MemoryEstimate]:
    """Every pipeline stage's memory on one of its GPUs."""
    m = cfg.model
    tp, pp, cp = (
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.context_parallel_size,
    )
    world, dp = world_and_data_parallel(cfg)
    counts = parameter_counts(shape, tp)
    precision = PRECISIONS[str(cfg.trainer.precision)]
    weight_bytes = 4 if precision == "fp32" else 2
    grad_bytes = reduced_gradient_bytes(cfg)
    optimizer_bytes = 12 if precision != "fp32" else 8  # (+ fp32 main copy) + Adam m, v
    activation_bytes = 4 if precision == "fp32" else 2
    distributed = m.optim.name == "distributed_fused_adam"
    expert_shards = world // (shape.etp * shape.ep * pp) if shape.moe_experts else 1
    micro_batches = layout.micro_batches_per_step(m.global_batch_size, m.micro_batch_size, dp)

    estimates = []
    for stage, units in enumerate(shape.stages):
        params, experts = counts.per_rank[stage], counts.experts_per_rank[stage]
        replicated = optimizer_bytes * params
        sharded = optimizer_bytes * ((params - experts) / (dp * cp) + experts / expert_shards)
        gemm_weights = total(units, lambda u: u.sharded // tp) + experts
        elements, layer_microbatches = _activation_elements(cfg, shape, stage, units, micro_batches)
        estimates.append(
            MemoryEstimate(
                stage=stage,
                parameters=params,
                weights_gb=params * weight_bytes / GB,
                grads_gb=params * grad_bytes / GB,
                optimizer_gb=(sharded if distributed else replicated) / GB,
                fp8_weight_copies_gb=(2 * gemm_weights / GB) if m.fp8 else 0.0,
                activations_gb=elements * activation_bytes / GB,
                layer_microbatches=layer_microbatches,
                expert_parameters=experts,
                optimizer_gb_distributed=sharded / GB,
                optimizer_gb_replicated=replicated / GB,
            )
        )
    return estimates


def heaviest(estimates: list[MemoryEstimate]) -> MemoryEstimate:
    """The stage whose GPUs hold the most (the first such stage on a tie)."""
    return max(estimates, key=lambda e: (e.total_gb, -e.stage))


def _activation_elements(cfg, shape: ModelShape, stage: int, units: UnitCounts, micro_batches: int):
    """Activation-dtype elements kept for backward at the peak, and the units x
    micro-batches in flight."""
    m = cfg.model
    tp, pp, vp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, shape.chunks
    s, b = m.encoder_seq_length // m.context_parallel_size, m.micro_batch_size
    sp = tp if m.sequence_parallel else 1
    h, q, kv, ffn = shape.hidden, shape.query, shape.key_value, shape.ffn
    local = not m.transformer_engine
    # Per token: what each pre-norm keeps (its input and output; the local backend's torch
    # norm also its normalised input), split over TP only with sequence parallelism ...
    norm = (3 if local else 2) * h
    # ... and what the attention and MLP keep of the tensors TP splits (see the docstring).
    if local:  # q and k as contiguous copies, v (a view of the mixed QKV, or repeated
        # to every head under GQA), the attention output; fc1's output, SwiGLU's split
        # halves and activated gate (2 more ffn-wide), its output
        attention = 3 * q + (q if kv < q else q + 2 * kv)
        mlp = (shape.glu + 1 + 2 * (shape.glu - 1)) * ffn
    else:
        attention = 2 * q + 2 * kv
        mlp = (shape.glu + 1) * ffn
    softmax = 0
    if local and m.activations_checkpoint_granularity != "selective":
        softmax = b * (shape.heads // tp) * s * s * m.context_parallel_size

    def kept(u: Unit) -> int:
        e = u.attention * (s * b * (norm // sp + attention // tp) + softmax)
        e += u.dense_mlps * s * b * (norm // sp + mlp // tp)
        if u.moe_mlps:
            e += u.moe_mlps * (s * b * norm // sp + _moe_elements(shape, s, b, sp))
        return e

    units_here = total(units, lambda u: 1)
    mean = total(units, kept) / units_here if units_here else 0
    per_chunk = units_here // vp
    if vp > 1:
        chunks = min(2 * (pp - stage - 1) + (vp - 1) * pp + 1, micro_batches * vp)
        layer_microbatches = chunks * per_chunk
    else:
        layer_microbatches = min(pp - stage, micro_batches) * units_here
    if m.cpu_offloading:
        # Transformer Engine's schedule keeps (layers - offloaded) layers' activations on the
        # GPU at the peak (offloading needs PP = 1: one micro-batch in flight).
        layer_microbatches -= cpu_offloading_num_layers(m)
    if m.activations_checkpoint_granularity != "full":
        return layer_microbatches * mean, layer_microbatches
    group = m.activations_checkpoint_num_layers
    unit_input = s * b * h // sp
    if m.activations_checkpoint_method == "block":
        recomputed = min(group, per_chunk) / per_chunk
        kept = recomputed * unit_input + (1 - recomputed) * mean
    else:
        kept = unit_input / group  # one group input per `group` units
    # ... plus one group's full activations while it is recomputed in backward, whose
    # first pre-norm keeps the group's input already counted.
    return layer_microbatches * kept + group * mean - unit_input, layer_microbatches


def _moe_elements(shape: ModelShape, s: int, b: int, sp: int) -> int:
    """2-byte elements one MoE sublayer keeps for backward, without its pre-norm."""
    router = 4 * s * b * shape.moe_experts // sp  # logits and scores, fp32
    tokens = s * b * shape.moe_topk * shape.etp // sp  # dispatched to this rank's experts
    experts = tokens * 2 * shape.hidden + tokens * (shape.glu + 1) * shape.expert_ffn // shape.etp
    shared = s * b * (shape.glu + 1) * shape.shared_ffn // sp
    return router + experts + shared
