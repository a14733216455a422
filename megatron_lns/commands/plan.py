"""``megatron-lns plan``: parameters, memory per GPU, FLOPs, time and cost of a config,
and whether it fits the GPU, before it is submitted (arithmetic; imports no torch)."""

from __future__ import annotations

import argparse

from megatron_lns.commands.arguments import add_config


def add_parser(commands: argparse._SubParsersAction) -> None:
    from megatron_lns.planning.gpus import DEFAULT_GPU, GPUS

    plan = commands.add_parser(
        "plan", help="will the config fit the GPU, how fast, at what cost (before submit)"
    )
    add_config(plan, "YAML file or bundled config name, as for train")
    plan.add_argument(
        "--gpu", default=DEFAULT_GPU, help=f"one of {', '.join(GPUS)} (default {DEFAULT_GPU})"
    )
    plan.add_argument("--nodes", type=int, help="trainer.num_nodes for this plan")
    plan.add_argument("--vocab-size", type=int, help="the tokenizer's size, if not readable")
    plan.add_argument("--mfu", type=float, help="model FLOPs utilisation, e.g. 0.35")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_lns.config import validate
    from megatron_lns.config.loader import override_key
    from megatron_lns.planning import (
        gpu_named,
        load_for_plan,
        make_plan,
        plan_text,
        vocab_size_of,
    )
    from megatron_lns.planning.plan import PlanArgumentError

    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise PlanArgumentError(f"--mfu {args.mfu}: a fraction of the peak, in (0, 1]")
    if args.nodes is not None and args.nodes < 1:
        raise PlanArgumentError(f"--nodes {args.nodes}: at least 1")
    if args.nodes is not None:
        for override in args.overrides:
            if override_key(override) == "trainer.num_nodes":
                raise PlanArgumentError(
                    f"--nodes {args.nodes} and the override '{override}' both set "
                    "trainer.num_nodes: give one of them"
                )
    if args.vocab_size is not None and args.vocab_size < 1:
        raise PlanArgumentError(f"--vocab-size {args.vocab_size}: at least 1")
    gpu = gpu_named(args.gpu)
    cfg = load_for_plan(args.config, args.overrides, args.nodes)
    # As train checks it, except the files (the data need not exist yet to plan).
    validate(cfg, check_files=False)
    vocab, source = vocab_size_of(cfg, args.vocab_size)
    plan = make_plan(cfg, vocab, gpu, args.mfu, vocab_source=source)
    print(plan.to_json() if args.json else plan_text(plan, args.config, cfg))
    return 0
