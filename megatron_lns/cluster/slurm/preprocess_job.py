"""The SLURM job of ``megatron-lns preprocess ... --submit``: its batch script, rendered
from ``slurm/preprocess.sbatch.template``, and its files beside the output.

The ``cluster:`` keys reach the script through the same functions, checks and quoting
as a training job's (:mod:`.render`). The script runs three job steps of ``preprocess``
with the same arguments (plan, one task per node, merge; the template says why), so
everything it needs is on the command line: the paths are made absolute at submit time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.cluster.slurm.render import (
    CLUSTER_SBATCH_OPTIONS,
    CLUSTER_SRUN_OPTIONS,
    TEMPLATE,
    cluster_directives,
    container_words,
    directive,
    env_exports,
    extra_directives,
    extra_srun_words,
    fill_template,
    log_directives,
    named_and_logged,
    quote,
    same_path_mount,
    task_options,
    wrap_command,
)
from megatron_lns.config import ConfigError
from megatron_lns.config.cluster import valid_job_name
from megatron_lns.config.sections.cluster import ClusterConfig
from megatron_lns.config.submission_layout import SCRIPT_FILE, SUBMISSIONS_DIR
from megatron_lns.data.output_files import parts_directory

PREPROCESS_TEMPLATE = TEMPLATE.with_name("preprocess.sbatch.template")
# The public command line: written scripts outlive upgrades, and it stays the same.
CLI_MODULE = "megatron_lns.cli"

_TASKS = task_options(
    "preprocess --nodes", "the script (one task per node)", "preprocess --nodes (one per node)"
)
_OWN_SBATCH_OPTIONS = {
    **named_and_logged(
        "cluster.job_name_prefix and the output prefix",
        "the output prefix (PREFIX.parts/slurm/logs/)",
    ),
    **_TASKS,
    **CLUSTER_SBATCH_OPTIONS,
}
_OWN_SRUN_OPTIONS = {
    "--kill-on-bad-exit": "the script (the other tasks finish their units)",
    "-K": "the script (the other tasks finish their units)",
    **_TASKS,
    **CLUSTER_SRUN_OPTIONS,
}


@dataclass(frozen=True)
class PreprocessJob:
    """One submission of ``preprocess``: what runs where, and where its files go."""

    cluster: ClusterConfig
    nodes: int
    arguments: tuple[str, ...]  # preprocess's, for every step (absolute paths)
    output_prefix: Path  # absolute
    # The directories a container must see at the same path, each with its flag.
    read_and_written: tuple[tuple[str, Path], ...]
    workdir: Path
    python: str
    stamp: str

    @property
    def parts_dir(self) -> Path:
        """``PREFIX.parts/``: the home of the job's submissions, beside the output's units."""
        return parts_directory(self.output_prefix)

    @property
    def folder(self) -> Path:
        """This submission's own: ``PREFIX.parts/slurm/<stamp>/``."""
        return self.parts_dir / SUBMISSIONS_DIR / self.stamp

    @property
    def script_path(self) -> Path:
        return self.folder / SCRIPT_FILE

    @property
    def log_dir(self) -> Path:
        return self.parts_dir / SUBMISSIONS_DIR / "logs"

    @property
    def name(self) -> str:
        """prefix + ``preprocess-`` + the output's name + the submission's time stamp."""
        output = re.sub(r"[^A-Za-z0-9_.:+-]", "_", self.output_prefix.name)
        name = f"{self.cluster.job_name_prefix}preprocess-{output}-{self.stamp}"
        if not valid_job_name(name):
            raise ConfigError(
                f"cluster.job_name_prefix={self.cluster.job_name_prefix!r}: a job name may "
                "hold only letters, digits and _.:+- (it names the log files)"
            )
        return name

    def job_log(self, job_id: str) -> Path:
        return self.log_dir / f"{self.name}-{job_id}.log"


def render_preprocess_sbatch(job: PreprocessJob) -> str:
    c = job.cluster
    if c.container_image:
        for flag, place in job.read_and_written:
            if not same_path_mount(c.container_mounts, place):
                raise ConfigError(
                    f"{flag}: {place} must be mounted at the same path in the container (the "
                    f"job's steps run there): add '{place}:{place}' or a parent to "
                    f"cluster.container_mounts (now {c.container_mounts})"
                )
    lines = [
        directive("cluster.job_name_prefix", "--job-name", job.name),
        directive("preprocess --nodes", "--nodes", job.nodes),
        "#SBATCH --ntasks-per-node=1",
        *log_directives("--output-prefix", job.log_dir),
        *cluster_directives(c),
    ]
    if c.max_requeues == 0:  # not even by SLURM's default (JobRequeue=1)
        lines.append("#SBATCH --no-requeue")
    whole_nodes = c.cpus_per_task is None
    if whole_nodes and not c.exclusive:
        # One task per node, which should have all of the node's CPUs.
        lines.append("#SBATCH --exclusive")
    lines += extra_directives(c, _OWN_SBATCH_OPTIONS)
    node_cpus = ['--cpus-per-task="$SLURM_CPUS_ON_NODE"'] if whole_nodes else []
    values = {
        "job_name": job.name,
        "sbatch_directives": "\n".join(lines),
        "workdir": quote("submit directory", job.workdir),
        "max_requeues": str(c.max_requeues),
        "env_exports": env_exports(c),
        "plan_command": _step(job, ["--nodes=1", "--ntasks=1"], ["--plan-only"]),
        "task_command": _step(
            job,
            [
                f"--nodes={job.nodes}",
                "--ntasks-per-node=1",
                # A killed task ends only its own share; the others finish theirs.
                "--kill-on-bad-exit=0",
                "--label",
                *node_cpus,
            ],
            ["--task", "slurm"],
        ).replace("\n", "\n    "),  # inside the retry loop
        "merge_command": _step(job, ["--nodes=1", "--ntasks=1"], []),
    }
    return fill_template(PREPROCESS_TEMPLATE, values)


def _step(job: PreprocessJob, srun_options: list[str], step_arguments: list[str]) -> str:
    c = job.cluster
    options = [
        "srun",
        *srun_options,
        *container_words(c, job.workdir),
        *extra_srun_words(c, _OWN_SRUN_OPTIONS),
    ]
    command = [
        quote("python", job.python),
        "-u",
        "-m",
        CLI_MODULE,
        "preprocess",
        *(quote("preprocess argument", word) for word in job.arguments),
        *step_arguments,
    ]
    return wrap_command(options, command)
