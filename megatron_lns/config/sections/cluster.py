"""``cluster``: what SLURM needs to run the job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lns.config.rules import (
    non_negative,
    positive,
    signal_lead_seconds,
)
from megatron_lns.config.settings import setting


@dataclass
class ClusterConfig:
    """What SLURM needs to run the job (``megatron-lns submit``, and ``preprocess
    --submit``, which reads only this section; ``train`` ignores it).

    Key names are NeMo-Launcher's cluster config and NeMo-Run's ``SlurmExecutor``.
    Nodes and tasks are not here: they are ``trainer.num_nodes`` and ``trainer.devices``
    (one task per GPU). docs/cluster.md says how each key reaches the sbatch script.
    """

    partition: str | None = setting(None)
    """`#SBATCH --partition` (null: the cluster's default)"""

    account: str | None = setting(None)
    """`#SBATCH --account`"""

    qos: str | None = setting(None)
    """`#SBATCH --qos`"""

    # Typed Any so that YAML's base-60 reading of an unquoted 4:00:00 (= 14400) reaches
    # config/cluster.py, which refuses it, instead of being sent to SLURM as a number.
    time_limit: Any = setting(None)
    """`#SBATCH --time`, a quoted SLURM time (`"04:00:00"`, `"1-12:00:00"`, `"90"` minutes;
    `"0"` or `"UNLIMITED"`: no limit, as SLURM reads them); unquoted `4:00:00` is refused (YAML
    reads it as 14400)"""

    exclusive: bool = setting(False)
    """`#SBATCH --exclusive`"""

    gpus_per_node: int | None = setting(None, non_negative)
    """`#SBATCH --gpus-per-node`; null: `trainer.devices` with `trainer.accelerator=gpu`, none
    otherwise; must equal `trainer.devices` (or be 0)"""

    cpus_per_task: int | None = setting(None, positive)
    """`--cpus-per-task` for sbatch and srun"""

    mem: str | None = setting(None)
    """`#SBATCH --mem` (`"0"`: all of a node's memory)"""

    job_name_prefix: str = setting("megatron_lns-")
    """job name = prefix + top-level `name` + `-` + `exp_manager.name` + `-` + the submission's time
    stamp (its `slurm/<time>/` folder), unique per submission; names the log files"""

    container_image: str | None = setting(None)
    """pyxis/enroot image for `srun --container-image`; tasks run `python -m
    megatron_lns.launch.task` in it"""

    container_mounts: list[str] = setting(default_factory=list)
    """`srun --container-mounts`, one `src:dst[:flags]` per item; the experiment directory must be
    mounted at its own path"""

    env_vars: dict[str, str] = setting(default_factory=dict)
    """exported before `srun` (NCCL, network) as written: `true`, `1` as YAML spells them, no
    `$` expansion (a value with `$` is refused: set one built from another variable, such as
    `LD_LIBRARY_PATH`, in the shell you submit from; sbatch passes it on); an unquoted float
    (`1.50` reads as 1.5) or null is refused; not the rank variables, which come from SLURM"""

    srun_args: list[str] = setting(default_factory=list)
    """extra `srun` options, one per item; an option the script sets (`--kill-on-bad-exit`, the
    container's) is refused, also abbreviated (`--kill-on=0`)"""

    sbatch_args: list[str] = setting(default_factory=list)
    """extra `#SBATCH` options, one per item (`--constraint=h100`, `--hold`, ...); an option the
    script sets is refused, also abbreviated as sbatch allows (`--no-req` is `--no-requeue`) or
    in a group of short options (`-QN2`); `--array` is refused (its tasks would share one run)"""

    dependency: str | None = setting(None)
    """`#SBATCH --dependency` (`singleton`, `afterok:123`)"""

    preemption_signal_lead_s: int = setting(300, signal_lead_seconds)
    """`#SBATCH --signal=B:USR1@N`: SLURM warns the job N seconds before the time limit; must cover
    one step and one checkpoint save"""

    max_requeues: int = setting(5, non_negative)
    """how often the job may requeue itself, after that warning or to leave out a node that failed
    twice (`SLURM_RESTART_COUNT`)"""

    spare_nodes: int = setting(0, non_negative)
    """nodes allocated beyond `trainer.num_nodes` (`#SBATCH --nodes` is the sum; `srun` runs on
    `trainer.num_nodes`): a node that failed twice in in-job restarts is left out of the next `srun`
    while a spare remains; without one the job requeues itself excluding it"""
