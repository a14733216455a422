"""The directories a run writes, checked before any process starts.

A run that cannot write its checkpoints or its data caches finds out at the first save
or the first dataset build, after queueing and initialising; here it finds out at
once, with the key that chose the path. Nothing is created: each check writes an
unnamed temporary file in the deepest directory that exists (the one ``mkdir -p``
would write into) and lets it vanish.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from megatron_lns.config.loader import ConfigError
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.data.blend import BUILTIN_PREFIX, DataBlend, cache_dir

# megatron-core's GPTDataset caches its index mappings here, under each data prefix,
# when no path_to_cache (model.data.index_mapping_dir) is given.
MEGATRON_DEFAULT_INDEX_CACHE = Path("cache") / "GPTDataset_indices"


def experiments_directory(cfg: ExperimentConfig) -> Path:
    """``exp_manager.exp_dir``, null meaning ``runs`` (relative: where the command runs)."""
    return Path(cfg.exp_manager.exp_dir or "runs")


def run_directory(cfg: ExperimentConfig) -> Path:
    return experiments_directory(cfg) / cfg.exp_manager.name


def unwritable_reason(directory: Path) -> str | None:
    """Why ``directory`` cannot be created (if missing) and written to, or None."""
    existing = directory
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror or err})"
    return None


def _require_writable(directory: Path, what: str) -> None:
    reason = unwritable_reason(directory)
    if reason:
        raise ConfigError(f"{what} {directory} is not writable: {reason}")


def check_writable_paths(cfg: ExperimentConfig, blend: DataBlend) -> None:
    """The run directory, its ``checkpoints/``, and every data cache the run will fill."""
    run_dir = run_directory(cfg)
    _require_writable(run_dir, "exp_manager.exp_dir / exp_manager.name: run directory")
    _require_writable(run_dir / "checkpoints", "exp_manager.exp_dir: checkpoint directory")
    index_dir = cfg.model.data.index_mapping_dir
    if index_dir:
        _require_writable(Path(index_dir), "model.data.index_mapping_dir:")
    for prefix in blend.prefixes:
        if prefix.startswith(BUILTIN_PREFIX):
            _require_writable(
                cache_dir(),
                f"model.data.data_prefix={prefix} is prepared in the cache "
                "($MEGATRON_LNS_CACHE or ~/.cache/megatron_lns):",
            )
        elif not index_dir:
            _require_writable(
                Path(prefix) / MEGATRON_DEFAULT_INDEX_CACHE,
                "model.data.index_mapping_dir is null, so megatron caches index mappings "
                "next to the data; set it to a writable directory:",
            )
