"""The model of a config as ``plan`` counts it: its units (GPT layers, or the sublayers of
a hybrid pattern), where each pipeline stage's units are, and their parameters.

A *unit* is what megatron's pipeline split and recomputation count: a transformer layer
(attention + MLP or MoE) of the GPT model, a sublayer (attention, MLP or MoE) of
``HybridModel``. Each unit's weights are kept in three parts, because each is split over
other ranks (megatron-core's layout):

* ``sharded``: the GEMM weights tensor parallelism splits (attention, a dense MLP, the
  shared expert) and their column-parallel biases;
* ``replicated``: what every TP rank holds whole (norms, the router, the shared expert's
  gate, row-parallel biases);
* ``experts``: the routed experts, ``num_moe_experts / EP`` per rank, each split over ETP.

Counts the norms' weights (and LayerNorm's biases), QK-norms, linear biases of attention
and dense MLPs (``bias: true``), learned position embeddings, the embedding and an untied
output layer, and what a setting declares it adds to each layer (``params=``,
:func:`declared_layer_parameters`). Not counted: the paper variants' per-layer gains (a
few ``hidden_size`` each, ``layer_variant``) and expert biases. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lns.config import hybrid_pattern, layout, model_derived
from megatron_lns.config.schema import ExperimentConfig, ModelConfig
from megatron_lns.config.settings import declared_settings


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """The embedding rows: ``vocab_size`` rounded up to a multiple of ``divisible_by`` and
    of ``tensor_parallel`` (the rule of
    ``megatron_lns.model.language_model.padded_vocab_size``, which imports torch;
    ``tests/planning/test_shape.py`` checks the two agree)."""
    import math

    multiple = math.lcm(divisible_by, tensor_parallel)
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class Unit:
    """One GPT layer or hybrid sublayer: its weights by how they are split, and the
    2-byte elements it keeps for backward per micro-batch (see ``memory.py``)."""

    attention: int  # attention sublayers in the unit (0 or 1)
    dense_mlps: int
    moe_mlps: int
    sharded: int
    replicated: int
    experts: int  # all routed experts' weights of the unit
    active_experts: int  # those one token meets (``topk`` experts)


@dataclass(frozen=True)
class ModelShape:
    """The sizes ``plan`` needs, read once from the config."""

    hidden: int
    heads: int
    query: int  # all query heads together (= the attention output width)
    key_value: int  # keys (or values) of all query groups together
    ffn: int
    glu: int  # 2 with SwiGLU (fc1 holds gate and value), else 1
    vocab: int  # padded
    units: tuple[Unit, ...]
    stages: tuple[tuple[int, ...], ...]  # each pipeline stage's unit indices (all chunks)
    chunks: int  # virtual-pipeline chunks per stage
    units_are_layers: bool  # GPT: a unit is a layer; hybrid: a sublayer
    embedding: int  # word (+ position) embedding, on the first stage
    output_layer: int  # the last stage's output layer (0: tied, one stage)
    final_norm: int
    tied: bool  # the output layer reuses the embedding (a copy on the last stage if PP > 1)
    moe_experts: int = 0
    moe_topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    ep: int = 1
    etp: int = 1

    @property
    def attention_units(self) -> int:
        return sum(u.attention for u in self.units)


def model_shape(cfg: ExperimentConfig, vocab_size: int) -> ModelShape:
    """Every size ``plan`` uses, for the config's model and parallel layout."""
    m = cfg.model
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    vp = m.virtual_pipeline_model_parallel_size or 1
    h, heads = m.hidden_size, m.num_attention_heads
    head_size = model_derived.head_size(m)
    q, kv = heads * head_size, model_derived.query_groups(m) * head_size
    ffn = model_derived.ffn_hidden_size(m)
    glu = 2 if m.activation == "swiglu" else 1
    per_channel = 1 if m.normalization == "rmsnorm" else 2  # weight (+ LayerNorm's bias)
    norm = per_channel * h if m.norm_affine else 0
    qk_norm = 2 * per_channel * head_size if m.qk_layernorm else 0
    bias = 1 if m.bias else 0
    vocab = padded_vocab_size(vocab_size, tp, m.make_vocab_size_divisible_by)

    attention = Unit(
        attention=1, dense_mlps=0, moe_mlps=0,
        sharded=h * (q + 2 * kv) + q * h + bias * (q + 2 * kv),
        replicated=norm + qk_norm + bias * h + declared_layer_parameters(m),
        experts=0, active_experts=0,
    )  # fmt: skip
    mlp = Unit(
        attention=0, dense_mlps=1, moe_mlps=0,
        sharded=h * glu * ffn + ffn * h + bias * glu * ffn,
        replicated=norm + bias * h, experts=0, active_experts=0,
    )  # fmt: skip
    moe_fields = {}
    moe = None
    if model_derived.has_experts(m):
        experts, topk = m.num_moe_experts, m.moe_router_topk
        expert_ffn = model_derived.expert_ffn_hidden_size(m)
        shared_ffn = m.moe_shared_expert_intermediate_size or 0
        expert = h * glu * expert_ffn + expert_ffn * h
        gate = h if shared_ffn and m.moe_shared_expert_gate else 0
        moe = Unit(
            attention=0, dense_mlps=0, moe_mlps=1,
            sharded=h * glu * shared_ffn + shared_ffn * h,
            replicated=norm + experts * h + gate,
            experts=experts * expert, active_experts=topk * expert,
        )  # fmt: skip
        moe_fields = dict(
            moe_experts=experts, moe_topk=topk, expert_ffn=expert_ffn, shared_ffn=shared_ffn,
            ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size or tp,
        )  # fmt: skip

    symbol_unit = {hybrid_pattern.ATTENTION: attention, hybrid_pattern.MLP: mlp}
    if moe is not None:
        symbol_unit[hybrid_pattern.MOE] = moe
    units_are_layers = not (m.architecture == "hybrid" and m.hybrid_layer_pattern)
    segments = _pipeline_segments(cfg, pp, vp)
    units: list[Unit] = []
    segment_units: list[list[int]] = []
    for segment in segments:
        indices = []
        symbols = list(segment)
        if units_are_layers:  # pairs: attention, then MLP or MoE
            symbols = [segment[i : i + 2] for i in range(0, len(segment), 2)]
        for symbol in symbols:
            parts = [symbol_unit[s] for s in symbol]
            indices.append(len(units))
            units.append(_sum_units(parts))
        segment_units.append(indices)
    # megatron's segment order: vp_stage * pp + pp_rank.
    stages = tuple(
        tuple(i for chunk in range(vp) for i in segment_units[chunk * pp + rank])
        for rank in range(pp)
    )

    embedding = vocab * h
    if m.position_embedding_type == "learned_absolute":
        embedding += model_derived.max_positions(m, m.encoder_seq_length) * h
    untied = not m.share_embeddings_and_output_weights
    return ModelShape(
        hidden=h, heads=heads, query=q, key_value=kv, ffn=ffn, glu=glu, vocab=vocab,
        units=tuple(units), stages=stages, chunks=vp, units_are_layers=units_are_layers,
        embedding=embedding,
        # With PP > 1 the last stage holds the output weights even when tied (megatron
        # keeps a copy there and all-reduces their gradients with the first stage's).
        output_layer=vocab * h if (untied or pp > 1) else 0,
        final_norm=norm,
        tied=not untied,
        **moe_fields,
    )  # fmt: skip


