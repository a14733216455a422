"""``model``'s batch sizes and how the model is split over ranks (TP, PP, VP, SP, CP);
the experts' split (EP, ETP) is with the MoE keys."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lns.config.rules import (
    positive,
    rampup_batch_sizes,
)
from megatron_lns.config.settings import listed_in, setting


@listed_in("parallelism")
@dataclass
class ParallelismSettings:
    """``model``'s batch and parallelism keys (the ``parallelism`` table)."""

    micro_batch_size: int = setting(4, positive)
    """sequences per forward pass per data-parallel rank"""

    global_batch_size: int = setting(8, positive)
    """sequences per optimizer step; megatron's num-microbatches calculator derives gradient
    accumulation = global / (micro x DP)"""

    rampup_batch_size: list[int] | None = setting(None, rampup_batch_sizes)
    """`[start_batch_size, batch_size_increment, ramp_up_samples]`: batch-size ramp-up,
    Megatron-LM's `--rampup-batch-size` (below)"""

    tensor_model_parallel_size: int = setting(1, positive, target="ParallelLayout.tensor")
    """`TransformerConfig.tensor_model_parallel_size`"""

    pipeline_model_parallel_size: int = setting(1, positive, target="ParallelLayout.pipeline")
    """`pipeline_model_parallel_size`; layers split evenly across stages"""

    virtual_pipeline_model_parallel_size: int | None = setting(
        None, positive, target="ParallelLayout.virtual_pipeline"
    )
    """model chunks per pipeline stage (interleaved 1F1B schedule)"""

    sequence_parallel: bool = setting(False, target="ParallelLayout")
    """megatron sequence parallelism (needs TP > 1); LNS norms mark their weights for the TP grad
    all-reduce"""

    context_parallel_size: int = setting(1, positive, target="ParallelLayout.context")
    """`context_parallel_size` of `parallel_state` and `TransformerConfig`: each sequence is split
    into 2 x CP chunks and every rank of a CP group keeps two of them (megatron-core's load-balanced
    `get_batch_on_this_cp_rank`); attention exchanges keys and values in Transformer Engine's ring.
    Needs `model.transformer_engine: true`, a sequence length divisible by 2 x CP, and a world size
    divisible by TP x PP x CP (DP = world / (TP x PP x CP)); gradients are reduced, and the
    distributed optimizer sharded, over DP x CP. Not run on CPU (TE needs CUDA): the checks and the
    resolved configs are tested"""
