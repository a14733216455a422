"""Where a run config comes from, and the one function every command loads it with.

A source is a YAML file, a bundled config's name (``llama_130m``), a directory that
holds a run's ``config.yaml`` (a run directory, one of its ``iter_NNNNNNN``
checkpoints, or an ``import-hf`` output), or an already-read mapping. ``train``,
``plan``, ``compare``, ``submit``, ``analyze``, ``import-hf`` and ``export-hf`` all load
through :func:`load_run_config`, so they accept the same sources and report the same errors;
each then validates as its job needs (``validate``, ``check_environment``). The base
configs of ``import-hf --config`` and ``analyze --config``, read as raw YAML to merge
with what an imported model sets, are found through :func:`config_file` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from megatron_lns.config.bundled import resolve_config_path
from megatron_lns.config.loader import ConfigError, load_config
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.submission_layout import SUBMISSIONS_DIR, submission_scripts

# The resolved config a run, each of its checkpoints and an import-hf output keep.
RUN_CONFIG = "config.yaml"


# What runs_inside looks through: a run directory's own parts, never runs themselves.
_NOT_RUNS = ("checkpoints", "tensorboard", SUBMISSIONS_DIR, "logs")
_RUNS_NAMED = 3


def _is_run_dir(path: Path) -> bool:
    """A run directory (or import-hf's output): its ``checkpoints/`` or its config."""
    if path.name.startswith("iter_"):  # a checkpoint holds a config.yaml too
        return False
    return (path / "checkpoints").is_dir() or (path / RUN_CONFIG).is_file()


def runs_inside(directory: str | Path, depth: int = 2) -> list[Path]:
    """The run directories under ``directory`` (an experiment directory: ``exp_dir``
    holding ``<name>/``, or ``<name>/<time>/`` ones), up to ``depth`` levels down, sorted;
    nothing below a run is looked at. A run submitted to SLURM that has not started
    (only its ``slurm/<time>/job.sbatch``) is one."""
    found: list[Path] = []
    level = [Path(directory)]
    for _ in range(depth):
        below = []
        for parent in level:
            try:
                children = sorted(p for p in parent.iterdir() if p.is_dir())
            except OSError:
                continue
            for child in children:
                if child.name.startswith(".") or child.name in _NOT_RUNS:
                    continue
                run = _is_run_dir(child) or bool(submission_scripts(child))
                (found if run else below).append(child)
        level = below
    return sorted(found)


def runs_inside_hint(directory: str | Path) -> str:
    """``; DIR is no run directory but holds the run RUN: give that one`` (or the runs)
    when ``directory``, given where a run directory is expected, holds runs; else ''."""
    runs = runs_inside(directory)
    if not runs:
        return ""
    if len(runs) == 1:
        return f"; {directory} is no run directory but holds the run {runs[0]}: give that one"
    named = ", ".join(map(str, runs[:_RUNS_NAMED]))
    if len(runs) > _RUNS_NAMED:
        named += f" and {len(runs) - _RUNS_NAMED} more"
    return f"; {directory} is no run directory but holds the runs {named}: give one of them"


def config_file(source: str | Path) -> Path:
    """The YAML file ``source`` names: an existing file as given, a directory's
    ``config.yaml``, else a bundled config by name (also when a directory without a
    ``config.yaml`` happens to share that name)."""
    path = Path(source)
    if not path.is_dir():
        return resolve_config_path(path)
    stored = path / RUN_CONFIG
    if stored.is_file():
        return stored
    try:
        return resolve_config_path(path)
    except ConfigError:
        raise ConfigError(
            f"{stored} is missing: the directory does not say its run config (a run "
            f"directory and each of its checkpoints hold one){runs_inside_hint(path)}"
        ) from None


def load_run_config(
    source: str | Path | DictConfig | dict,
    overrides: Sequence[str] = (),
    placeholders: Mapping[str, Any] | None = None,
) -> ExperimentConfig:
    """The typed config of ``source`` with ``overrides`` (``key=value``, ``+key=value``,
    ``~key``) applied; consistency is left to ``validate``. ``placeholders``: values for
    the keys it leaves unset (``???``), as ``load_config`` takes them.

    A directory's ``config.yaml`` was written by a run, not by the user, so its errors
    name the file."""
    filled = dict(placeholders or {})
    if isinstance(source, (DictConfig, dict)):
        return load_config(source, list(overrides), filled)
    path = config_file(source)
    if path != Path(source) / RUN_CONFIG:
        return load_config(path, list(overrides), filled)
    try:
        return load_config(path, list(overrides), filled)
    except ConfigError as err:
        if str(path) in str(err):  # a YAML error names the file already
            raise
        raise ConfigError(f"{path}: {err}") from err
