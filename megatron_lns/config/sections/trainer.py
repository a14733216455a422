"""``trainer``: how long and on what the run trains, and how it reports (NeMo's Lightning
trainer keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lns.config.rules import (
    non_negative,
    one_of,
    positive,
)
from megatron_lns.config.settings import setting, to

# The NeMo spellings a value may take, and what each means in megatron-core terms. The
# build (build.py) translates through these maps; validation checks
# values against their keys.
PRECISIONS = {
    "32": "fp32",
    "32-true": "fp32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "16": "fp16",
    "16-mixed": "fp16",
}


ACCELERATORS = {"auto": "auto", "cpu": "cpu", "gpu": "cuda"}


def _clip_grad(value: Any, cfg: Any) -> dict[str, Any]:
    return {"clip_grad": float(value or 0.0)}


@dataclass
class TrainerConfig:
    num_nodes: int = setting(1, positive)
    """nodes; world size = `num_nodes x devices` (must equal the launcher's `WORLD_SIZE`)"""

    devices: int = setting(1, positive)
    """processes per node (GPUs, or CPU ranks with gloo); on one node megatron-lns spawns them
    itself"""

    accelerator: str = setting("auto", one_of(ACCELERATORS))
    """`gpu` (NCCL), `cpu` (gloo + the CPU compatibility layer) or `auto`"""

    max_steps: int = setting(1000, positive)
    """optimizer steps; also the length of the lr schedule"""

    val_check_interval: int = setting(100, positive)
    """validate every N steps (and at the end)"""

    limit_val_batches: int = setting(10, non_negative)
    """global batches of the validation split per validation (always the same ones); 0 disables
    validation"""

    log_every_n_steps: int = setting(10, positive)
    """console / TensorBoard / `metrics.jsonl` interval"""

    precision: str = setting(
        "bf16-mixed",
        one_of(PRECISIONS),
        target="TransformerConfig.params_dtype",
        translate=to("precision", PRECISIONS),
        resume="optimizer",
    )
    """`bf16-mixed`/`bf16`: `TransformerConfig.bf16` + `Float16Module` + megatron's mixed-precision
    optimizer with fp32 main weights; `16-mixed`/`16`: the same in fp16 with dynamic loss scaling;
    `32`: fp32"""

    gradient_clip_val: float = setting(
        1.0, non_negative, target="OptimizerConfig.clip_grad", translate=_clip_grad
    )
    """`OptimizerConfig.clip_grad` (global-norm clipping across all model-parallel ranks); 0
    disables"""

    rendezvous_timeout_s: float = setting(600.0, positive)
    """not in NeMo: seconds each rank waits at start-up for the others to join rank 0's TCP store
    (`MASTER_ADDR:MASTER_PORT`) before it ends naming whom it waited for; SIGTERM or Ctrl-C during
    the wait ends it at once. Collectives keep torch's timeouts"""

    distributed_timeout_minutes: float = setting(10.0, positive)
    """not in NeMo: Megatron-LM's `--distributed-timeout-minutes`, the process groups' timeout: a
    collective that waits longer raises. The hang watchdog (`exp_manager.fault_tolerance`) usually
    acts first"""

    exit_interval: int | None = setting(None, positive)
    """not in NeMo: Megatron-LM's `--exit-interval`, checkpoint and exit when the step is a multiple
    of it"""
