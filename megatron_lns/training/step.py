"""One optimizer step through megatron's pipeline schedules.

``get_forward_backward_func`` picks megatron's no-pipelining, 1F1B or interleaved
(virtual pipeline) schedule from the parallel state; the same code runs at any
TP/PP/VP/CP. Loss is the token-mean masked cross-entropy, reported on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_lns.runtime.fault_injection import inject_fault
from megatron_lns.training.timers import timed

Batch = dict[str, torch.Tensor]


def make_batch(tokens: torch.Tensor) -> Batch:
    """A language-modelling batch from ``[b, s+1]`` token ids: inputs, next-token labels."""
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    return {
        "tokens": inputs,
        "labels": labels,
        "loss_mask": torch.ones_like(labels, dtype=torch.float),
        "position_ids": positions,
    }


def _masked_token_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    mask = loss_mask.reshape(-1).float()
    loss_sum = (per_token_loss.float().reshape(-1) * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def lm_forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module):
    """megatron ``forward_step_func``: run one micro-batch, return (output, loss_func).

    With context parallelism every rank of a CP group reads the same micro-batch and
    keeps its two (load-balanced) chunks of each sequence, as megatron-core slices them.
    """
    batch = next(data_iterator)
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(
            dict(batch), is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
        )
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_masked_token_loss, batch["loss_mask"])


@dataclass
class StepResult:
    loss: float
    num_tokens: int  # loss tokens of the whole step, all data-parallel ranks together
    num_samples: int = 0  # sequences of the whole step (its global batch size)
    grad_norm: float | None = None
    update_successful: bool = True


def forward_backward(
    model: Sequence[torch.nn.Module],
    microbatches: Sequence[Batch],
    forward_only: bool = False,
) -> StepResult:
    """Run every micro-batch through the pipeline; returns the token-mean loss.

    All ranks get the same loss: it is summed over data-parallel (and context-parallel,
    each holding part of every sequence) ranks on the last pipeline stage and broadcast
    from there.
    """
    first = microbatches[0]["tokens"]
    num_chunks = len(model)
    iterators = [iter(microbatches) for _ in range(num_chunks)]
    # megatron's schedules record the autograd graph even with forward_only (Megatron-LM's
    # evaluation wraps them in no_grad): nothing to keep for a backward that never runs.
    with torch.set_grad_enabled(not forward_only):
        losses = get_forward_backward_func()(
            forward_step_func=lm_forward_step,
            data_iterator=iterators if num_chunks > 1 else iterators[0],
            model=list(model) if num_chunks > 1 else model[0],
            num_microbatches=len(microbatches),
            seq_length=first.shape[1],
            micro_batch_size=first.shape[0],
            forward_only=forward_only,
        )
    totals = torch.zeros(2, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for reported in losses:
            totals += reported["lm loss"].detach().to(torch.float64).cpu()
        device_totals = totals.to(first.device)
        dist.all_reduce(
            device_totals,
            group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
        totals = device_totals.cpu()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        device_totals = totals.to(first.device)
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(
            device_totals, src=last, group=parallel_state.get_pipeline_model_parallel_group()
        )
        totals = device_totals.cpu()
    loss_sum, tokens = totals.tolist()
    num_samples = len(microbatches) * first.shape[0] * parallel_state.get_data_parallel_world_size()
    return StepResult(
        loss=loss_sum / max(tokens, 1.0), num_tokens=int(tokens), num_samples=num_samples
    )


def train_step(
    model: Sequence[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    microbatches: Sequence[Batch],
    step: int = 0,
) -> StepResult:
    """Zero grads, forward/backward every micro-batch, optimizer step (with clipping);
    ``step`` (1-based) is where a test's injected fault hits."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    result = forward_backward(model, microbatches)
    inject_fault("step", step)
    config = optimizer.config  # megatron's timers, when the run has them (timers.py)
    with timed(config.timers, "optimizer", barrier=config.barrier_with_L1_time):
        update_successful, grad_norm, _ = optimizer.step()
    result.grad_norm = None if grad_norm is None else float(grad_norm)
    result.update_successful = bool(update_successful)
    return result


def sync_parameters(model: Sequence[DistributedDataParallel]) -> None:
    """Make every rank's parameters current before they are read outside a forward pass
    (a checkpoint save).

    With ``overlap_param_gather`` the distributed optimizer's update reaches a rank's
    parameters in the next forward pass's pre-hooks; until then the parameters that
    other ranks updated are stale. Megatron-LM's own pattern: disabling the hooks
    all-gathers synchronously, then they are re-armed for the next step.
    """
    for chunk in model:
        if chunk.ddp_config.overlap_param_gather:
            chunk.disable_forward_pre_hook(param_sync=True)
            chunk.enable_forward_pre_hook()
