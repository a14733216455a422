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
        "settings (held-out data, batch sizes, layout incl. expert parallelism, devices), "
        "wherever they stand on the line, apply to all of them; a Hugging Face export is "
        "analysed at TP=PP=EP=1 on one device unless they say otherwise",
    )
    analyze.add_argument("--out", default=None, help="output directory (default: analysis-TIME)")
    analyze.add_argument(
        "--batches",
        type=int,
        default=None,
        help="held-out global batches (default: each run's trainer.limit_val_batches; at "
        "most what the validation split holds); the once-per-document loss scores whole "
        "validation documents in order, in at most as many sequences",
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

    # key=value settings count wherever they stand: argparse's nargs="+" gives those after
    # --labels to the labels.
    labels = None if args.labels is None else [a for a in args.labels if not is_override(a)]
    arguments = [*args.inputs, *(args.labels or []), *args.overrides]
    analyze(
        [arg for arg in [*args.inputs, *args.overrides] if not is_override(arg)],
        args.out or f"analysis-{time.strftime('%Y%m%d-%H%M%S')}",
        labels=labels,
        batches=args.batches,
        overrides=[arg for arg in arguments if is_override(arg)],
        config=args.config,
        prune=not args.no_prune,
        overwrite=args.overwrite,
    )
    return 0
