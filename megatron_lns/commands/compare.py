"""``megatron-lns compare``: train several variants over several seeds; table and plots.

The comparison itself is :mod:`megatron_lns.analysis.comparison`; ``demo`` runs this command's
:func:`run` with its defaults.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_lns.base.third_party_noise import quiet_third_party_noise
from megatron_lns.commands.arguments import add_config
from megatron_lns.config.layer_variants import REGISTRY as LAYER_VARIANTS

if TYPE_CHECKING:
    from megatron_lns.config import ExperimentConfig


def add_parser(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser(
        "compare", help="train several variants over several seeds; table and plots"
    )
    add_config(compare, "YAML file or bundled config name")
    compare.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help=f"lns and every model.layer_variant ({' '.join(LAYER_VARIANTS)}), lns_<variant> "
        "where LNS combines with it, each optionally +normal_init / +scaled_init / "
        "+depth_scaled_init (default: lns pre_ln)",
    )
    compare.add_argument(
        "--seeds", type=int, default=1, help="runs per variant, seeds model.seed, +1, ..."
    )
    add_out_and_dry_run(compare)
    compare.set_defaults(func=run)


def add_out_and_dry_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default=None,
        help="directory of the runs and results (default: <exp_manager.exp_dir>/<time>); "
        "an existing one resumes its unfinished runs",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")


def compare_job(cfg: ExperimentConfig, variant_names: list[str], num_seeds: int, out: str) -> None:
    """What every rank runs: the comparison, written under ``out``."""
    quiet_third_party_noise()
    from megatron_lns.analysis.comparison import parse_variants, run_comparison
    from megatron_lns.cluster import job_of_this_process

    job = job_of_this_process()
    run_comparison(cfg, parse_variants(variant_names), num_seeds, Path(out), job)


def run(args: argparse.Namespace) -> int:
    from megatron_lns.runtime.early_stops import early_stops_recorded

    with early_stops_recorded():  # before the imports of torch and megatron-core
        return _compare(args)


def _compare(args: argparse.Namespace) -> int:
    from megatron_lns.analysis.comparison import (
        DEFAULT_VARIANTS,
        check_arms,
        check_existing_runs,
        check_overrides,
        parse_variants,
        seeds_for,
    )
    from megatron_lns.config.bundled import DEMO_CONFIG_NAME
    from megatron_lns.config.paths import experiments_directory
    from megatron_lns.training.entry_point import (
        load_checked_config,
        print_resolved_config,
        run_on_every_rank,
    )

    cfg = load_checked_config(
        getattr(args, "config", None) or DEMO_CONFIG_NAME, args.overrides, args.dry_run
    )
    parsed = parse_variants(getattr(args, "variants", None) or DEFAULT_VARIANTS)
    check_overrides(args.overrides, parsed, args.command, args.out)
    check_arms(cfg, parsed)
    variants = [v.name for v in parsed]
    seeds = seeds_for(cfg, getattr(args, "seeds", 1))
    num_seeds = len(seeds)
    if args.out is not None:
        check_existing_runs(cfg, parsed, seeds, Path(args.out))
    if args.dry_run:
        print_resolved_config(cfg)
        return 0
    # Chosen once, before the ranks start, so that every rank writes to the same place.
    out = args.out or str(experiments_directory(cfg) / time.strftime("%Y%m%d-%H%M%S"))
    run_on_every_rank(cfg, compare_job, variants, num_seeds, out)
    return 0
