"""The sbatch script of a training job, rendered from ``slurm/sbatch.template``.

Every value from the config reaches the script in one of two places, each with its own
rule:

- an ``#SBATCH`` line, which sbatch splits on white space and reads without a shell:
  only characters that need no quoting there are accepted;
- the script body, which bash runs: values are quoted with :func:`shlex.quote`.

Control characters (newlines, NUL, ...) are refused everywhere: a newline would end
an ``#SBATCH`` line and start a new one. Refusals are :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from megatron_lns.base.errors import HUNG_EXIT_CODE, USER_ERROR_EXIT_CODE
from megatron_lns.cluster.slurm.options import (
    SBATCH_LONG_OPTIONS,
    SBATCH_SHORT_OPTIONS,
    SRUN_LONG_OPTIONS,
    SRUN_SHORT_OPTIONS,
    long_option_meanings,
    option_names,
)
from megatron_lns.cluster.slurm.progress import RUN_PROGRESS_FILE
from megatron_lns.config import ConfigError, ExperimentConfig
from megatron_lns.config.cluster import job_name
from megatron_lns.config.sections.cluster import ClusterConfig
from megatron_lns.config.sections.exp_manager import rank_restart_limit
from megatron_lns.training.run_status import RUN_STATUS_FILE

# slurm/ at the top of the repository, inside the package through the megatron_lns/slurm
# link (package data), so an installed wheel renders the same script as a checkout.
TEMPLATE = Path(str(resources.files("megatron_lns") / "slurm" / "sbatch.template"))
# What each task runs: a fixed path (megatron_lns/launch/task.py), since written scripts
# outlive upgrades (requeues, `sbatch job.sbatch` by hand).
TASK_MODULE = "megatron_lns.launch.task"

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# What sbatch reads literally on an #SBATCH line: no white space, quotes, backslashes
# or '%' (a file-name pattern character in --output).
_DIRECTIVE_SAFE = re.compile(r"^[A-Za-z0-9_.,:=+@/?&|!*\[\]-]+$")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")

# sbatch / srun options the script sets itself, with the key that controls each;
# the same option in cluster.sbatch_args / srun_args would contradict it, spelt in full
# or abbreviated (options.py). Both commands are given the job's tasks.


def task_options(nodes: str, per_node: str, total: str) -> dict[str, str]:
    """The options that give a job or step its tasks, with what sets each."""
    return {
        "--nodes": nodes,
        "-N": nodes,
        "--ntasks-per-node": per_node,
        "--tasks-per-node": per_node,
        "--ntasks": total,
        "-n": total,
    }


# Set from the cluster: keys in every batch script (cluster_directives).
CLUSTER_SBATCH_OPTIONS = {
    "--open-mode": "the job log, appended across requeues",
    "--requeue": "cluster.max_requeues",
    "--no-requeue": "cluster.max_requeues",
    "--partition": "cluster.partition",
    "-p": "cluster.partition",
    "--account": "cluster.account",
    "-A": "cluster.account",
    "--qos": "cluster.qos",
    "-q": "cluster.qos",
    "--time": "cluster.time_limit",
    "-t": "cluster.time_limit",
    "--exclusive": "cluster.exclusive",
    "--cpus-per-task": "cluster.cpus_per_task",
    "-c": "cluster.cpus_per_task",
    "--mem": "cluster.mem",
    "--dependency": "cluster.dependency",
    "-d": "cluster.dependency",
    "--chdir": "the submit directory",
    "-D": "the submit directory",
}
# Set on every srun that runs megatron-lns (container_words).
CLUSTER_SRUN_OPTIONS = {
    "--cpus-per-task": "cluster.cpus_per_task",
    "-c": "cluster.cpus_per_task",
    "--container-image": "cluster.container_image",
    "--container-mounts": "cluster.container_mounts",
    "--container-workdir": "the submit directory",
    "--no-container-mount-home": "the script (keeps ~/.local out of the image)",
    "--container-mount-home": "the script (keeps ~/.local out of the image)",
}


def named_and_logged(job_name_from: str, logs_from: str) -> dict[str, str]:
    """The job name and log options of a batch script, with what sets each."""
    return {
        "--job-name": job_name_from,
        "-J": job_name_from,
        "--output": logs_from,
        "-o": logs_from,
        "--error": logs_from,
        "-e": logs_from,
    }


_OWN_TASK_OPTIONS = task_options(
    "trainer.num_nodes", "trainer.devices", "trainer.num_nodes x trainer.devices"
)
_OWN_SBATCH_OPTIONS = {
    **named_and_logged("cluster.job_name_prefix and name", "exp_manager.exp_dir (logs/)"),
    **_OWN_TASK_OPTIONS,
    **CLUSTER_SBATCH_OPTIONS,
    "--signal": "cluster.preemption_signal_lead_s",
    "--gpus-per-node": "cluster.gpus_per_node",
}
_OWN_SRUN_OPTIONS = {
    "--kill-on-bad-exit": "the script (a failed rank ends the job step)",
    "-K": "the script (a failed rank ends the job step)",
    "--exclude": "the script (nodes that failed twice; cluster.sbatch_args for the job's)",
    "-x": "the script (nodes that failed twice; cluster.sbatch_args for the job's)",
    **_OWN_TASK_OPTIONS,
    **CLUSTER_SRUN_OPTIONS,
}


@dataclass(frozen=True)
class JobPaths:
    """Where a submitted job keeps its files (all absolute)."""

    workdir: Path  # the job runs here, so relative paths in the config mean the same
    run_dir: Path  # <exp_dir>/<exp_manager.name>: checkpoints, metrics, run_status
    config: Path  # the resolved config every task loads

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def submission(self) -> str:
        """The submission's time stamp: its folder under slurm/, part of the job name."""
        return self.config.parent.name


