"""Device selection and process-group setup; the CPU compatibility layer for megatron-core;
ranks as local processes; the launcher's environment.

The names below are imported on first use: ``runtime.launcher_env`` is read by dry runs on
login nodes, which must not pay for importing torch (tests/config/test_light_imports.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES = {
    "cpu": ("cpu_compat_installed", "install_cpu_compat"),
    "distributed": (
        "ParallelLayout",
        "destroy_distributed",
        "init_distributed",
        "resolve_device",
        "uses_gloo",
    ),
    "local_ranks": ("NoMultiNodeLauncher", "RankFailed", "RanksTimedOut", "run_job", "spawn_local"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = [
    "NoMultiNodeLauncher",
    "ParallelLayout",
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


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
