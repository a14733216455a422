"""When a run does not fit: the changes that would make it fit, cheapest first.

Each candidate is a set of overrides, applied to the config, validated as ``train``
validates it, and estimated again. Its cost is the estimated growth of the step time,
as a fraction of the plan's step time, by a stated rule:

* distributed optimizer: 0. Its reduce-scatter of gradients and all-gather of weights
  move the same bytes as the all-reduce they replace (Megatron-LM,
  docs/source/api-guide/dist_optimizer.md); the gather overlaps with the forward.
* selective recomputation: the core attention's forward FLOPs again (2 q s per token per
  attention sublayer) over the step's FLOPs.
* full recomputation: one more forward of every layer, a third of the layers' FLOPs.
* a smaller micro-batch: the change of the pipeline bubble, (PP - 1) / (micro-batches x
  VP) of the step (Narayanan et al. 2021, eq. 1-2); smaller GEMMs' lower efficiency is
  not modelled.
* TP x 2 within a node (with sequence parallelism): the tensor-parallel collectives
  added, unoverlapped: per attention or MLP sublayer and micro-batch, two all-reduces
  (or their reduce-scatter + all-gather halves) of s x b x h 2-byte elements forward and
  two backward, each moving 2 (TP - 1) / TP of it over NVLink (the GPU table's one-way
  bandwidth).
* PP x 2: the change of the pipeline bubble, as above (DP halves, so there are twice the
  micro-batches); the point-to-point sends are not counted.

When no single change fits, the cheapest that lowers the memory is applied and the search
repeats, up to four changes together.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from megatron_lns.config import layout
from megatron_lns.config.schema import ExperimentConfig

MAX_COMBINED = 4


@dataclass(frozen=True)
class Fix:
    overrides: tuple[str, ...]
    what: str
    cost: float  # estimated step-time growth, a fraction of the plan's step time
    total_gb: float  # the heaviest GPU's memory with the change
    margin_gb: float

    def summary(self) -> str:
        return (
            f"{self.what}: {self.total_gb:.1f} GB (margin {self.margin_gb:+.1f} GB), "
            f"step time {self.cost:+.1%}"
        )


@dataclass(frozen=True)
class _Candidate:
    overrides: dict[str, object]
    what: str
    cost: float


def ranked_fixes(cfg: ExperimentConfig, plan, replan: Callable) -> list[Fix]:
    """The changes that make ``cfg`` fit ``plan.gpu``, cheapest first; ``replan(cfg)``
    is the plan (without fixes) of a changed config."""
    fixes = []
    for candidate in _candidates(cfg, plan):
        result = _try(cfg, candidate.overrides, replan)
        if result is not None and result.fits:
            fixes.append(_fix([candidate], result))
    if fixes:
        return sorted(fixes, key=lambda f: f.cost)
    combined = _combine(cfg, plan, replan)
    return [combined] if combined else []


def _combine(cfg: ExperimentConfig, plan, replan: Callable) -> Fix | None:
    """Greedy: apply the cheapest change that lowers the memory, until it fits."""
    chosen: list[_Candidate] = []
    current, current_plan = cfg, plan
    for _ in range(MAX_COMBINED):
        best = None
        for candidate in sorted(_candidates(current, current_plan), key=lambda c: c.cost):
            result = _try(current, candidate.overrides, replan)
            if result is not None and result.heaviest.total_gb < current_plan.heaviest.total_gb:
                best = (candidate, result)
                break
        if best is None:
            return None
        chosen.append(best[0])
        current, current_plan = _apply(current, best[0].overrides), best[1]
        if current_plan.fits:
            return _fix(chosen, current_plan)
    return None


def _fix(chosen: list[_Candidate], result) -> Fix:
    overrides = {}
    for candidate in chosen:
        overrides.update(candidate.overrides)
    return Fix(
        overrides=tuple(f"{k}={_yaml(v)}" for k, v in overrides.items()),
        what=" + ".join(c.what for c in chosen),
        cost=sum(c.cost for c in chosen),
        total_gb=result.heaviest.total_gb,
        margin_gb=result.margin_gb,
    )


def _try(cfg: ExperimentConfig, overrides: dict[str, object], replan: Callable):
    """The plan with ``overrides``, or None when the config refuses them."""
    from megatron_lns.base.errors import UserError
    from megatron_lns.config import validate

    changed = _apply(cfg, overrides)
    try:
        validate(changed, check_files=False)
        return replan(changed)
    except (UserError, ValueError):
        return None


def _apply(cfg: ExperimentConfig, overrides: dict[str, object]) -> ExperimentConfig:
    changed = copy.deepcopy(cfg)
    for key, value in overrides.items():
        *parents, name = key.split(".")
        target = changed
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)
    return changed


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _candidates(cfg: ExperimentConfig, plan) -> Iterator[_Candidate]:
    m = cfg.model
    t = plan.throughput
    shape_flops = t.flops_per_token
    s = m.encoder_seq_length
    from megatron_lns.planning.shape import model_shape

    shape = model_shape(cfg, plan.vocab_size)
    if m.optim.name != "distributed_fused_adam":
        yield _Candidate(
            {"model.optim.name": "distributed_fused_adam"}, "distributed optimizer", 0.0
        )
    granularity = m.activations_checkpoint_granularity
    if granularity is None:
        core = 2.0 * shape.attention_units * shape.query * s
        yield _Candidate(
            {"model.activations_checkpoint_granularity": "selective"},
            "selective recomputation",
            core / shape_flops,
        )
    if granularity != "full":
        logits = 6.0 * shape.hidden * shape.vocab
        yield _Candidate(
            {
                "model.activations_checkpoint_granularity": "full",
                "model.activations_checkpoint_method": "uniform",
                "model.activations_checkpoint_num_layers": 1,
            },
            "full recomputation",
            (shape_flops - logits) / 3 / shape_flops,
        )
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    if m.micro_batch_size > 1:
        smaller = m.micro_batch_size // 2
        micro = plan.micro_batches * m.micro_batch_size // smaller
        yield _Candidate(
            {"model.micro_batch_size": smaller},
            f"micro_batch_size {smaller}",
            _bubble(pp, micro, vp) - _bubble(pp, plan.micro_batches, vp),
        )
    tp = m.tensor_model_parallel_size
    if 2 * tp <= cfg.trainer.devices:
        yield _Candidate(
            {"model.tensor_model_parallel_size": 2 * tp, "model.sequence_parallel": True},
            f"TP {2 * tp} (+ sequence parallel)",
            (_tp_seconds(cfg, shape, plan, 2 * tp) - _tp_seconds(cfg, shape, plan, tp))
            / t.step_seconds,
        )
    world = layout.world_size(cfg.trainer.num_nodes, cfg.trainer.devices)
    if world % (2 * pp * tp * m.context_parallel_size) == 0:
        yield _Candidate(
            {"model.pipeline_model_parallel_size": 2 * pp},
            f"PP {2 * pp}",
            _bubble(2 * pp, 2 * plan.micro_batches, vp) - _bubble(pp, plan.micro_batches, vp),
        )


def _bubble(pp: int, micro_batches: int, vp: int) -> float:
    """The pipeline bubble as a fraction of the ideal step time."""
    return (pp - 1) / (micro_batches * vp)


def _tp_seconds(cfg: ExperimentConfig, shape, plan, tp: int) -> float:
    """Seconds per step of unoverlapped tensor-parallel collectives on one GPU."""
    if tp == 1:
        return 0.0
    from megatron_lns.planning.shape import total

    m = cfg.model
    pp = m.pipeline_model_parallel_size
    sublayers = total(shape.unit_counts, lambda u: u.attention + u.dense_mlps + u.moe_mlps) / pp
    world = layout.world_size(cfg.trainer.num_nodes, cfg.trainer.devices)
    dp = world // (tp * pp * m.context_parallel_size)
    micro = m.global_batch_size // (m.micro_batch_size * dp)
    tensor_bytes = (
        m.encoder_seq_length // m.context_parallel_size * m.micro_batch_size * shape.hidden * 2
    )
    moved = 4 * sublayers * micro * tensor_bytes * 2 * (tp - 1) / tp
    return moved / (plan.gpu.nvlink_gb_per_s * 1e9)