def _no_control(key: str, value: str) -> str:
    if _CONTROL.search(value):
        raise ConfigError(
            f"{key}={value!r} contains a control character (newline, NUL, ...), which "
            "cannot be written safely into the batch script"
        )
    return value


def quote(key: str, value: object) -> str:
    """A value for the script body: one shell word that bash reads back unchanged."""
    return shlex.quote(_no_control(key, str(value)))


def directive_text(key: str, value: object) -> str:
    """A value for an ``#SBATCH`` line, which sbatch reads literally."""
    text = _no_control(key, str(value))
    if not _DIRECTIVE_SAFE.match(text):
        raise ConfigError(
            f"{key}={text!r} cannot be written on an #SBATCH line (allowed: letters, "
            "digits and _.,:=+@/?&|!*[]-; no spaces, quotes, '$' or '%')"
        )
    return text


def directive(key: str, option: str, value: object) -> str:
    return f"#SBATCH {option}={directive_text(key, value)}"


# sbatch options no job of this package can take, with why.
REFUSED_SBATCH_OPTIONS = {
    "--array": "the tasks of a job array would share one run directory (and its lock, "
    "run_status and checkpoints); submit one job per run",
    "-a": "the tasks of a job array would share one run directory (and its lock, "
    "run_status and checkpoints); submit one job per run",
}


def check_not_own(
    key: str,
    args: list[str],
    own: dict[str, str],
    known: frozenset[str],
    short: str,
    refused: dict[str, str] | None = None,
) -> None:
    """Refuse an option the script sets itself, in full or abbreviated: SLURM reads
    ``--no-req`` as ``--no-requeue``, ``-QN2`` as ``-Q -N 2``. An ambiguous prefix that
    could mean one of them is refused too (it means that option under a SLURM without
    the other candidates). Options in ``refused`` are refused with their reason."""
    refused = refused or {}
    for arg in args:
        for place, name in enumerate(option_names(arg, short)):
            meanings = long_option_meanings(name, known) if name.startswith("--") else [name]
            managed = [meaning for meaning in meanings if meaning in own or meaning in refused]
            if not managed:
                continue
            full = managed[0]
            why = f"set from {own[full]}" if full in own else refused[full]
            if len(meanings) > 1:
                raise ConfigError(
                    f"{key}: {arg!r} is ambiguous ({', '.join(meanings)}) and may mean "
                    f"{full}, {why}: write the option in full"
                )
            if full != name:
                spelt = f"{arg!r} (an abbreviation of {full})"
            elif place:
                spelt = f"{arg!r} ({name} in a group of short options)"
            else:
                spelt = f"{arg!r}"
            if full in refused:
                raise ConfigError(f"{key}: {spelt} is refused: {why}")
            raise ConfigError(f"{key}: {spelt} conflicts with {full}, {why}")


def same_path_mount(mounts: list[str], path: Path) -> bool:
    """Whether ``path`` is visible at the same path inside the container."""
    for mount in mounts:
        parts = mount.split(":")
        src, dst = parts[0], parts[1] if len(parts) > 1 else parts[0]
        if src == dst and path.is_relative_to(dst):
            return True
    return False


