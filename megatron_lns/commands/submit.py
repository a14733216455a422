"""``megatron-lns submit``: submit training as a SLURM job (the config's ``cluster:``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    submit = commands.add_parser("submit", help="submit training as a SLURM job (cluster: section)")
    submit.add_argument("config", help="YAML file (trainer / exp_manager / model / cluster)")
    submit.add_argument("overrides", nargs="*", help="key=value, +key=value (add), ~key (delete)")
    submit.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script; write and submit nothing"
    )
    submit.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_lns.cluster import executor_for
    from megatron_lns.config import validate
    from megatron_lns.config.sources import load_run_config

    # Checked as `train` checks it, except what the compute node must offer (CUDA, TE):
    # the login node may have no GPU; each task checks that when it starts.
    cfg = load_run_config(args.config, args.overrides)
    validate(cfg)
    executor = executor_for(cfg)
    job = executor.prepare(cfg, Path.cwd(), sys.executable)
    if args.dry_run:
        print(executor.dry_run_text(job), end="")
        return 0
    for line in executor.submit(job).report():
        print(line)
    return 0
