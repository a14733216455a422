"""``megatron-lns`` command line: train, submit, compare, demo, preprocess, export-hf,
import-hf, analyze.

Errors in the input (config, data, checkpoints, run directory) end the command with one
line, ``error: ...``, and exit code 2; ``MEGATRON_LNS_DEBUG=1`` shows their traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from megatron_lns.data.tokenizer import TOKENIZER_LIBRARIES
from megatron_lns.third_party_noise import quiet_third_party_noise


def _train(args: argparse.Namespace) -> int:
    from megatron_lns.training.entry_point import train

    train(args.config, args.overrides, args.dry_run)
    return 0


def _compare_job(cfg, variant_names: list[str], num_seeds: int, out: str) -> None:
    quiet_third_party_noise()
    from megatron_lns.comparison import parse_variants, run_comparison

    run_comparison(cfg, parse_variants(variant_names), num_seeds, Path(out))


def _submit(args: argparse.Namespace) -> int:
    from megatron_lns.cluster.slurm.submit import prepare_job, require_sbatch, sbatch, write_job
    from megatron_lns.config import load_config, validate
    from megatron_lns.config.bundled import resolve_config_path

    # Checked as `train` checks it, except what the compute node must offer (CUDA, TE):
    # the login node may have no GPU; each task checks that when it starts.
    cfg = load_config(resolve_config_path(args.config), args.overrides)
    validate(cfg)
    job = prepare_job(cfg, Path.cwd(), sys.executable)
    if args.dry_run:
        print(job.script, end="")
        return 0
    require_sbatch()
    write_job(job)
    submitted = sbatch(job)
    print(f"submitted job {submitted.job_id}: {submitted.script_path}")
    print(f"job log: {submitted.job_log}")
    print(f"run log: {submitted.first_run_log} (requeues: -restart1, -restart2, ...)")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from megatron_lns.comparison import DEFAULT_VARIANTS, parse_variants, seeds_for
    from megatron_lns.config.bundled import DEMO_CONFIG_NAME
    from megatron_lns.training.entry_point import (
        load_checked_config,
        print_resolved_config,
        run_on_every_rank,
    )

    cfg = load_checked_config(
        getattr(args, "config", None) or DEMO_CONFIG_NAME, args.overrides, args.dry_run
    )
    variants = [v.name for v in parse_variants(getattr(args, "variants", None) or DEFAULT_VARIANTS)]
    num_seeds = len(seeds_for(cfg, getattr(args, "seeds", 1)))
    if args.dry_run:
        print_resolved_config(cfg)
        return 0
    # Chosen once, before the ranks start, so that every rank writes to the same place.
    out = args.out or str(Path(cfg.exp_manager.exp_dir or "runs") / time.strftime("%Y%m%d-%H%M%S"))
    run_on_every_rank(cfg, _compare_job, variants, num_seeds, out)
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from megatron_lns.data.preprocess import preprocess, read_documents

    metadata = preprocess(
        read_documents(args.input, args.json_key),
        args.output_prefix,
        library=args.tokenizer_library,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        workers=args.workers,
        progress=not args.quiet,
    )
    print(
        f"wrote {args.output_prefix}.bin/.idx: {metadata.num_documents} documents, "
        f"{metadata.num_tokens} tokens, tokenizer {metadata.tokenizer} "
        f"(vocab {metadata.vocab_size})"
    )
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from megatron_lns.convert import export_hf
    from megatron_lns.convert.safetensors_io import parse_size

    export_hf(
        args.checkpoint,
        args.out_dir,
        args.overwrite,
        parse_size(args.max_shard_size),
        tokenizer=not args.no_tokenizer,
    )
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from megatron_lns.convert import import_hf

    import_hf(args.hf_dir, args.out_dir, args.overrides, args.lns, args.config, args.overwrite)
    return 0


def _add_conversion_commands(sub) -> None:
    export = sub.add_parser(
        "export-hf", help="checkpoint -> Hugging Face model (LNS folded into the norm weights)"
    )
    export.add_argument("checkpoint", help="an iter_NNNNNNN directory, or a run directory")
    export.add_argument("out_dir", help="the Hugging Face model directory to write")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    export.add_argument(
        "--max-shard-size", default="2GB", help="largest safetensors shard (default: 2GB)"
    )
    export.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="write no tokenizer files (for a tokenizer transformers cannot reproduce)",
    )
    export.set_defaults(func=_export_hf)

    imp = sub.add_parser(
        "import-hf", help="Hugging Face model -> run directory for continued pretraining"
    )
    imp.add_argument("hf_dir", help="a local LlamaForCausalLM / StableLmForCausalLM directory")
    imp.add_argument("out_dir", help="the run directory to write (config.yaml, checkpoints/)")
    imp.add_argument("overrides", nargs="*", help="key=value settings of the run config")
    imp.add_argument(
        "--lns", action="store_true", help="the weights carry folded LNS factors (our export)"
    )
    imp.add_argument("--config", default=None, help="base YAML for the non-architecture keys")
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    imp.set_defaults(func=_import_hf)


def _add_out_and_dry_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default=None,
        help="directory of the runs and results (default: <exp_manager.exp_dir>/<time>); "
        "an existing one resumes its unfinished runs",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")


def _analyze(args: argparse.Namespace) -> int:
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


def _add_analyze_command(sub) -> None:
    analyze = sub.add_parser(
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
        help="held-out global batches (default: each run's trainer.limit_val_batches)",
    )
    analyze.add_argument("--labels", nargs="+", default=None, help="one name per input")
    analyze.add_argument(
        "--config", default=None, help="run config giving Hugging Face inputs their held-out data"
    )
    analyze.add_argument(
        "--no-prune", action="store_true", help="skip the held-out loss without each layer"
    )
    analyze.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    analyze.set_defaults(func=_analyze, overrides=[])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-lns", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="pretrain from a NeMo-style YAML config")
    train.add_argument(
        "config",
        help="YAML file (trainer / exp_manager / model sections) or a bundled config's name",
    )
    train.add_argument("overrides", nargs="*", help="key=value, +key=value (add), ~key (delete)")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    train.set_defaults(func=_train)

    submit = sub.add_parser("submit", help="submit training as a SLURM job (cluster: section)")
    submit.add_argument("config", help="YAML file (trainer / exp_manager / model / cluster)")
    submit.add_argument("overrides", nargs="*", help="key=value, +key=value (add), ~key (delete)")
    submit.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script; write and submit nothing"
    )
    submit.set_defaults(func=_submit)

    compare = sub.add_parser(
        "compare", help="train several variants over several seeds; table and plots"
    )
    compare.add_argument("config", help="YAML file or bundled config name")
    compare.add_argument("overrides", nargs="*", help="key=value overrides of the YAML")
    compare.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="lns pre_ln post_ln deepnorm mix_ln layerscale skipinit, each optionally "
        "+normal_init / +scaled_init / +depth_scaled_init (default: lns pre_ln)",
    )
    compare.add_argument(
        "--seeds", type=int, default=1, help="runs per variant, seeds model.seed, +1, ..."
    )
    _add_out_and_dry_run(compare)
    compare.set_defaults(func=_compare)

    demo = sub.add_parser(
        "demo", help="the CPU demo: `compare` of LNS and Pre-LN on tiny_cpu_demo, one seed"
    )
    demo.add_argument("overrides", nargs="*", help="key=value overrides of the demo YAML")
    demo.add_argument(
        "--config", default=None, help="YAML file or bundled config name (default: tiny_cpu_demo)"
    )
    _add_out_and_dry_run(demo)
    demo.set_defaults(func=_compare)

    prep = sub.add_parser("preprocess", help="jsonl / text -> megatron indexed dataset")
    prep.add_argument(
        "--input", nargs="+", required=True, help=".jsonl files or text files (a document per line)"
    )
    prep.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json"
    )
    prep.add_argument("--tokenizer-library", default="byte", choices=TOKENIZER_LIBRARIES)
    prep.add_argument("--tokenizer-type", default=None, help="Hugging Face tokenizer directory")
    prep.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    prep.add_argument("--json-key", default="text")
    prep.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=_preprocess)
    _add_conversion_commands(sub)
    _add_analyze_command(sub)
    return parser


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags and ``key=value`` overrides may come in any order (``CONFIG --dry-run k=v``).

    argparse stops filling a positional list at the first flag, so overrides after one
    come back as extra arguments; those are overrides too, anything else is an error.
    """
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    flags = [arg for arg in extras if arg.startswith("-")]
    if flags or (extras and not hasattr(args, "overrides")):
        parser.error("unrecognized arguments: " + " ".join(flags or extras))
    if extras:
        args.overrides = [*args.overrides, *extras]
    return args


def main(argv: list[str] | None = None) -> int:
    quiet_third_party_noise()
    args = _parse_args(argv)
    from megatron_lns.runtime.exit_status import exit_status

    return exit_status(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
