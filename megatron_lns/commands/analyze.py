"""``megatron-lns analyze``: per-layer angular distance, variance and pruning drop of
trained models; the analysis itself is :mod:`megatron_lns.analysis.trained_models`."""

from __future__ import annotations

import argparse
import time


def add_parser(commands: argparse._SubParsersAction) -> None:
    analyze = commands.add_parser(
        "analyze",
        help="per-layer angular distance, variance and pruning drop of trained models",
    )
    analyze.add_argument(
        "inputs",
        nargs="+",
        metavar="RUN_OR_CHECKPOINT",
        help="run directories, iter_NNNNNNN checkpoints or Hugging Face exports; key=value "
        "settings (held-out data, batch sizes, layout, devices) apply to all of them",
    )
    analyze.add_argument("--out", default=None, help="output directory (default: analysis-TIME)")
    analyze.add_argument(
        "--batches",
        type=int,
        default=None,
        help="held-out global batches (default: each run's trainer.limit_val_batches; at "
        "most what the validation split holds)",
    )
    analyze.add_argument("--labels", nargs="+", default=None, help="one name per input")
    analyze.add_argument(
        "--config", default=None, help="run config giving Hugging Face inputs their held-out data"
    )
    analyze.add_argument(
        "--no-prune", action="store_true", help="skip the held-out loss without each layer"
    )
    analyze.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    analyze.set_defaults(func=run, overrides=[])


def run(args: argparse.Namespace) -> int:
    from megatron_lns.analysis.trained_models import analyze, is_override

    arguments = [*args.inputs, *args.overrides]
    analyze(
        [arg for arg in arguments if not is_override(arg)],
        args.out or f"analysis-{time.strftime('%Y%m%d-%H%M%S')}",
        labels=args.labels,
        batches=args.batches,
        overrides=[arg for arg in arguments if is_override(arg)],
        config=args.config,
        prune=not args.no_prune,
        overwrite=args.overwrite,
    )
    return 0
