"""``exp_manager``: where a run lives, how it resumes and checkpoints, what it logs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_lns.config.rules import (
    non_empty,
    positive,
)
from megatron_lns.config.sections.fault_tolerance import (
    FaultToleranceParams,
    StragglerDetectionParams,
)
from megatron_lns.config.settings import setting


@dataclass
class CheckpointCallbackParams:
    every_n_train_steps: int = setting(1000, positive)
    """checkpoint interval (`dist_checkpointing`, torch_dist format)"""

    save_last: bool = setting(True)
    """also checkpoint at the end of training"""

    async_save: bool = setting(False)
    """write checkpoints in the background: megatron-core's asynchronous `dist_checkpointing.save`
    (its `AsyncCallsQueue`; Megatron-LM's `--async-save`). A save stalls training only while the
    state is taken (copied to host memory on GPU; a `fork` on CPU); each rank's shards are written
    by a process it forks, and the checkpoint counts (`complete.json`, `iter_N.partial` renamed to
    `iter_N`) only once every rank has finished. The run waits for a pending save before the next
    one and before it stops or ends. Host memory holds one more copy of the rank's state while a
    save is written. See [resuming.md](resuming.md#asynchronous-and-parallel-saves)"""


@dataclass
class ExpManagerConfig:
    exp_dir: str | None = setting(None, null_means="`runs`")
    """root of experiment directories"""

    name: str = setting("megatron_gpt", non_empty)
    """run directory `<exp_dir>/<name>/` with `config.yaml`, `metrics.jsonl`, `tensorboard/`,
    `checkpoints/` (`metrics.jsonl`: every step's loss, the full metrics every
    `log_every_n_steps`)"""

    resume_if_exists: bool = setting(True)
    """resume from the newest **complete** checkpoint in `checkpoints/` (partial saves are never
    picked); false refuses a directory that already holds a run (see [resuming.md](resuming.md))"""

    resume_from_checkpoint: str | None = setting(None)
    """an `iter_NNNNNNN` checkpoint directory to resume from instead of the newest; once: a rerun of
    the same command continues the branch it started (see [resuming.md](resuming.md))"""

    resume_past_unreadable: bool = setting(False)
    """not in NeMo: if the newest complete checkpoint cannot be read, resume from the newest one
    that can"""

    override_opt_param_scheduler: bool = setting(False)
    """not in NeMo: Megatron-LM's `--override-opt_param-scheduler`; resume with this config's LR
    schedule and weight decay instead of refusing a changed one"""

    resume_with_changed_data: bool = setting(False)
    """not in NeMo: resume although the token files of a `model.data.data_prefix` entry are not
    those the checkpoint was trained on (other documents preprocessed into the same prefix),
    instead of refusing; one line names the changed prefixes (see
    [resuming.md](resuming.md#changed-data))"""

    create_tensorboard_logger: bool = setting(True)
    """TensorBoard scalars under `tensorboard/`"""

    create_wandb_logger: bool = setting(False)
    """Weights & Biases, if `wandb` is installed (a message says so if not)"""

    wandb_logger_kwargs: dict[str, Any] = setting(default_factory=dict)
    """passed to `wandb.init` (`project`, `name`, ...)"""

    checkpoint_callback_params: CheckpointCallbackParams = field(
        default_factory=CheckpointCallbackParams
    )
    create_fault_tolerance_callback: bool = setting(True)
    """watch every rank for hangs (heartbeats through start-up, checkpoint load, steps, evaluation
    and saves, with the timeouts of `fault_tolerance`) and restart the ranks in-job after a hang or
    a dead rank (see [resilience.md](resilience.md)); NeMo's switch, on here by default"""

    fault_tolerance: FaultToleranceParams = field(default_factory=FaultToleranceParams)
    create_straggler_detection_callback: bool = setting(True)
    """compare the ranks' compute time per step and name the slow ones with their hosts (log,
    TensorBoard, the end of each attempt); NeMo's switch, on here by default"""

    straggler_detection_params: StragglerDetectionParams = field(
        default_factory=StragglerDetectionParams
    )


def rank_restart_limit(exp_manager: ExpManagerConfig) -> int:
    """How often a run's ranks may restart in-job, the same for local runs and the batch
    script's srun loop: none without the fault-tolerance callback."""
    if not exp_manager.create_fault_tolerance_callback:
        return 0
    return exp_manager.fault_tolerance.max_rank_restarts
