"""``megatron-lns`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from megatron_lns.runtime import ParallelLayout


def _quiet_third_party_noise() -> None:
    # megatron-core warns about missing optional accelerators (apex, TE) and its own
    # deprecations on every import; they say nothing about the user's run.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    # torch's extension loader logs "No CUDA runtime is found" on CPU-only hosts.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _demo(args: argparse.Namespace) -> int:
    from megatron_lns.demo import DemoSettings, launch_demo

    settings = DemoSettings(
        steps=args.steps,
        num_layers=args.num_layers,
        layout=ParallelLayout(
            tensor=args.tp,
            pipeline=args.pp,
            virtual_pipeline=args.vp,
            sequence_parallel=args.sequence_parallel,
        ),
    )
    launch_demo(settings, world_size=args.nproc)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-lns", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a tiny model with LNS and with Pre-LN side by side (CPU)"
    )
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--num-layers", type=int, default=16)
    demo.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    demo.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    demo.add_argument("--vp", type=int, default=None, help="virtual-pipeline chunks per stage")
    demo.add_argument("--sequence-parallel", action="store_true")
    demo.add_argument("--nproc", type=int, default=None, help="processes (default tp*pp)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_third_party_noise()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