def unmounted_workdir_warning(cfg: ExperimentConfig, paths: JobPaths) -> str | None:
    """Why the tasks will not start in the submit directory, if they will not: pyxis
    gets ``--container-workdir`` only for a directory mounted at its own path, so
    relative paths in the config then mean something else inside the container."""
    c = cfg.cluster
    if not c.container_image or same_path_mount(c.container_mounts, paths.workdir):
        return None
    mounts = ", ".join(c.container_mounts) or "none"
    return (
        f"the submit directory {paths.workdir} is not mounted at its own path in the "
        f"container (cluster.container_mounts: {mounts}): the tasks start in the image's "
        "working directory, where relative paths in the config do not lead"
    )


def sbatch_directives(cfg: ExperimentConfig, paths: JobPaths) -> list[str]:
    c, t = cfg.cluster, cfg.trainer
    gpus = (
        c.gpus_per_node
        if c.gpus_per_node is not None
        else (t.devices if t.accelerator == "gpu" else 0)
    )
    lines = [
        directive("cluster.job_name_prefix + name", "--job-name", job_name(cfg, paths.submission)),
        directive("trainer.num_nodes + cluster.spare_nodes", "--nodes", allocated_nodes(cfg)),
        directive("trainer.devices", "--ntasks-per-node", t.devices),
        *log_directives("exp_manager.exp_dir", paths.log_dir),
        directive(
            "cluster.preemption_signal_lead_s", "--signal", f"B:USR1@{c.preemption_signal_lead_s}"
        ),
    ]
    lines += cluster_directives(c, gpus_per_node=gpus or None)
    return lines + extra_directives(c, _OWN_SBATCH_OPTIONS)


def allocated_nodes(cfg: ExperimentConfig) -> int:
    """The job's nodes: the run's, and the spares that replace a node that keeps failing."""
    return cfg.trainer.num_nodes + cfg.cluster.spare_nodes


def log_directives(key: str, log_dir: Path) -> list[str]:
    """One log per job (%x: job name, %j: job id), appended to by each requeue."""
    return [
        f"#SBATCH --output={directive_text(key, log_dir)}/%x-%j.log",
        "#SBATCH --open-mode=append",
    ]


def cluster_directives(c: ClusterConfig, gpus_per_node: int | None = None) -> list[str]:
    """The ``#SBATCH`` lines of the cluster: keys that every job takes as they are."""
    lines = ["#SBATCH --requeue"] if c.max_requeues > 0 else []
    optional = [
        ("cluster.partition", "--partition", c.partition),
        ("cluster.account", "--account", c.account),
        ("cluster.qos", "--qos", c.qos),
        ("cluster.time_limit", "--time", c.time_limit),
        ("cluster.gpus_per_node", "--gpus-per-node", gpus_per_node),
        ("cluster.cpus_per_task", "--cpus-per-task", c.cpus_per_task),
        ("cluster.mem", "--mem", c.mem),
        ("cluster.dependency", "--dependency", c.dependency),
    ]
    lines += [directive(key, opt, value) for key, opt, value in optional if value is not None]
    if c.exclusive:
        lines.append("#SBATCH --exclusive")
    return lines


def extra_directives(c: ClusterConfig, own: dict[str, str]) -> list[str]:
    """cluster.sbatch_args as ``#SBATCH`` lines, none of them an option in ``own``."""
    check_not_own(
        "cluster.sbatch_args",
        c.sbatch_args,
        own,
        SBATCH_LONG_OPTIONS,
        SBATCH_SHORT_OPTIONS,
        REFUSED_SBATCH_OPTIONS,
    )
    return [f"#SBATCH {directive_text('cluster.sbatch_args', arg)}" for arg in c.sbatch_args]


def container_words(c: ClusterConfig, workdir: Path) -> list[str]:
    """srun's options for ``cluster.cpus_per_task`` and the container, quoted."""
    words = []
    if c.cpus_per_task is not None:
        # srun of SLURM 22.05 to 23.02 does not inherit sbatch's --cpus-per-task.
        words.append(f"--cpus-per-task={c.cpus_per_task}")
    if c.container_image:
        words.append("--container-image=" + quote("cluster.container_image", c.container_image))
        # pyxis mounts the home directory by default: ~/.local's packages would then shadow
        # the image's (NeMo's launchers pass the same option).
        words.append("--no-container-mount-home")
        if c.container_mounts:
            if any("," in mount for mount in c.container_mounts):
                raise ConfigError(
                    "cluster.container_mounts: one mount per item, without commas "
                    f"(got {c.container_mounts})"
                )
            mounts = ",".join(c.container_mounts)
            words.append("--container-mounts=" + quote("cluster.container_mounts", mounts))
        if same_path_mount(c.container_mounts, workdir):
            words.append("--container-workdir=" + quote("submit directory", workdir))
    return words


