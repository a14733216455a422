"""Device selection and process-group setup; the CPU compatibility layer for megatron-core;
ranks as local processes; a process's exit status."""

from megatron_lns.runtime.cpu import cpu_compat_installed, install_cpu_compat
from megatron_lns.runtime.distributed import (
    ParallelLayout,
    destroy_distributed,
    init_distributed,
    resolve_device,
    uses_gloo,
)
from megatron_lns.runtime.local_ranks import (
    NoMultiNodeLauncher,
    RankFailed,
    RanksTimedOut,
    run_job,
    spawn_local,
)

__all__ = [
    "ParallelLayout",
    "NoMultiNodeLauncher",
    "RankFailed",
    "RanksTimedOut",
    "cpu_compat_installed",
    "destroy_distributed",
    "init_distributed",
    "install_cpu_compat",
    "resolve_device",
    "run_job",
    "spawn_local",
    "uses_gloo",
]
