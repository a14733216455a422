"""Device selection and process-group setup; the CPU compatibility layer for megatron-core;
ranks as local processes; the job a run belongs to (:mod:`.job`).

The names below load on first use: :mod:`.job` is torch-free and imported on login nodes
(``submit``), where importing torch for the rest would cost seconds.
"""

from importlib import import_module

_HOMES = {
    "cpu_compat_installed": "cpu",
    "install_cpu_compat": "cpu",
    "ParallelLayout": "distributed",
    "destroy_distributed": "distributed",
    "init_distributed": "distributed",
    "resolve_device": "distributed",
    "uses_gloo": "distributed",
    "NoMultiNodeLauncher": "local_ranks",
    "RankFailed": "local_ranks",
    "RanksTimedOut": "local_ranks",
    "run_job": "local_ranks",
    "spawn_local": "local_ranks",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
