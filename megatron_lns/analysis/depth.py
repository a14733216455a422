"""Per-layer diagnostics of a trained model: the curse-of-depth signature.

In a Pre-LN transformer the variance of the residual stream grows with depth, and
deep layers change their input less and less: their output is close to their input
(small angular distance) and removing one costs little held-out loss (small pruning
drop). LNS is meant to curb all three. :func:`depth_diagnostics` measures them on
held-out batches for any model chunks this package builds or trains:

* angular distance ``arccos(cos(x_in, x_out)) / pi`` between a layer's input and output
  hidden state, averaged over every token and over the last token of each sequence only
  (the ShortGPT measure the LNS paper's scripts use);
* the variance of the layer's output hidden state over all its elements;
* the held-out loss with the layer replaced by the identity (its output is its input,
  as when the layer is deleted from the residual stream), minus the full model's loss.

Everything is collected with forward hooks on megatron's own layers and run through
megatron's pipeline schedules, so it works at any TP/SP/PP/VP/DP layout; rows are keyed
by the global (1-based) layer number and every rank returns the same report.

A "layer" here is the paper's block ``l``: a GPT model's transformer layer, or in a
hybrid model (``HybridModel``) the run of sublayers that share one block number (an
attention and the MLP after it, ``hybrid_pattern.block_numbers``). A block's input is its
first sublayer's input, its output its last sublayer's output, and removing it removes
all its sublayers, so a GPT-equivalent hybrid model reports what its GPT twin reports.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_lns.base.json_numbers import json_safe
from megatron_lns.config import hybrid_pattern
from megatron_lns.model.language_model import unwrap
from megatron_lns.training.step import Batch, forward_backward

# Columns of a layer's running totals.
_SUM, _SUM_SQ, _COUNT, _ANGLE, _TOKENS, _LAST_ANGLE, _SEQUENCES = range(7)


@dataclass
class LayerStats:
    """Statistics of one layer's output on held-out data."""

    layer_number: int
    output_variance: float
    angular_distance: float
    angular_distance_last_token: float = float("nan")


@dataclass
class LayerDiagnostics(LayerStats):
    """:class:`LayerStats` plus the held-out loss without the layer (NaN if not measured)."""

    loss_without_layer: float = float("nan")
    pruning_drop: float = float("nan")


@dataclass
class DepthReport:
    """The held-out loss of the full model and the diagnostics of each layer."""

    loss: float
    num_tokens: int
    layers: list[LayerDiagnostics]
    pruned: bool = False  # whether each layer's removal was measured (pruning fields)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))

    def variance_growth(self) -> float:
        """Output variance of the last layer relative to the first."""
        return variance_growth(self.layers)

    def to_dict(self) -> dict:
        """Strict JSON types: a value not measured (the pruning fields unless ``pruned``)
        is None, a measured one that is not finite (a diverged model's) a string of
        ``json_numbers.NON_FINITE``."""
        unmeasured = () if self.pruned else ("loss_without_layer", "pruning_drop")
        return json_safe(
            {
                "loss": self.loss,
                "perplexity": self.perplexity,
                "num_tokens": self.num_tokens,
                "variance_growth": self.variance_growth(),
                "layers": [
                    {k: None if k in unmeasured else v for k, v in asdict(layer).items()}
                    for layer in self.layers
                ],
            }
        )