def declared_layer_parameters(m: ModelConfig) -> int:
    """The parameters per layer (per attention sublayer of a hybrid pattern) that model
    settings declare with ``params=`` (``config.settings``), held whole by every TP rank:
    how a setting's parameters are counted without a line here."""
    return sum(d.setting.params(m) for d in declared_settings(type(m)) if d.setting.params)


def _pipeline_segments(cfg: ExperimentConfig, pp: int, vp: int) -> list[str]:
    """Each pipeline segment's sublayer symbols, in megatron's segment order."""
    m = cfg.model
    if m.architecture == "hybrid" and m.hybrid_layer_pattern:
        if pp * vp == 1:
            return [hybrid_pattern.sublayers(m.hybrid_layer_pattern)]
        return m.hybrid_layer_pattern.split(hybrid_pattern.PIPE)
    pattern = hybrid_pattern.gpt_equivalent_pattern(model_derived.moe_layers(m), pp * vp)
    return pattern.split(hybrid_pattern.PIPE)


def _sum_units(parts: list[Unit]) -> Unit:
    return Unit(*(sum(getattr(p, name) for p in parts) for name in Unit.__dataclass_fields__))


@dataclass(frozen=True)
class ParameterCounts:
    """The whole model's parameters (all ranks together) and those one token meets."""

    total: int
    active: int
    per_stage: tuple[int, ...]  # each pipeline stage's, all its TP/EP ranks together
    per_rank: tuple[int, ...]  # one GPU's of each pipeline stage
    experts_per_rank: tuple[int, ...]  # of ``per_rank``: the routed experts' share


def parameter_counts(shape: ModelShape, tp: int) -> ParameterCounts:
    per_stage, per_rank, experts_per_rank = [], [], []
    last = len(shape.stages) - 1
    for rank, indices in enumerate(shape.stages):
        units = [shape.units[i] for i in indices]
        whole = sum(u.sharded + u.replicated + u.experts for u in units)
        here_experts = sum(u.experts for u in units) // (shape.ep * shape.etp)
        here = sum(u.sharded // tp + u.replicated for u in units) + here_experts
        ends = 0
        ends_here = 0
        if rank == 0:
            vocab_rows = shape.vocab * shape.hidden
            ends += shape.embedding
            ends_here += vocab_rows // tp + (shape.embedding - vocab_rows)
        if rank == last:
            ends += shape.output_layer + shape.final_norm
            ends_here += shape.output_layer // tp + shape.final_norm
        per_stage.append(whole + ends)
        per_rank.append(here + ends_here)
        experts_per_rank.append(here_experts)
    tied_copy = shape.output_layer if shape.tied else 0  # the same weights twice
    total = sum(per_stage) - tied_copy
    idle = sum(u.experts - u.active_experts for u in shape.units)
    return ParameterCounts(
        total=total,
        active=total - idle,
        per_stage=tuple(per_stage),
        per_rank=tuple(per_rank),
        experts_per_rank=tuple(experts_per_rank),
    )


def world_and_data_parallel(cfg: ExperimentConfig) -> tuple[int, int]:
    """GPUs in the run and its data-parallel size."""
    m = cfg.model
    world = layout.world_size(cfg.trainer.num_nodes, cfg.trainer.devices)
    parallel = layout.ParallelLayout(
        tensor=m.tensor_model_parallel_size,
        pipeline=m.pipeline_model_parallel_size,
        context=m.context_parallel_size,
    )
    return world, parallel.data_parallel(world)
