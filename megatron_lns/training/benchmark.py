"""Side-by-side step timing: several model variants, interleaved, in one process.

Machines are noisy, so variants are timed in alternating rounds (A, B, A, B, ...) and
compared by their median step time; a ratio from one run means more than two
absolute numbers from different runs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_lns.config import model_derived
from megatron_lns.config.fast_paths import FastPathRequest, resolve_fast_paths
from megatron_lns.config.layer_variants import REGISTRY as LAYER_VARIANTS
from megatron_lns.config.norm_scalings import REGISTRY as NORM_SCALINGS
from megatron_lns.model.language_model import GPTModelConfig
from megatron_lns.runtime import ParallelLayout
from megatron_lns.training.build import Trainable, build_trainable
from megatron_lns.training.machine import detect_machine
from megatron_lns.training.optim import OptimSettings
from megatron_lns.training.step import make_batch, train_step


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


# Timing needs an optimizer that steps; the schedule is irrelevant, so keep the LR flat.
TIMING_OPTIMIZER = OptimSettings(lr=1e-4, min_lr=1e-4, decay_style="constant")


def with_default_fast_paths(cfg: GPTModelConfig, device: torch.device) -> GPTModelConfig:
    """``cfg`` with the fused kernels and attention backend a training run of it gets by
    default on ``device`` (``fast_paths.py``: on CUDA where the kernels are installed, off
    on CPU), so that timings are of the kernels production runs use."""
    request = FastPathRequest(
        transformer_engine=cfg.backend == "te",
        rope=cfg.position_embedding_type == "rope",
        gelu_without_bias=cfg.activation == "gelu" and not cfg.bias,
        moe=model_derived.has_experts(cfg),
    )
    fast = resolve_fast_paths(request, detect_machine(cuda=device.type == "cuda"))
    return dataclasses.replace(cfg, **fast.model_fields())


def trainable_for_timing(
    cfg: GPTModelConfig,
    layout: ParallelLayout,
    device: torch.device,
    chunk_transform: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> Trainable:
    """Model and optimizer assembled as for training (``cfg.precision`` decides the
    wrapping, :func:`with_default_fast_paths` the kernels, gradient reduction overlaps on
    CUDA), with a flat learning rate."""
    return build_trainable(
        with_default_fast_paths(cfg, device),
        layout,
        device,
        TIMING_OPTIMIZER,
        10**6,
        chunk_transform,
    )


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
    """``variants``: name -> :class:`Trainable` from :func:`trainable_for_timing`."""
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
    for trainable in variants.values():
        for _ in range(warmup):
            train_step(trainable.model, trainable.optimizer, batches)
    _sync(device)
    times = {name: StepTimes(name, []) for name in variants}
    for _ in range(rounds):
        for name, trainable in variants.items():
            for _ in range(steps_per_round):
                _sync(device)
                start = time.perf_counter()
                train_step(trainable.model, trainable.optimizer, batches)
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
    """Step times of the same Pre-LN model under each registered norm scaling rule, keyed
    as ``compare`` names the arms (``pre_ln`` without a factor, ``lns``), the rule without
    a factor first; ``base`` holds the other :class:`GPTModelConfig` fields."""
    plain = next(name for name, info in LAYER_VARIANTS.items() if not info.changes_layer)
    rules = sorted(NORM_SCALINGS.values(), key=lambda info: info.scales_pre_norms)
    variants = {
        info.arm or plain: trainable_for_timing(
            GPTModelConfig(**{**base, "norm_scaling": info.name, "layer_variant": plain}),
            ParallelLayout(),
            device,
        )
        for info in rules
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
