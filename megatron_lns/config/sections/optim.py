"""``model.optim``: the optimizer and its learning-rate schedule, and how megatron DDP
reduces gradients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_lns.config.rules import (
    adam_betas,
    non_negative,
    one_of,
    positive,
)
from megatron_lns.config.sections.trainer import PRECISIONS
from megatron_lns.config.settings import setting, to

SCHEDULES = {"CosineAnnealing": "cosine", "LinearAnnealing": "linear", "Constant": "constant"}


OPTIMIZERS = {
    "fused_adam": "adam",
    "adam": "adam",
    "adamw": "adam",
    "distributed_fused_adam": "adam",
    "sgd": "sgd",
}


# model.optim.grad_sync_dtype: the dtype megatron DDP reduces gradients in.
GRAD_SYNC_DTYPES = ("fp32", "bf16", "fp16")


def uses_distributed_optimizer(cfg: Any) -> bool:
    """NeMo names the distributed optimizer as an optimizer of its own."""
    return cfg.model.optim.name == "distributed_fused_adam"


def _optimizer(value: str, cfg: Any) -> dict[str, Any]:
    return {"name": OPTIMIZERS[value], "use_distributed_optimizer": uses_distributed_optimizer(cfg)}


def _betas(value: list[float], cfg: Any) -> dict[str, Any]:
    return {"betas": (float(value[0]), float(value[1]))}


def _decay_steps(constant_steps: int, cfg: Any) -> dict[str, Any]:
    """The decay ends ``constant_steps`` before ``trainer.max_steps``."""
    return {"decay_steps": cfg.trainer.max_steps - constant_steps}


def reduces_gradients_in_fp32(grad_sync_dtype: str | None) -> bool:
    """What ``model.optim.grad_sync_dtype`` asks of megatron DDP (null: fp32)."""
    return (grad_sync_dtype or "fp32") == "fp32"


def reduced_gradient_bytes(cfg: Any) -> int:
    """Bytes of each gradient megatron DDP keeps and reduces: fp32 with fp32 parameters or
    an fp32 reduction, else the 16-bit type of the parameters."""
    fp32_params = PRECISIONS[str(cfg.trainer.precision)] == "fp32"
    return 4 if fp32_params or reduces_gradients_in_fp32(cfg.model.optim.grad_sync_dtype) else 2


def _grad_reduce_in_fp32(value: str | None, cfg: Any) -> dict[str, Any]:
    return {"grad_reduce_in_fp32": reduces_gradients_in_fp32(value)}


def _bucket_size(value: float | None, cfg: Any) -> dict[str, Any]:
    """megatron counts a bucket in parameters; NeMo sizes it in MB of reduced gradients."""
    if value is None:
        return {"bucket_size": None}
    return {"bucket_size": int(value * 2**20 / reduced_gradient_bytes(cfg))}


@dataclass
class SchedConfig:
    name: str = setting(
        "CosineAnnealing",
        one_of(SCHEDULES),
        target="OptimizerParamScheduler.lr_decay_style",
        translate=to("decay_style", SCHEDULES),
    )
    """`OptimizerParamScheduler` decay style: `CosineAnnealing` -> cosine, `LinearAnnealing` ->
    linear, `Constant` -> constant"""

    warmup_steps: int = setting(
        0,
        non_negative,
        target="OptimizerParamScheduler.lr_warmup_steps",
        translate=to("warmup_steps"),
    )
    """linear warmup steps"""

    constant_steps: int = setting(
        0, non_negative, target="OptimizerParamScheduler.lr_decay_steps", translate=_decay_steps
    )
    """steps held at `min_lr` at the end (decay spans `max_steps - constant_steps`)"""

    min_lr: float = setting(0.0, non_negative, target="OptimizerConfig")
    """final learning rate"""


@dataclass
class OptimConfig:
    name: str = setting(
        "fused_adam",
        one_of(OPTIMIZERS),
        target="OptimizerConfig.optimizer",
        translate=_optimizer,
        resume="optimizer",
    )
    """`fused_adam`, `adam`, `adamw`: megatron's `adam` (decoupled weight decay, i.e. AdamW);
    `distributed_fused_adam`: the same with the distributed optimizer (`use_distributed_optimizer`);
    `sgd`"""

    lr: float = setting(1e-4, positive, target="OptimizerConfig")
    """peak learning rate"""

    betas: list[float] = setting(
        check=adam_betas,
        default_factory=lambda: [0.9, 0.95],
        target="OptimizerConfig.adam_beta1",
        translate=_betas,
    )
    """`adam_beta1`, `adam_beta2`"""

    eps: float = setting(1e-8, positive, target="OptimizerConfig.adam_eps", translate=to("eps"))
    """`adam_eps`"""

    weight_decay: float = setting(0.0, non_negative, target="OptimizerConfig")
    """`weight_decay`"""

    sched: SchedConfig = field(default_factory=SchedConfig)
    overlap_grad_sync: bool | None = setting(
        None, target="DistributedDataParallelConfig.overlap_grad_reduce", policy="machine"
    )
    """`DistributedDataParallelConfig.overlap_grad_reduce`: each gradient bucket's all-reduce
    (reduce-scatter with the distributed optimizer) starts as soon as backward has filled it. Runs
    on gloo too. null: on with CUDA"""

    overlap_param_sync: bool | None = setting(
        None, target="DistributedDataParallelConfig.overlap_param_gather", policy="machine"
    )
    """`overlap_param_gather`: the distributed optimizer's all-gather of updated weights overlaps
    the next forward pass (forward pre-hooks); before a checkpoint the weights are gathered
    synchronously. Needs `name: distributed_fused_adam` and `overlap_grad_sync`. null: on with CUDA
    and the distributed optimizer"""

    bucket_cap_mb: float | None = setting(
        None, positive, target="DistributedDataParallelConfig.bucket_size", translate=_bucket_size
    )
    """`bucket_size` = MB x 2^20 / bytes per reduced gradient (4 in fp32, 2 in bf16/fp16); null is
    megatron's max(40M, 1M x DP) parameters. Needs `overlap_grad_sync` (without overlap megatron DDP
    reduces everything in one bucket, so a size would be ignored)"""

    grad_sync_dtype: str | None = setting(
        None,
        one_of(GRAD_SYNC_DTYPES),
        target="DistributedDataParallelConfig.grad_reduce_in_fp32",
        translate=_grad_reduce_in_fp32,
        null_means="`fp32`",
    )
    """`grad_reduce_in_fp32`: `fp32` accumulates and reduces gradients in fp32; `bf16` / `fp16` in
    the model's dtype (half the buffer and traffic), only with the matching `trainer.precision`"""
