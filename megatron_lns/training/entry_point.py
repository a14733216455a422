"""The training entry point: what ``megatron-lns train`` and every cluster task run.

Loads the config and checks it for a run from this process (``WORLD_SIZE`` of an
external launcher, what this machine offers: CUDA, Transformer Engine), prints the
resolved config once, and runs the :class:`~megatron_lns.training.trainer.Trainer` on
every rank, in the job environment its caller chose (a scheduler's job or a local run).
``megatron-lns compare`` loads, prints and starts its ranks the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_lns.base.third_party_noise import quiet_third_party_noise

if TYPE_CHECKING:
    from megatron_lns.config import ExperimentConfig
    from megatron_lns.runtime.job import JobEnvironment


def train(
    config: str,
    overrides: list[str],
    dry_run: bool = False,
    job: JobEnvironment | None = None,
) -> None:
    """Train from a YAML file or bundled config's name, as part of ``job`` (default: a
    local run); ``dry_run`` prints the resolved config after the checks and trains
    nothing."""
    cfg = load_checked_config(config, overrides, dry_run)
    print_resolved_config(cfg)
    if dry_run:
        return
    run_on_every_rank(cfg, train_job, job, local_launch=in_job_restarts(cfg, job))


def train_job(cfg: ExperimentConfig, job: JobEnvironment | None = None) -> None:
    quiet_third_party_noise()  # again: spawned ranks start with fresh filters
    from megatron_lns.training.trainer import Trainer

    Trainer(cfg, job=job).fit()


def run_on_every_rank(
    cfg: ExperimentConfig,
    job: Callable[..., Any],
    *args: Any,
    multi_node_hint: str = ": `megatron-lns submit` on SLURM, or one process per GPU started by "
    "torchrun or srun",
    local_launch: Callable[..., None] | None = None,
) -> None:
    """Run ``job(cfg, *args)`` on every rank: in-process under torchrun/SLURM or for one
    device, else as ``trainer.devices`` local processes (started by ``local_launch``,
    default ``spawn_local``: no restart). ``multi_node_hint`` ends the refusal of a
    multi-node config started by hand on one node."""
    from megatron_lns.runtime import run_job

    run_job(
        job, cfg.trainer.num_nodes, cfg.trainer.devices, cfg, *args,
        multi_node_hint=multi_node_hint, local_launch=local_launch,
    )  # fmt: skip


def in_job_restarts(cfg: ExperimentConfig, *args: Any) -> Callable[..., None] | None:
    """The launch of local ranks that restarts them in-job after a dead or hung rank, as
    ``exp_manager.fault_tolerance`` allows (None: restarts are off). A restart always
    resumes from the newest complete checkpoint, even where the first start was told
    ``resume_if_exists=false`` (it made the run directory's checkpoints itself)."""
    from megatron_lns.config.sections.exp_manager import rank_restart_limit

    em = cfg.exp_manager
    max_rank_restarts = rank_restart_limit(em)
    if max_rank_restarts == 0:
        return None
    from megatron_lns.config.paths import run_directory
    from megatron_lns.runtime.restarts import RestartPolicy, spawn_with_restarts
    from megatron_lns.training.checkpoint_dirs import newest_checkpoint_step

    policy = RestartPolicy(
        max_rank_restarts,
        em.fault_tolerance.max_restarts_without_progress,
        functools.partial(newest_checkpoint_step, run_directory(cfg) / "checkpoints"),
    )
    resumed = dataclasses.replace(cfg, exp_manager=dataclasses.replace(em, resume_if_exists=True))
    return functools.partial(spawn_with_restarts, policy=policy, restart_args=(resumed, *args))


def load_checked_config(
    config: str, overrides: list[str], dry_run: bool = False
) -> ExperimentConfig:
    """The config of a run from this process: loaded with ``overrides``, validated for
    the launcher's ``WORLD_SIZE`` where one set it and, unless ``dry_run``, checked
    against this machine."""
    from megatron_lns.config import ConfigError, validate
    from megatron_lns.config.layout import world_size
    from megatron_lns.config.sources import load_run_config
    from megatron_lns.runtime.launcher_env import UNSET_HINT, launcher_environment
    from megatron_lns.training.machine import check_environment

    launch = launcher_environment()  # before loading: its refusal is the first thing to fix
    cfg = load_run_config(config, overrides)
    world = None if launch is None else launch.world_size
    if world is not None and world != world_size(cfg.trainer.num_nodes, cfg.trainer.devices):
        raise ConfigError(
            f"WORLD_SIZE={world} from the launcher ({launch.describe()}) differs from "
            f"trainer.num_nodes x trainer.devices = {cfg.trainer.num_nodes} x "
            f"{cfg.trainer.devices}; {UNSET_HINT}"
        )
    validate(cfg, world)
    if not dry_run:
        check_environment(cfg)
    return cfg


def print_resolved_config(cfg: ExperimentConfig) -> None:
    from megatron_lns.config import to_yaml

    if os.environ.get("RANK", "0") == "0":
        print("# resolved config\n" + to_yaml(cfg), flush=True)