def angular_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``arccos(cos(x, y)) / pi`` along the last dimension, in [0, 1]."""
    cosine = torch.nn.functional.cosine_similarity(x, y, dim=-1)
    return torch.arccos(cosine.clamp(-1.0, 1.0)) / math.pi


def _hidden_in(args, kwargs) -> torch.Tensor:
    return kwargs.get("hidden_states", args[0] if args else None)


class _Accumulator:
    """Hooks summing one block's statistics over every micro-batch it sees: a forward
    pre-hook on its first sublayer keeps the block's input (:meth:`enter`), a forward hook
    on its last (the same module for a GPT layer) adds the statistics.

    Hidden states are megatron's ``[sequence, batch, hidden]``; under sequence
    parallelism this rank holds a slice of the sequence, and only the last tensor-parallel
    rank holds the last token.
    """

    def __init__(self, holds_last_token: bool) -> None:
        self.holds_last_token = holds_last_token
        self.totals: torch.Tensor | None = None
        self.hidden_in: torch.Tensor | None = None

    def enter(self, module, args, kwargs) -> None:
        self.hidden_in = _hidden_in(args, kwargs)

    def __call__(self, module, args, kwargs, output) -> None:
        hidden_out = output[0] if isinstance(output, tuple) else output
        x_in, x_out = self.hidden_in.detach().double(), hidden_out.detach().double()
        self.hidden_in = None
        distance = angular_distance(x_in, x_out)
        zero = distance.new_zeros(())
        last = distance[-1] if self.holds_last_token else None
        update = torch.stack(
            [
                x_out.sum(),
                x_out.pow(2).sum(),
                zero + x_out.numel(),
                distance.sum(),
                zero + distance.numel(),
                last.sum() if last is not None else zero,
                zero + (last.numel() if last is not None else 0),
            ]
        )
        self.totals = update if self.totals is None else self.totals + update


def block_number(layer: torch.nn.Module) -> int:
    """The paper's block index of a decoder layer: its ``block_number`` (a hybrid model's
    sublayer), else megatron's ``layer_number``."""
    return getattr(layer, "block_number", layer.layer_number)


def _local_blocks(model: Sequence[torch.nn.Module]) -> dict[int, list[torch.nn.Module]]:
    """This rank's blocks, by number: each block's (sub)layers in forward order. A hybrid
    block whose sublayers are not all in one chunk is refused: its input and output are
    not both seen there (``analysis.trained_models`` refuses such a layout first)."""
    blocks: dict[int, list[torch.nn.Module]] = {}
    for chunk in model:
        local: dict[int, list[torch.nn.Module]] = {}
        for layer in unwrap(chunk).decoder.layers:
            local.setdefault(block_number(layer), []).append(layer)
        pattern = getattr(unwrap(chunk), "hybrid_layer_pattern", None)
        if pattern:
            sizes = Counter(hybrid_pattern.block_numbers(pattern.split(hybrid_pattern.MTP)[0]))
            for number, layers in local.items():
                if len(layers) != sizes[number]:
                    raise ValueError(
                        f"block {number} of hybrid_layer_pattern {pattern!r} is split between "
                        "pipeline stages or virtual chunks"
                    )
        blocks |= local
    return blocks


def _reduce_totals(model: Sequence[torch.nn.Module], local: dict[int, torch.Tensor]) -> dict:
    """Every block's totals summed over the ranks that saw parts of them."""
    config = unwrap(model[0]).config
    device = next(unwrap(model[0]).parameters()).device
    # config.num_layers counts a hybrid model's sublayers: at least one per block.
    totals = torch.zeros(config.num_layers, 7, dtype=torch.float64, device=device)
    for number, sums in local.items():
        totals[number - 1] += sums.to(device)
    if config.sequence_parallel:
        dist.all_reduce(totals, group=parallel_state.get_tensor_model_parallel_group())
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
    blocks = int((totals[:, _COUNT] > 0).sum())
    return {number: totals[number - 1].cpu() for number in range(1, blocks + 1)}


def _stats_from_totals(number: int, totals: torch.Tensor) -> LayerStats:
    t = totals.tolist()
    mean = t[_SUM] / t[_COUNT]
    return LayerStats(
        layer_number=number,
        output_variance=t[_SUM_SQ] / t[_COUNT] - mean * mean,
        angular_distance=t[_ANGLE] / t[_TOKENS],
        angular_distance_last_token=t[_LAST_ANGLE] / t[_SEQUENCES],
    )


@contextlib.contextmanager
def _eval_mode(model: Sequence[torch.nn.Module]) -> Iterator[None]:
    was_training = [chunk.training for chunk in model]
    for chunk in model:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, training in zip(model, was_training, strict=True):
            chunk.train(training)


@torch.no_grad()
def held_out_loss(
    model: Sequence[torch.nn.Module], batches: Sequence[Sequence[Batch]]
) -> tuple[float, int]:
    """Token-mean loss over ``batches`` (each one pipeline pass of micro-batches) and the
    number of tokens, as the trainer's evaluation computes it."""
    loss_sum, tokens = 0.0, 0
    for microbatches in batches:
        result = forward_backward(model, microbatches, forward_only=True)
        loss_sum += result.loss * result.num_tokens
        tokens += result.num_tokens
    return loss_sum / max(tokens, 1), tokens


