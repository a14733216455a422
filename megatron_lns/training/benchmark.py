"""Side-by-side step timing: several model variants, interleaved, in one process.

Machines are noisy, so variants are timed in alternating rounds (A, B, A, B, ...) and
compared by their median step time; a ratio from one run means more than two
absolute numbers from different runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.transformer.module import Float16Module

from megatron_lns.model import GPTModelConfig, build_model
from megatron_lns.runtime import ParallelLayout
from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler
from megatron_lns.training.step import make_batch, train_step, wrap_with_ddp


@dataclass
class StepTimes:
    name: str
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_trainable(
    cfg: GPTModelConfig,
    layout: ParallelLayout,
    device: torch.device,
    chunk_transform: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
):
    """Model chunks (DDP-wrapped) and optimizer for timing; ``cfg.precision`` decides wrapping."""
    chunks = build_model(cfg, layout, device)
    if chunk_transform is not None:
        chunks = [chunk_transform(chunk) for chunk in chunks]
    if cfg.precision != "fp32":
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    model = wrap_with_ddp(chunks)
    optimizer, _ = build_optimizer_and_scheduler(
        model,
        OptimSettings(lr=1e-4, min_lr=1e-4, decay_style="constant"),
        10**6,
        chunks[0].config.params_dtype,
    )
    return model, optimizer


def compare_step_times(
    variants: dict[str, tuple],
    micro_batch_size: int,
    num_microbatches: int,
    seq_length: int,
    vocab_size: int,
    device: torch.device,
    warmup: int = 3,
    rounds: int = 5,
    steps_per_round: int = 5,
    seed: int = 0,
) -> dict[str, StepTimes]:
    """``variants``: name -> (model, optimizer) from :func:`build_trainable`."""
    gen = torch.Generator().manual_seed(seed)
    batches = [
        {
            k: v.to(device)
            for k, v in make_batch(
                torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
            ).items()
        }
        for _ in range(num_microbatches)
    ]
    for model, optimizer in variants.values():
        for _ in range(warmup):
            train_step(model, optimizer, batches)
    _sync(device)
    times = {name: StepTimes(name, []) for name in variants}
    for _ in range(rounds):
        for name, (model, optimizer) in variants.items():
            for _ in range(steps_per_round):
                _sync(device)
                start = time.perf_counter()
                train_step(model, optimizer, batches)
                _sync(device)
                times[name].seconds.append(time.perf_counter() - start)
    return times


def lns_vs_pre_ln(
    base: dict,
    device: torch.device,
    micro_batch_size: int,
    num_microbatches: int,
    **timing: int,
) -> dict[str, StepTimes]:
    """Step times of the same model with ``norm_scaling`` "none" and "lns" (keys
    ``pre_ln`` and ``lns``); ``base`` holds the other :class:`GPTModelConfig` fields."""
    variants = {
        name: build_trainable(
            GPTModelConfig(norm_scaling=scaling, **base), ParallelLayout(), device
        )
        for name, scaling in (("pre_ln", "none"), ("lns", "lns"))
    }
    return compare_step_times(
        variants,
        micro_batch_size,
        num_microbatches,
        base["seq_length"],
        base["vocab_size"],
        device,
        **timing,
    )
