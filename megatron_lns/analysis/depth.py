"""Per-layer hidden-state statistics: the curse-of-depth signature.

In a Pre-LN transformer the variance of the residual stream grows with depth, and
deep layers change their input less and less (their output is close to their
input: small angular distance). LNS is meant to curb both. These statistics are
collected with forward hooks on megatron's own layers, so they work at any
TP/PP/VP layout; under pipeline parallelism every rank returns the full table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_lns.model import unwrap
from megatron_lns.training.step import Batch, forward_backward


@dataclass
class LayerStats:
    layer_number: int
    output_variance: float
    angular_distance: float


class _Accumulator:
    def __init__(self) -> None:
        # sum, sum of squares, element count, sum of per-token angular distance, tokens
        self.totals = torch.zeros(5, dtype=torch.float64)

    def __call__(self, module, args, kwargs, output) -> None:
        hidden_in = kwargs.get("hidden_states", args[0] if args else None)
        hidden_out = output[0] if isinstance(output, tuple) else output
        x = hidden_out.detach().double()
        cosine = torch.nn.functional.cosine_similarity(
            hidden_in.detach().double(), x, dim=-1
        ).clamp(-1.0, 1.0)
        self.totals += torch.stack(
            [
                x.sum().cpu(),
                x.pow(2).sum().cpu(),
                torch.tensor(float(x.numel()), dtype=torch.float64),
                (torch.arccos(cosine) / math.pi).sum().cpu(),
                torch.tensor(float(cosine.numel()), dtype=torch.float64),
            ]
        )


@torch.no_grad()
def layer_statistics(
    model: Sequence[torch.nn.Module], batches: Sequence[Batch]
) -> list[LayerStats]:
    """Output variance and input/output angular distance of every layer, in global order."""
    accumulators: dict[int, _Accumulator] = {}
    handles = []
    for chunk in model:
        for layer in unwrap(chunk).decoder.layers:
            acc = accumulators[layer.layer_number] = _Accumulator()
            handles.append(layer.register_forward_hook(acc, with_kwargs=True))
    try:
        forward_backward(model, batches, forward_only=True)
    finally:
        for handle in handles:
            handle.remove()

    local = {number: acc.totals for number, acc in accumulators.items()}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        # With sequence parallelism each TP rank saw a slice of the sequence.
        config = unwrap(model[0]).config
        if config.sequence_parallel:
            for totals in local.values():
                reduced = totals.clone()
                dist.all_reduce(reduced, group=parallel_state.get_tensor_model_parallel_group())
                totals.copy_(reduced)
    gathered: list[dict[int, torch.Tensor]] = [
        {}
    ] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(
        gathered, local, group=parallel_state.get_pipeline_model_parallel_group()
    )
    merged = {number: totals for part in gathered for number, totals in part.items()}

    stats = []
    for number in sorted(merged):
        total, total_sq, count, angle_sum, tokens = merged[number].tolist()
        mean = total / count
        stats.append(
            LayerStats(
                layer_number=number,
                output_variance=total_sq / count - mean * mean,
                angular_distance=angle_sum / tokens,
            )
        )
    return stats


def variance_growth(stats: Sequence[LayerStats]) -> float:
    """Output variance of the last layer relative to the first."""
    return stats[-1].output_variance / stats[0].output_variance