def _replace_output_by_input(module, args, kwargs, output):
    hidden_in = _hidden_in(args, kwargs)
    if isinstance(output, tuple):
        return (hidden_in, *output[1:])
    return hidden_in


@contextlib.contextmanager
def layer_removed(model: Sequence[torch.nn.Module], layer_number: int) -> Iterator[None]:
    """Global layer (block) ``layer_number`` acts as the identity (its output is its
    input: each of its sublayers does) on whichever rank holds it; the model is left
    unchanged afterwards."""
    blocks = _local_blocks(model).get(layer_number, [])
    with forward_hooks(blocks, _replace_output_by_input, with_kwargs=True):
        yield


@contextlib.contextmanager
def forward_hooks(
    modules: Sequence[torch.nn.Module], hook: Callable, with_kwargs: bool = False
) -> Iterator[None]:
    """``hook`` on the forward of each of ``modules`` while inside."""
    handles = [m.register_forward_hook(hook, with_kwargs=with_kwargs) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def _layer_totals(
    model: Sequence[torch.nn.Module], batches: Sequence[Sequence[Batch]]
) -> tuple[dict[int, torch.Tensor], float, int]:
    config = unwrap(model[0]).config
    holds_last_token = not config.sequence_parallel or (
        parallel_state.get_tensor_model_parallel_rank()
        == parallel_state.get_tensor_model_parallel_world_size() - 1
    )
    accumulators: dict[int, _Accumulator] = {}
    handles = []
    for number, layers in _local_blocks(model).items():
        acc = accumulators[number] = _Accumulator(holds_last_token)
        handles.append(layers[0].register_forward_pre_hook(acc.enter, with_kwargs=True))
        handles.append(layers[-1].register_forward_hook(acc, with_kwargs=True))
    try:
        loss, tokens = held_out_loss(model, batches)
    finally:
        for handle in handles:
            handle.remove()
    local = {n: acc.totals for n, acc in accumulators.items() if acc.totals is not None}
    return _reduce_totals(model, local), loss, tokens


def layer_statistics(
    model: Sequence[torch.nn.Module], microbatches: Sequence[Batch]
) -> list[LayerStats]:
    """Output variance and input/output angular distance of every layer, in global order,
    from one pipeline pass over ``microbatches`` (all ranks call it)."""
    with _eval_mode(model):
        totals, _, _ = _layer_totals(model, [microbatches])
    return [_stats_from_totals(n, t) for n, t in sorted(totals.items())]


def depth_diagnostics(
    model: Sequence[torch.nn.Module],
    batches: Sequence[Sequence[Batch]],
    prune: bool = True,
    progress: Callable[[int], None] | None = None,
) -> DepthReport:
    """Diagnostics of every layer of ``model`` on the held-out ``batches``.

    ``model`` is this rank's chunks (bare, Float16Module- or DDP-wrapped: a trained
    ``Trainer.model`` serves); ``batches`` a sequence of global batches, each this rank's
    micro-batches (``list(trainer.validation_microbatches())``). All ranks call it and
    get the same report. With ``prune`` the held-out loss is measured again once per
    layer with that layer removed (``num_layers`` further passes over ``batches``);
    ``progress`` is called with each layer number once its removal is measured. The
    model is put in eval mode for the measurement and returned to its previous mode.
    """
    with _eval_mode(model):
        totals, loss, tokens = _layer_totals(model, batches)
        layers = [
            LayerDiagnostics(**asdict(_stats_from_totals(n, t))) for n, t in sorted(totals.items())
        ]
        if prune:
            for row in layers:
                with layer_removed(model, row.layer_number):
                    row.loss_without_layer, _ = held_out_loss(model, batches)
                row.pruning_drop = row.loss_without_layer - loss
                if progress is not None:
                    progress(row.layer_number)
    return DepthReport(loss=loss, num_tokens=tokens, layers=layers, pruned=prune)


def variance_growth(stats: Sequence[LayerStats]) -> float:
    """Output variance of the last layer relative to the first."""
    return stats[-1].output_variance / stats[0].output_variance
