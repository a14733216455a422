"""The optimizer and learning-rate schedule, from megatron-core.

A component beside the model: built from :class:`OptimSettings` and the DDP-wrapped
model chunks, with no knowledge of YAML or of the training loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from megatron_lns.config.choices import DecayStyle, warmup_fits


@dataclass
class OptimSettings:
    """AdamW/SGD with warmup + decay; the subset of knobs LNS recipes use."""

    name: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-3
    min_lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_steps: int | None = None
    decay_style: DecayStyle = "cosine"
    use_distributed_optimizer: bool = False
    # false: megatron's default, no weight decay on biases and 1-D tensors (norm weights)
    decay_norms_and_biases: bool = False
    # fp16 dynamic loss scaling (unused in bf16/fp32)
    initial_loss_scale: float = 2.0**32
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # Any other OptimizerConfig field, passed on as it is (a declared pass-through key).
    extra_optimizer_config: dict[str, Any] = field(default_factory=dict)

    def megatron_config(self, params_dtype: torch.dtype = torch.float32) -> OptimizerConfig:
        return OptimizerConfig(
            optimizer=self.name,
            lr=self.lr,
            min_lr=self.min_lr,
            weight_decay=self.weight_decay,
            adam_beta1=self.betas[0],
            adam_beta2=self.betas[1],
            adam_eps=self.eps,
            sgd_momentum=0.0,
            clip_grad=self.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            params_dtype=params_dtype,
            use_distributed_optimizer=self.use_distributed_optimizer,
            initial_loss_scale=self.initial_loss_scale,
            loss_scale_window=self.loss_scale_window,
            hysteresis=self.hysteresis,
            **self.extra_optimizer_config,
        )


def build_optimizer(
    model: Sequence[DistributedDataParallel],
    optimizer_config: OptimizerConfig,
    decay_norms_and_biases: bool = False,
) -> MegatronOptimizer:
    """megatron's optimizer; its loss scaling is hooked into the pipeline schedules.

    ``decay_norms_and_biases`` applies weight decay to every parameter (NeMo's
    ``do_layer_norm_weight_decay``): no per-parameter override instead of megatron's
    standard one that exempts biases and 1-D tensors."""
    overrides = {} if decay_norms_and_biases else None
    optimizer = get_megatron_optimizer(optimizer_config, list(model), config_overrides=overrides)
    get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
    if optimizer_config.optimizer == "sgd" and not optimizer_config.sgd_momentum:
        # megatron-core gives SGD no function to make its state, which loading a checkpoint
        # calls ('NoneType' object is not callable); SGD without momentum has no state.
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            part.init_state_fn = _no_state
    return optimizer


def _no_state(optimizer: torch.optim.Optimizer, config: OptimizerConfig | None = None) -> None:
    """The state of an optimizer that keeps none (SGD without momentum): nothing to make."""


def build_optimizer_and_scheduler(
    model: Sequence[DistributedDataParallel],
    settings: OptimSettings,
    total_steps: int,
    params_dtype: torch.dtype = torch.float32,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """megatron optimizer + ``OptimizerParamScheduler``; the schedule counts optimizer steps."""
    decay_steps = settings.decay_steps or total_steps
    if not warmup_fits(settings.warmup_steps, decay_steps, settings.decay_style):
        raise ValueError(
            f"warmup_steps ({settings.warmup_steps}) must be smaller than the lr decay steps "
            f"({decay_steps}); shorten the warmup or train longer"
        )
    optimizer = build_optimizer(
        model, settings.megatron_config(params_dtype), settings.decay_norms_and_biases
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        # A constant schedule may warm up for longer than it runs; megatron still
        # asserts warmup < decay steps.
        lr_decay_steps=max(decay_steps, settings.warmup_steps + 1),
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
