"""``megatron-lns demo``: ``compare`` of LNS and Pre-LN on ``tiny_cpu_demo``, one seed."""

from __future__ import annotations

import argparse

from megatron_lns.commands import compare


def add_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo", help="the CPU demo: `compare` of LNS and Pre-LN on tiny_cpu_demo, one seed"
    )
    demo.add_argument("overrides", nargs="*", help="key=value overrides of the demo YAML")
    demo.add_argument(
        "--config", default=None, help="YAML file or bundled config name (default: tiny_cpu_demo)"
    )
    compare.add_out_and_dry_run(demo)
    demo.set_defaults(func=compare.run)
