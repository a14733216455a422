"""``megatron-lns submit``: submit training as a SLURM job (the config's ``cluster:``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_lns.commands.arguments import add_config


def add_parser(commands: argparse._SubParsersAction) -> None:
    submit = commands.add_parser("submit", help="submit training as a SLURM job (cluster: section)")
    add_config(submit, "YAML file (trainer / exp_manager / model / cluster)")
    submit.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script; write and submit nothing"
    )
    submit.add_argument(
        "--gpu", default=None, help="the GPU `plan` checks the job against (default H100)"
    )
    submit.add_argument(
        "--skip-plan-check",
        action="store_true",
        help="submit a job that `plan` says does not fit the GPU's memory",
    )
    submit.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_lns.cluster import executor_for
    from megatron_lns.config import validate
    from megatron_lns.config.sources import load_run_config
    from megatron_lns.planning import DEFAULT_GPU, gpu_named
    from megatron_lns.planning.plan import PlanArgumentError

    gpu = gpu_named(args.gpu or DEFAULT_GPU)  # a bad name first, whatever the config, as plan
    # Checked as `train` checks it, except what the compute node must offer (CUDA, TE):
    # the login node may have no GPU; each task checks that when it starts.
    cfg = load_run_config(args.config, args.overrides)
    validate(cfg)
    accelerator = cfg.trainer.accelerator
    # `auto` takes the GPUs the job asks SLURM for (cluster.gpus_per_node, which must then
    # be trainer.devices).
    if accelerator == "gpu" or (accelerator == "auto" and cfg.cluster.gpus_per_node):
        _check_plan(cfg, gpu, args.skip_plan_check)
    elif args.gpu is not None:
        # --gpu names the GPU of that check and nothing else: with no check it would be
        # ignored, most likely by a user who meant the job to run on GPUs.
        without = " and no cluster.gpus_per_node" if accelerator == "auto" else ""
        raise PlanArgumentError(
            f"--gpu {args.gpu}: submit checks a job against a GPU only with "
            f"trainer.accelerator=gpu, and this one has trainer.accelerator={accelerator}"
            f"{without}; drop --gpu, or set trainer.accelerator=gpu"
        )
    executor = executor_for(cfg)
    job = executor.prepare(cfg, Path.cwd(), sys.executable)
    if args.dry_run:
        print(executor.dry_run_text(job), end="")
        return 0
    for line in executor.submit(job).report():
        print(line)
    return 0


def _check_plan(cfg, gpu, skip_plan_check: bool) -> None:
    """``plan``'s one line on stderr (stdout is the script or the job), and a refusal when
    the job would not fit the GPU's memory, unless ``--skip-plan-check``."""
    from megatron_lns.planning import make_plan, summary_line
    from megatron_lns.planning.plan import PlanDoesNotFitError
    from megatron_lns.planning.vocab import vocab_size_of

    vocab, source = vocab_size_of(cfg)
    plan = make_plan(cfg, vocab, gpu, vocab_source=source, with_fixes=False)
    print(summary_line(plan), file=sys.stderr)
    if not plan.fits and not skip_plan_check:
        raise PlanDoesNotFitError(
            f"the job needs {plan.heaviest.total_gb:.1f} GB per GPU, more than the "
            f"{plan.gpu.name}'s {plan.gpu.memory_gb:g} GB: `megatron-lns plan` with the same "
            "arguments lists the changes that would fit (--gpu NAME for another GPU, "
            "--skip-plan-check to submit anyway)"
        )
