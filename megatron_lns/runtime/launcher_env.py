"""Who started this process: an external launcher (torchrun, srun) or nobody.

torch.distributed learns its world from ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``. Variables left over from another launch (exported in
a shell, inherited from a job script) used to make a run wait forever for ranks that were
never started, or train one process of a multi-process config without a word. So the
launcher's variables are read in one place, before any process group exists, and a set
that no launcher would produce is refused in one line naming the variables:

* none of them set: megatron-lns starts the ranks itself (``spawn_local``), unless this
  is one of several srun tasks (each would start a run of its own);
* ``RANK`` and ``WORLD_SIZE`` both set, integers, ``0 <= RANK < WORLD_SIZE``; with more
  than one rank also ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a world of
  one may leave them unset: it picks a free local port);
* anything else (one of them alone, a non-integer, a rank outside the world) is refused.

Whether ``WORLD_SIZE`` matches ``trainer.num_nodes x trainer.devices`` is the config's
check (``training.entry_point``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_lns.base.errors import UserError

# Set by every launcher for each rank; RANK and WORLD_SIZE decide that one started us.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
ADDRESS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")
# All of them: what a fresh launch of ours removes from an inherited environment.
LAUNCHER_VARIABLES = RANK_VARIABLES + ADDRESS_VARIABLES
# How to start over without them, for the messages.
UNSET_HINT = (
    "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT to let "
    "megatron-lns start trainer.devices processes itself, or start every rank with "
    "torchrun or srun"
)


class LauncherEnvironmentError(UserError, RuntimeError):
    """The launcher's variables are partial or contradict each other."""


@dataclass(frozen=True)
class LauncherEnvironment:
    """The world an external launcher started this process in."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None

    def describe(self) -> str:
        """The variables as set, for messages: ``RANK=0 WORLD_SIZE=2 ...``."""
        return (
            f"RANK={self.rank} WORLD_SIZE={self.world_size} LOCAL_RANK={self.local_rank} "
            f"MASTER_ADDR={self.master_addr} MASTER_PORT={self.master_port}"
        )


def _shown(env: Mapping[str, str], names: tuple[str, ...]) -> str:
    return " ".join(f"{name}={env[name]!r}" for name in names if name in env)


def _integer(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise LauncherEnvironmentError(
            f"{name}={value!r} in the environment is not an integer; {UNSET_HINT}"
        ) from None


def _check_srun_task(env: Mapping[str, str]) -> None:
    """Without RANK, one of several tasks of an srun step would each start a whole run."""
    tasks = env.get("SLURM_STEP_NUM_TASKS")
    if tasks and tasks.isdigit() and int(tasks) > 1:
        raise LauncherEnvironmentError(
            f"this process is task SLURM_PROCID={env.get('SLURM_PROCID', '?')} of "
            f"SLURM_STEP_NUM_TASKS={tasks} srun tasks, but RANK and WORLD_SIZE are not set: "
            "each task would start a run of its own. Under srun run `python -m "
            "megatron_lns.launch.task CONFIG.yaml` (what `megatron-lns submit` writes), or "
            "srun one task and let it start trainer.devices processes"
        )


def launcher_environment(env: Mapping[str, str] | None = None) -> LauncherEnvironment | None:
    """The launcher's world, None when no launcher set one; refuses an inconsistent set."""
    env = os.environ if env is None else env
    present = [name for name in RANK_VARIABLES if name in env]
    if not present:
        _check_srun_task(env)
        return None
    rank, world = _integer(env, "RANK"), _integer(env, "WORLD_SIZE")
    local_rank, local_world = _integer(env, "LOCAL_RANK"), _integer(env, "LOCAL_WORLD_SIZE")
    port = _integer(env, "MASTER_PORT")
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in env]
    if rank is None or world is None:
        are = "are" if len(missing) > 1 else "is"
        raise LauncherEnvironmentError(
            f"{_shown(env, RANK_VARIABLES)} is set but {' and '.join(missing)} {are} not: a "
            f"partial launcher environment (left over from another launch?); {UNSET_HINT}"
        )
    problem = None
    if world < 1:
        problem = "WORLD_SIZE must be at least 1"
    elif not 0 <= rank < world:
        problem = "RANK must be in 0..WORLD_SIZE-1"
    elif local_rank is not None and not 0 <= local_rank <= rank:
        problem = "LOCAL_RANK must be in 0..RANK"
    elif local_world is not None and not 0 < local_world <= world:
        problem = "LOCAL_WORLD_SIZE must be in 1..WORLD_SIZE"
    elif local_world is not None and local_rank is not None and local_rank >= local_world:
        problem = "LOCAL_RANK must be below LOCAL_WORLD_SIZE"
    elif port is not None and not 0 < port < 2**16:
        problem = "MASTER_PORT must be in 1..65535"
    elif world > 1 and (unset := [n for n in ("LOCAL_RANK", *ADDRESS_VARIABLES) if not env.get(n)]):
        problem = (
            f"a world of {world} ranks also needs {', '.join(unset)} (every launcher sets "
            "them; without them the ranks cannot find each other)"
        )
    if problem:
        shown = _shown(env, LAUNCHER_VARIABLES)
        raise LauncherEnvironmentError(f"{shown}: {problem}; {UNSET_HINT}")
    return LauncherEnvironment(
        rank=rank,
        world_size=world,
        local_rank=local_rank or 0,
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=port,
    )
