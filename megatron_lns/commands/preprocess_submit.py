"""``megatron-lns preprocess ... --submit CONFIG [overrides]``: the same preprocessing as
a SLURM job over ``--nodes`` nodes, with the config's ``cluster:`` section read as
``megatron-lns submit`` reads it (docs/preprocessing.md, "Across nodes on SLURM").

Only ``cluster:`` applies: the config may be a training config, whose other sections
are training's. The keys that only training uses are named in one note, never dropped
silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

# The cluster: keys the preprocessing job reads (cluster/slurm/preprocess_job.py). Every
# other key of ClusterConfig is named as not used, so a new key cannot be dropped silently.
PREPROCESS_CLUSTER_KEYS = frozenset({
    "partition", "account", "qos", "time_limit", "exclusive", "cpus_per_task", "mem",
    "dependency", "max_requeues", "job_name_prefix", "container_image", "container_mounts",
    "env_vars", "srun_args", "sbatch_args",
})  # fmt: skip
# Why preprocessing does not use a key (the training keys people look for too).
_WHY_NOT_USED = {
    "trainer.num_nodes": "the nodes are --nodes",
    "trainer.devices": "one task per node",
    "cluster.gpus_per_node": "no GPU is used; cluster.sbatch_args can still ask for them",
    "cluster.preemption_signal_lead_s": "no warning is asked for: a TERM keeps finished units",
    "cluster.spare_nodes": "the job asks for --nodes nodes; a failed step runs again on them",
}


def ignored_keys() -> dict[str, str]:
    """The keys preprocessing does not use, and why: the training keys above and every
    cluster: key but :data:`PREPROCESS_CLUSTER_KEYS`."""
    from megatron_lns.config.sections.cluster import ClusterConfig

    names = [f.name for f in dataclasses.fields(ClusterConfig)]
    keys = ["trainer.num_nodes", "trainer.devices"]
    keys += [f"cluster.{name}" for name in names if name not in PREPROCESS_CLUSTER_KEYS]
    return {key: _WHY_NOT_USED.get(key, "not used by the preprocessing job") for key in keys}


def submit_preprocess(args: argparse.Namespace, options: list[argparse.Action]) -> int:
    """Submit ``args`` (preprocess's, whose parser declares ``options``) as a SLURM job."""
    from megatron_lns.cluster.slurm.preprocess_job import PreprocessJob, render_preprocess_sbatch
    from megatron_lns.cluster.slurm.sbatch import submit_script
    from megatron_lns.config.cluster import validate_cluster_settings
    from megatron_lns.config.submission_layout import new_submission_dir
    from megatron_lns.data.corpus_inputs import PreprocessError, expand_inputs
    from megatron_lns.data.output_files import check_output_place, parts_directory

    config, overrides = args.submit[0], [*args.submit[1:], *args.overrides]
    if args.task is not None or args.plan_only:
        flag = "--task" if args.task is not None else "--plan-only"
        raise PreprocessError(f"{flag} and --submit: the job runs every step itself")
    nodes = 1 if args.nodes is None else args.nodes
    if nodes < 1:
        raise PreprocessError(f"--nodes {args.nodes}: give at least 1")
    cluster, ignored = cluster_section(config, overrides)
    if ignored:
        print(f"note: not used by preprocessing: {'; '.join(ignored)}", file=sys.stderr)
    validate_cluster_settings(cluster)
    workdir = Path.cwd().resolve()
    prefix = Path(os.path.abspath(args.output_prefix))
    inputs = [os.path.abspath(text) for text in args.input]
    expand_inputs(inputs, prefix)  # a missing input is refused now, not after the queue
    if not args.dry_run:
        check_output_place(prefix, create=False)
    arguments, tokenizer_files = _arguments(args, options, inputs, prefix)
    job = PreprocessJob(
        cluster=cluster,
        nodes=nodes,
        arguments=tuple(arguments),
        output_prefix=prefix,
        read_and_written=(
            ("--output-prefix", prefix.parent),
            *(("--input", place) for place in _input_places(inputs)),
            *tokenizer_files,
        ),
        workdir=workdir,
        python="python" if cluster.container_image else sys.executable,
        stamp=new_submission_dir(parts_directory(prefix), time.strftime("%Y%m%d-%H%M%S")).name,
    )
    script = render_preprocess_sbatch(job)
    if args.dry_run:
        print(script, end="")
        return 0
    job_id = submit_script(job.folder, script, workdir, job.log_dir)
    print(f"submitted job {job_id}: {job.script_path}")
    print(f"job log: {job.job_log(job_id)}")
    return 0


def cluster_section(config: str, overrides: list[str]):
    """The config's ``cluster:`` section with the overrides (only of ``cluster.`` keys),
    and the keys given that preprocessing does not use, each with why."""
    from omegaconf import OmegaConf

    from megatron_lns.config import ConfigError, load_config
    from megatron_lns.config.loader import override_key, read_yaml_config
    from megatron_lns.config.sources import config_file

    for override in overrides:
        key = override_key(override)
        if key != "cluster" and not key.startswith("cluster."):
            raise ConfigError(
                f"{override}: preprocessing reads only the cluster: section (the config's "
                "other keys are training's)"
            )
    path = config_file(config)
    # Read as train reads it: PyYAML's own loader would make 2026-12-04 a date, which
    # OmegaConf then refuses; OmegaConf keeps it the string train sees.
    raw = OmegaConf.to_container(read_yaml_config(path, "a cluster: section"))
    section = _resolved_cluster(path, raw, overrides)
    cfg = load_config({"cluster": section})
    given = {f"cluster.{key}" for key in section}
    given |= {override_key(o) for o in overrides}
    trainer = raw.get("trainer") if isinstance(raw.get("trainer"), dict) else {}
    ignored = []
    for key, why in ignored_keys().items():
        section_name, name = key.split(".")
        if section_name == "trainer" and name in trainer:
            ignored.append(f"{key}={trainer[name]} ({why})")
        elif key in given:
            ignored.append(f"{key}={getattr(cfg.cluster, name)} ({why})")
    return cfg.cluster, ignored


def _resolved_cluster(path: Path, raw: dict, overrides: list[str]) -> dict:
    """The file's cluster: section with the overrides applied as ``train`` applies them,
    and every ``${...}``, the file's and the overrides', resolved against the whole file
    and the defaults under it, as ``submit`` resolves them (``${name}``,
    ``${trainer.devices}``); only the keys the file or the overrides give. Applied to the
    section alone, an override's ``${name}`` would read the defaults' name: the same text
    would mean one thing in the file and another on the command line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_lns.config import ConfigError
    from megatron_lns.config.loader import (
        apply_overrides,
        check_override_interpolations,
        override_key,
    )
    from megatron_lns.config.nemo_compat import register_nemo_resolvers
    from megatron_lns.config.schema import ExperimentConfig

    section = raw.get("cluster") or {}
    if not isinstance(section, dict):
        return section  # refused by load_config, naming what it is (overrides would replace it)
    if not section and not overrides:
        return {}
    register_nemo_resolvers()  # ${multiply:...}, as train reads it
    try:
        # The file over the defaults, untyped (the other sections are training's to check):
        # ${trainer.devices} reads the default where the file has no such key, as in submit.
        defaults = OmegaConf.to_container(OmegaConf.structured(ExperimentConfig))
        whole = OmegaConf.merge(defaults, {**raw, "cluster": section})
        apply_overrides(whole, overrides)
        check_override_interpolations(whole, overrides)
        resolved = OmegaConf.to_container(whole.cluster, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config file {path}: cluster: {' '.join(str(err).split())}") from None
    keys = [override_key(o).split(".") for o in overrides]
    given = set(section) | {k[1] for k in keys if len(k) > 1}
    if ["cluster"] in keys:  # the whole section replaced
        given |= set(resolved)
    return {key: value for key, value in resolved.items() if key in given}


# preprocess's options that the job's steps are not given as they came: the paths (made
# absolute: a step may start elsewhere, in a container), this submission's own, and what
# each step sets itself (refused with --submit). Every other option is passed on as given.
PASSED_AS_PATHS = ("input", "output_prefix", "tokenizer_type", "tokenizer_model")
THIS_SUBMISSIONS = ("submit", "nodes", "dry_run")
SET_BY_EACH_STEP = ("task", "plan_only")


def _arguments(
    args: argparse.Namespace, options: list[argparse.Action], inputs: list[str], prefix: Path
):
    """preprocess's arguments for the job's steps (paths absolute: the steps may start
    elsewhere, in a container), and the tokenizer files they read. Every option of the
    parser is passed on, but those named above: a new one cannot be dropped silently."""
    words = ["--input", *inputs, "--output-prefix", str(prefix)]
    files = []
    for flag, value in (
        ("--tokenizer-type", args.tokenizer_type),
        ("--tokenizer-model", args.tokenizer_model),
    ):
        if value is not None:
            if Path(value).exists():
                value = os.path.abspath(value)
                files.append((flag, _directory(Path(value))))
            words += [flag, value]
    not_as_given = {*PASSED_AS_PATHS, *THIS_SUBMISSIONS, *SET_BY_EACH_STEP}
    for action in options:
        value = getattr(args, action.dest)
        if action.dest in not_as_given or value is None or value is False:
            continue  # (unset: a task's --workers are then its own CPUs)
        flag = max(action.option_strings, key=len)
        words += [flag] if value is True else [flag, str(value)]
    return words, files


def _input_places(inputs: list[str]) -> list[Path]:
    """The directory of each input: its path up to the first glob character."""
    places = []
    for text in inputs:
        plain = []
        for part in Path(text).parts:
            if any(c in part for c in "*?["):
                break
            plain.append(part)
        places.append(_directory(Path(*plain)))
    return places


def _directory(path: Path) -> Path:
    return path if path.is_dir() else path.parent
