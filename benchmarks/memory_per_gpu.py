"""Memory per GPU of a config, by arithmetic (not measured): weights, gradients,
optimizer state and stored activations on the pipeline stage that holds the most.

    .venv/bin/python benchmarks/memory_per_gpu.py nemo_configs/olmo_7b_lns_20b.yaml \
        --vocab-size 50280

Prints the comment block that ``nemo_configs/olmo_7b_lns_20b.yaml`` quotes
(``tests/config/test_performance.py`` checks that the YAML carries this output).

The model of memory, for megatron-core's mixed-precision training:

* weights in bf16/fp16 (2 bytes/parameter), sharded by TP and split by PP; the first
  stage holds the embedding, the last the output layer (untied);
* gradients in megatron DDP's buffer: 4 bytes/parameter when reduced in fp32
  (``grad_sync_dtype`` null/fp32), else 2;
* optimizer state: fp32 main weights and Adam's two moments, 12 bytes/parameter, divided
  by the data-parallel size (x context parallel) with the distributed optimizer;
* with FP8, Transformer Engine's FP8 copy of each GEMM weight and its transpose
  (2 bytes/parameter of the transformer layers);
* activations kept for backward, per layer and micro-batch, in 2-byte elements, with
  sequence parallelism dividing them by TP: the input and output of both pre-norms
  (4 x s*b*h), the query and output of attention (2 x s*b*q, q = heads x head size
  ``model.kv_channels``), key and value (2 x s*b*kv), the MLP's fc1 output and the
  SwiGLU output (3 x s*b*ffn). Flash/fused attention keeps no s x s matrix; the local
  backend's unfused attention keeps the softmax probabilities (b*heads*s*s), which
  selective recomputation drops. Full recomputation keeps only each recomputed group's
  input; activation offloading keeps the layers that are not offloaded. The first
  pipeline stage holds the most micro-batches in flight: PP for 1F1B,
  and for the interleaved schedule (2(PP-1) + (VP-1)PP + 1) chunk forwards of L/(PP VP)
  layers (megatron-core's warm-up count + 1).

Mixture-of-experts layers (``model.num_moe_experts``; megatron-core's layout):

* parameters: attention and the shared expert sharded by TP like a dense layer; the
  router (experts x hidden) and the norms whole on every rank; the routed experts split
  over EP (``num_moe_experts / EP`` experts per rank) and each expert's weights over ETP;
* the distributed optimizer shards the dense parameters' state over data x context
  parallel ranks and the experts' over the expert-data-parallel group,
  world / (ETP x EP x PP) ranks (megatron's ``compute_weight_and_optimizer_memory``
  does the same; ``tests/test_memory_per_gpu.py`` checks the two agree);
* activations of an MoE layer, per micro-batch, for balanced routing: the attention and
  norm terms above; the router's logits and scores in fp32 (2 x s*b*experts / SP, at 4
  bytes); each token's ``topk`` copies through the experts, s*b*topk*ETP/SP tokens per rank
  (the dispatcher gathers tokens over ETP), each keeping the dispatched input and the
  expert's output (2 x hidden) and fc1's and SwiGLU's outputs ((2 + 1) x ffn / ETP);
  the shared expert's like a dense MLP. Dropless routing that is far from balanced puts
  more tokens on the busiest rank than this counts.
* MoE configs also print the model's total parameters and those one token meets
  (``GPTModelConfig.parameter_counts``).

Not counted: the CUDA context, NCCL and TE workspaces, the allocator's fragmentation,
the logits of the loss (s*b*vocab/TP fp32 for one micro-batch at a time).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # on this GPU
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    fp8_weight_copies_gb: float
    activations_gb: float
    layer_microbatches: int  # layers x micro-batches whose activations are held at the peak
    expert_parameters: int = 0  # of ``parameters``: the routed experts' share on this GPU

    @property
    def total_gb(self) -> float:
        return (
            self.weights_gb
            + self.grads_gb
            + self.optimizer_gb
            + self.fp8_weight_copies_gb
            + self.activations_gb
        )


def estimate(cfg, vocab_size: int, world_size: int | None = None) -> MemoryEstimate:
    """The first pipeline stage's memory for the run ``cfg`` (an ExperimentConfig)."""
    from megatron_lns import layout
    from megatron_lns.config.schema import PRECISIONS, cpu_offloading_num_layers
    from megatron_lns.model import padded_vocab_size
    from megatron_lns.moe import moe_layer_pattern

    m = cfg.model
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    vp, cp = m.virtual_pipeline_model_parallel_size or 1, m.context_parallel_size
    world = world_size or layout.world_size(cfg.trainer.num_nodes, cfg.trainer.devices)
    dp = layout.ParallelLayout(tensor=tp, pipeline=pp, context=cp).data_parallel(world)
    h, layers, heads = m.hidden_size, m.num_layers, m.num_attention_heads
    ffn = m.ffn_hidden_size or 4 * h
    head_size = m.kv_channels or h // heads
    q = heads * head_size  # all query heads (and the attention output) together
    kv = (m.num_query_groups or heads) * head_size
    vocab = padded_vocab_size(vocab_size, tp, m.make_vocab_size_divisible_by)
    glu = 2 if m.activation == "swiglu" else 1
    norms = 0 if not m.norm_affine else (2 * h if m.normalization != "rmsnorm" else h)
    attention = h * (q + 2 * kv) + q * h
    layers_here = layers // pp
    here = _first_stage_layers(layers, pp, vp)
    moe = _MoE(m, h, glu, tp) if m.num_moe_experts else None
    is_moe = moe_layer_pattern(m.moe_layer_freq, layers) if moe else [0] * layers
    moe_here = sum(is_moe[i] for i in here)
    dense_here = layers_here - moe_here
    # Tensor-parallel weights (the GEMMs FP8 copies), then those every TP rank holds whole.
    linear_params = dense_here * (attention + h * glu * ffn + ffn * h) // tp
    params = linear_params + layers_here * 2 * norms
    expert_params = 0
    if moe_here:
        linear_params += moe_here * (attention + moe.shared_weights) // tp
        expert_params = moe_here * moe.expert_weights_per_rank
        linear_params += expert_params
        params += moe_here * ((attention + moe.shared_weights) // tp + moe.replicated_weights)
        params += expert_params
    params += vocab * h // tp  # the embedding (first stage)
    if pp == 1 and not m.share_embeddings_and_output_weights:
        params += vocab * h // tp  # and the output layer
    if pp == 1:
        params += norms  # the final norm (last stage)

    precision = PRECISIONS[str(cfg.trainer.precision)]
    weight_bytes = 4 if precision == "fp32" else 2
    grad_bytes = 4 if (m.optim.grad_sync_dtype or "fp32") == "fp32" else 2
    optimizer_bytes = 12 if precision != "fp32" else 8  # (+ fp32 main copy) + Adam m, v
    distributed = m.optim.name == "distributed_fused_adam"
    shards = dp * cp if distributed else 1
    expert_shards = world // (moe.etp * moe.ep * pp) if distributed and moe else 1
    optimizer_gb = optimizer_bytes * (
        (params - expert_params) / shards + expert_params / expert_shards
    )

    s, b = m.encoder_seq_length // cp, m.micro_batch_size
    sp = tp if m.sequence_parallel else 1
    elements = s * b * (4 * h + 2 * q + 2 * kv + glu * ffn + ffn) // sp
    if moe_here:  # the mean over this stage's layers
        moe_elements = s * b * (4 * h + 2 * q + 2 * kv) // sp + moe.activation_elements(s, b, sp)
        elements = (dense_here * elements + moe_here * moe_elements) / layers_here
    if not m.transformer_engine and m.activations_checkpoint_granularity != "selective":
        elements += b * (heads // tp) * s * s * cp  # softmax probabilities (unfused attention)
    layers_per_chunk = layers // (pp * vp)
    if vp > 1:
        in_flight_chunks = 2 * (pp - 1) + (vp - 1) * pp + 1
        layer_microbatches = in_flight_chunks * layers_per_chunk
    else:
        layer_microbatches = pp * layers_here
    if m.cpu_offloading:
        # Transformer Engine's schedule keeps (layers - offloaded) layers' activations on the
        # GPU at the peak (offloading needs PP = 1: one micro-batch in flight).
        layer_microbatches -= cpu_offloading_num_layers(m)
    if m.activations_checkpoint_granularity == "full":
        group = m.activations_checkpoint_num_layers
        kept_per_layer = s * b * h // sp / group  # one group input per `group` layers
        if m.activations_checkpoint_method == "block":
            recomputed = min(group, layers_per_chunk) / layers_per_chunk
            per_layer_elements = recomputed * s * b * h // sp + (1 - recomputed) * elements
        else:
            per_layer_elements = kept_per_layer
        # ... plus one group's full activations while it is recomputed in backward.
        activations = (layer_microbatches * per_layer_elements + group * elements) * 2
    else:
        activations = layer_microbatches * elements * 2

    return MemoryEstimate(
        parameters=params,
        weights_gb=params * weight_bytes / GB,
        grads_gb=params * grad_bytes / GB,
        optimizer_gb=optimizer_gb / GB,
        fp8_weight_copies_gb=(2 * linear_params / GB) if m.fp8 else 0.0,
        activations_gb=activations / GB,
        layer_microbatches=layer_microbatches,
        expert_parameters=expert_params,
    )


def _first_stage_layers(layers: int, pp: int, vp: int) -> list[int]:
    """0-based indices of the layers on the first pipeline stage (all its chunks)."""
    per_chunk = layers // (pp * vp)
    return [c * pp * per_chunk + i for c in range(vp) for i in range(per_chunk)]


class _MoE:
    """One MoE layer's parameters and activations on one GPU (module docstring)."""

    def __init__(self, m, h: int, glu: int, tp: int) -> None:
        self.h, self.glu = h, glu
        self.experts, self.topk = m.num_moe_experts, m.moe_router_topk
        self.ep, self.etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
        self.expert_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * h
        self.shared_ffn = m.moe_shared_expert_intermediate_size or 0
        expert = h * glu * self.expert_ffn + self.expert_ffn * h
        self.expert_weights_per_rank = self.experts // self.ep * expert // self.etp
        self.shared_weights = h * glu * self.shared_ffn + self.shared_ffn * h
        gate = h if self.shared_ffn and m.moe_shared_expert_gate else 0
        self.replicated_weights = self.experts * h + gate  # the router (+ shared gate)

    def activation_elements(self, s: int, b: int, sp: int) -> int:
        """2-byte elements one MoE layer keeps for backward, without attention and norms."""
        router = 4 * s * b * self.experts // sp  # logits and scores, fp32
        tokens = s * b * self.topk * self.etp // sp  # dispatched to this rank's experts
        experts = tokens * 2 * self.h + tokens * (self.glu + 1) * self.expert_ffn // self.etp
        shared = s * b * (self.glu + 1) * self.shared_ffn // sp
        return router + experts + shared


def comment_block(cfg, vocab_size: int) -> str:
    """The YAML comment lines quoting :func:`estimate` for ``cfg``."""
    e = estimate(cfg, vocab_size)
    m = cfg.model
    moe_lines = _moe_lines(cfg, vocab_size, e)
    lines = [
        "Memory per GPU, first pipeline stage (benchmarks/memory_per_gpu.py, arithmetic):",
        *moe_lines[:1],
        f"  parameters on this GPU       {e.parameters / 1e9:6.2f} B",
        *moe_lines[1:],
        f"  weights                      {e.weights_gb:6.1f} GB",
        f"  gradient buffer              {e.grads_gb:6.1f} GB",
        f"  optimizer state (shard)      {e.optimizer_gb:6.1f} GB",
        f"  FP8 weight copies            {e.fp8_weight_copies_gb:6.1f} GB",
        f"  activations ({e.layer_microbatches} layer x micro-batches, mbs {m.micro_batch_size}, "
        f"seq {m.encoder_seq_length})",
        f"                               {e.activations_gb:6.1f} GB",
        f"  total                        {e.total_gb:6.1f} GB",
    ]
    return "\n".join("# " + line for line in lines)


def _moe_lines(cfg, vocab_size: int, e: MemoryEstimate) -> list[str]:
    """For MoE configs: the model's total vs active parameters, the experts' share here."""
    m = cfg.model
    if not m.num_moe_experts:
        return []
    from megatron_lns.build import model_config

    counts = model_config(cfg, vocab_size).parameter_counts()
    ep = m.expert_model_parallel_size
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    return [
        f"  model: {counts.total / 1e9:.2f} B parameters, "
        f"{counts.active / 1e9:.2f} B active per token",
        f"    of which routed experts    {e.expert_parameters / 1e9:6.2f} B "
        f"({m.num_moe_experts // ep} of {m.num_moe_experts} per layer: EP {ep}, ETP {etp})",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*", help="key=value, as for megatron-lns train")
    parser.add_argument("--vocab-size", type=int, required=True, help="the tokenizer's size")
    args = parser.parse_intermixed_args(argv)
    print(comment_block(load_for_estimate(args.config, args.overrides), args.vocab_size))
    return 0


def load_for_estimate(path: Path, overrides: list[str] | None = None):
    """The config with its data and tokenizer placeholders filled (they cost no memory)."""
    from megatron_lns.config import load_config

    return load_config(
        path,
        ["model.data.data_prefix=[unused]", "model.tokenizer.type=unused", *(overrides or [])],
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
