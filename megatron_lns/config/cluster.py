"""Checks of the ``cluster:`` section (what ``megatron-lns submit`` hands to SLURM).

Each failure is a :class:`ConfigError` naming the key. What the sbatch renderer can
write safely (no control characters, nothing shell-active on an ``#SBATCH`` line) is
checked where the script is rendered, in ``megatron_lns.cluster.slurm.render``.
"""

from __future__ import annotations

import re

from megatron_lns.config.loader import ConfigError
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.sections.cluster import ClusterConfig

# SLURM accepts: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.:+-]+$")
# Set per task from SLURM's variables (megatron_lns.cluster.slurm.rank_env); a fixed value
# in env_vars would give every rank the same one.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def time_limit_seconds(value: str) -> int | None:
    """Seconds in a SLURM time string; None for no limit: UNLIMITED / INFINITE, or zero
    (``0``, ``0:00``, ...), which SLURM reads as no limit."""
    seconds = _time_seconds(value)
    return seconds or None


def _time_seconds(value: str) -> int | None:
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME.match(value)
    if not match:
        raise ValueError(value)
    d, dh, dm, ds, m, ms, s = (int(g) if g else 0 for g in match.groups())
    if match.group(1) is not None:  # days-hours[:minutes[:seconds]]
        return ((d * 24 + dh) * 60 + dm) * 60 + ds
    if match.group(7) is not None:  # hours:minutes:seconds
        return (m * 60 + ms) * 60 + s
    return m * 60 + ms  # minutes[:seconds]


def job_name(cfg: ExperimentConfig, submission: str = "") -> str:
    """prefix + config name + run name (exp_manager.name) + the submission's time stamp.

    Unique per submission, as NeMo-Run's names are, so ``squeue`` and ``sacct`` tell the
    runs of one config apart; the stamp also names the run's ``slurm/<stamp>/`` folder
    that holds the job's script. ``submission`` is empty where only the characters are
    checked (validation, before a stamp exists)."""
    parts = [cfg.cluster.job_name_prefix + cfg.name, cfg.exp_manager.name, submission]
    return "-".join(part for part in parts if part)


def validate_cluster(cfg: ExperimentConfig) -> None:
    c, t = cfg.cluster, cfg.trainer
    limit = validate_cluster_settings(c)
    if limit is not None and limit <= c.preemption_signal_lead_s:
        raise ConfigError(
            f"cluster.preemption_signal_lead_s ({c.preemption_signal_lead_s}) must be "
            f"shorter than cluster.time_limit ({c.time_limit} = {limit} s)"
        )
    if c.gpus_per_node is not None:
        if t.accelerator == "cpu" and c.gpus_per_node:
            raise ConfigError(
                f"cluster.gpus_per_node={c.gpus_per_node} but trainer.accelerator=cpu"
            )
        if t.accelerator == "gpu" and c.gpus_per_node != t.devices:
            raise ConfigError(
                f"cluster.gpus_per_node ({c.gpus_per_node}) differs from trainer.devices "
                f"({t.devices}): megatron-lns runs one task per GPU"
            )
        if t.accelerator == "auto" and c.gpus_per_node not in (0, t.devices):
            raise ConfigError(
                f"cluster.gpus_per_node ({c.gpus_per_node}) must be 0 or trainer.devices "
                f"({t.devices}): megatron-lns runs one task per GPU"
            )
    if not _JOB_NAME.match(job_name(cfg)):
        raise ConfigError(
            f"cluster.job_name_prefix + name + exp_manager.name = {job_name(cfg)!r}: a job "
            "name may hold only "
            "letters, digits and _.:+- (it names the log files)"
        )


def validate_cluster_settings(c: ClusterConfig) -> int | None:
    """The checks of the keys every job takes as they are (training's and
    preprocessing's); the time limit in seconds (None: none or unlimited)."""
    limit = None
    if c.time_limit is not None:
        if not isinstance(c.time_limit, str):
            raise ConfigError(
                f"cluster.time_limit={c.time_limit!r} must be a quoted string such as "
                '"04:00:00" or "1-12:00:00" (YAML reads an unquoted 4:00:00 as the number '
                "14400)"
            )
        try:
            limit = time_limit_seconds(c.time_limit)
        except ValueError:
            raise ConfigError(
                f"cluster.time_limit={c.time_limit!r} is not a SLURM time (minutes, M:S, "
                "H:M:S, D-H, D-H:M or D-H:M:S)"
            ) from None
    if c.mem is not None and not _MEM.match(c.mem):
        raise ConfigError(f"cluster.mem={c.mem!r} is not a SLURM size such as 0, 500G or 64000M")
    if c.container_mounts and not c.container_image:
        raise ConfigError("cluster.container_mounts needs cluster.container_image")
    for name, value in c.env_vars.items():
        if not _ENV_NAME.match(name):
            raise ConfigError(f"cluster.env_vars: {name!r} is not an environment variable name")
        if "$" in str(value):
            raise ConfigError(
                f"cluster.env_vars.{name}={value!r}: '$' would not expand (values are exported "
                "as written); set a value built from another variable in the shell you submit "
                "from (sbatch passes its environment on) or in the container image"
            )
        if name in RANK_VARIABLES:
            raise ConfigError(
                f"cluster.env_vars.{name}: set per task from SLURM's environment "
                "(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST, SLURM_JOB_ID)"
            )
    for key, args in (("cluster.srun_args", c.srun_args), ("cluster.sbatch_args", c.sbatch_args)):
        for arg in args:
            if not str(arg).startswith("-"):
                raise ConfigError(f"{key}: {arg!r} is not an option (one option per item)")
    return limit


def valid_job_name(name: str) -> bool:
    """Whether SLURM takes ``name`` as is and it can name log files."""
    return bool(_JOB_NAME.match(name))
