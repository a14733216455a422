"""``megatron-lns train``: pretrain from a NeMo-style YAML config."""

from __future__ import annotations

import argparse

from megatron_lns.commands.arguments import add_config


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="pretrain from a NeMo-style YAML config")
    add_config(
        train, "YAML file (trainer / exp_manager / model sections) or a bundled config's name"
    )
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    train.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_lns.runtime.early_stops import early_stops_recorded

    with early_stops_recorded():  # before the imports of torch and megatron-core
        from megatron_lns.cluster import job_of_this_process
        from megatron_lns.training.entry_point import train

        # A SLURM job's when started under sbatch or srun (its lock and records say so).
        train(args.config, args.overrides, args.dry_run, job=job_of_this_process())
    return 0