def extra_srun_words(c: ClusterConfig, own: dict[str, str]) -> list[str]:
    """cluster.srun_args, quoted, none of them an option in ``own``."""
    check_not_own("cluster.srun_args", c.srun_args, own, SRUN_LONG_OPTIONS, SRUN_SHORT_OPTIONS)
    return [quote("cluster.srun_args", arg) for arg in c.srun_args]


# The nodes the batch script leaves out of the next srun (a comma list, empty at first):
# one word, or none at all while the list is empty.
EXCLUDE_WORD = '${excluded_nodes:+"--exclude=$excluded_nodes"}'


def srun_command(cfg: ExperimentConfig, paths: JobPaths, python: str) -> str:
    t = cfg.trainer
    words = [
        "srun",
        "--kill-on-bad-exit=1",
        f"--nodes={t.num_nodes}",
        f"--ntasks-per-node={t.devices}",
    ]
    if cfg.cluster.spare_nodes:
        # srun reads the job's task count (SLURM_NTASKS: spares included) unless given its own.
        words.append(f"--ntasks={t.num_nodes * t.devices}")
    words += [
        *container_words(cfg.cluster, paths.workdir),
        *extra_srun_words(cfg.cluster, _OWN_SRUN_OPTIONS),
        EXCLUDE_WORD,
    ]
    command = [
        quote("python", python),
        "-u",
        "-m",
        TASK_MODULE,
        quote("resolved config", paths.config),
    ]
    return wrap_command(words, command)


def wrap_command(options: list[str], command: list[str]) -> str:
    """Options one per line, the command itself on the last line."""
    return " \\\n    ".join([*options, " ".join(command)])


def env_exports(c: ClusterConfig) -> str:
    exports = [
        f"export {name}={quote(f'cluster.env_vars.{name}', value)}"
        for name, value in c.env_vars.items()
    ]
    return "\n".join(exports) if exports else "# (no cluster.env_vars)"


def rank_restart_values(cfg: ExperimentConfig) -> dict[str, str]:
    """The batch script's in-job restarts after a rank died or hung (docs/cluster.md):
    none when ``exp_manager.create_fault_tolerance_callback`` is off."""
    return {
        "max_rank_restarts": str(rank_restart_limit(cfg.exp_manager)),
        "max_restarts_without_progress": str(
            cfg.exp_manager.fault_tolerance.max_restarts_without_progress
        ),
        "spare_nodes": str(cfg.cluster.spare_nodes),
        "user_error_code": str(USER_ERROR_EXIT_CODE),
        "hung_exit_code": str(HUNG_EXIT_CODE),
    }


def render_sbatch(cfg: ExperimentConfig, paths: JobPaths, python: str) -> str:
    """The batch script for ``cfg`` (validated, with an absolute exp_manager.exp_dir).

    ``python`` runs each task (the submitting interpreter; ``python`` in a container).
    """
    c = cfg.cluster
    if c.container_image and not same_path_mount(c.container_mounts, paths.run_dir):
        raise ConfigError(
            f"exp_manager.exp_dir: {paths.run_dir} must be mounted at the same path in the "
            f"container (the batch script reads run_status there): add '{paths.run_dir}:"
            f"{paths.run_dir}' or a parent to cluster.container_mounts"
        )
    values = {
        "job_name": job_name(cfg, paths.submission),
        "sbatch_directives": "\n".join(sbatch_directives(cfg, paths)),
        "workdir": quote("submit directory", paths.workdir),
        "log_dir": quote("exp_manager.exp_dir", paths.log_dir),
        "status_file": quote("exp_manager.exp_dir", paths.run_dir / RUN_STATUS_FILE),
        "progress_file": quote("exp_manager.exp_dir", paths.run_dir / RUN_PROGRESS_FILE),
        "checkpoint_dir": quote("exp_manager.exp_dir", paths.run_dir / "checkpoints"),
        "max_requeues": str(c.max_requeues),
        **rank_restart_values(cfg),
        "lead_s": str(c.preemption_signal_lead_s),
        "exit_interval": str(cfg.trainer.exit_interval or 0),
        "env_exports": env_exports(c),
        "srun_command": srun_command(cfg, paths, python),
    }
    return fill_template(TEMPLATE, values)


def fill_template(template: Path, values: dict[str, str]) -> str:
    """``template`` with each ``{{name}}`` replaced by ``values[name]``; every name used
    and no other (a mismatch is this package's bug, not the user's)."""
    text = template.read_text()
    used = set(_PLACEHOLDER.findall(text))
    if used != set(values):
        raise RuntimeError(f"{template} placeholders {sorted(used)} != {sorted(values)}")
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], text)
