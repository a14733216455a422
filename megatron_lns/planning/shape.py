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

A stage's units are kept counted, each distinct unit once with how many the stage holds
(:data:`UnitCounts`): a GPT model's layers are alike but for MoE, so ``plan`` costs the
same for 12 layers as for a billion, and its numbers are the sums they were.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from megatron_lns.config import hybrid_pattern, layout, model_derived
from megatron_lns.config.moe_layers import moe_layer_count
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


# Units, each distinct one once, with how many of it there are.
UnitCounts = tuple[tuple[Unit, int], ...]


def total(units: UnitCounts, value: Callable[[Unit], int]) -> int:
    """The sum of ``value`` over every unit that ``units`` counts."""
    return sum(value(unit) * count for unit, count in units)


def _counted(counter: Counter[Unit]) -> UnitCounts:
    return tuple((unit, count) for unit, count in counter.items() if count)


def _tally(pairs: Iterable[tuple[Unit, int]]) -> Counter[Unit]:
    """``(unit, count)`` pairs added up by unit (two kinds may build alike units)."""
    counter: Counter[Unit] = Counter()
    for unit, count in pairs:
        counter[unit] += count
    return counter


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
    stages: tuple[UnitCounts, ...]  # each pipeline stage's units (all its chunks)
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
    def unit_counts(self) -> UnitCounts:
        """The units of every stage together."""
        return _counted(_tally(pair for stage in self.stages for pair in stage))

    @property
    def attention_units(self) -> int:
        return total(self.unit_counts, lambda u: u.attention)


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
    if units_are_layers:  # a layer: attention, then an MLP or MoE
        layer = {kind: _sum_units([attention, symbol_unit[kind]]) for kind in symbol_unit}
        segments = _gpt_segments(m, pp * vp, layer)
    else:
        segments = [
            _tally((symbol_unit[symbol], count) for symbol, count in Counter(segment).items())
            for segment in _hybrid_segments(m, pp * vp)
        ]
    # megatron's segment order: vp_stage * pp + pp_rank.
    stages = tuple(
        _counted(sum((segments[chunk * pp + rank] for chunk in range(vp)), Counter()))
        for rank in range(pp)
    )

    embedding = vocab * h
    if m.position_embedding_type == "learned_absolute":
        embedding += model_derived.max_positions(m, m.encoder_seq_length) * h
    untied = not m.share_embeddings_and_output_weights
    return ModelShape(
        hidden=h, heads=heads, query=q, key_value=kv, ffn=ffn, glu=glu, vocab=vocab,
        stages=stages, chunks=vp, units_are_layers=units_are_layers,
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


def _hybrid_segments(m: ModelConfig, segments: int) -> list[str]:
    """Each pipeline segment's sublayer symbols, in megatron's segment order."""
    if segments == 1:
        return [hybrid_pattern.sublayers(m.hybrid_layer_pattern)]
    return m.hybrid_layer_pattern.split(hybrid_pattern.PIPE)


def _gpt_segments(m: ModelConfig, segments: int, layer: dict[str, Unit]) -> list[Counter[Unit]]:
    """Each pipeline segment's layers, in megatron's segment order: the GPT model's even
    split of ``num_layers`` (``hybrid_pattern.gpt_equivalent_pattern``), whose MoE layers
    are counted, not listed (``layer``: the unit of a layer by its MLP's symbol)."""
    layers = m.num_layers
    per_segment = hybrid_pattern.layers_per_segment(layers, segments)
    counts = []
    for start in range(0, layers, per_segment):
        moe = 0
        if model_derived.has_experts(m):
            moe = moe_layer_count(m.moe_layer_freq, layers, start, start + per_segment)
        kinds = [(layer[hybrid_pattern.MLP], per_segment - moe)]
        counts.append(_tally([*kinds, (layer[hybrid_pattern.MOE], moe)] if moe else kinds))
    return counts


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
    for rank, units in enumerate(shape.stages):
        whole = total(units, lambda u: u.sharded + u.replicated + u.experts)
        here_experts = total(units, lambda u: u.experts) // (shape.ep * shape.etp)
        here = total(units, lambda u: u.sharded // tp + u.replicated) + here_experts
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
    total_parameters = sum(per_stage) - tied_copy
    idle = total(shape.unit_counts, lambda u: u.experts - u.active_experts)
    return ParameterCounts(
        total=total_parameters,
        active=total_parameters - idle,
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
