"""``megatron-lns`` command line: train, submit, preprocess, demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO_ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"


def _quiet_third_party_noise() -> None:
    # megatron-core warns about missing optional accelerators (apex, TE) and its own
    # deprecations on every import; they say nothing about the user's run.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    # torch's extension loader logs "No CUDA runtime is found" on CPU-only hosts.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _train_job(cfg) -> None:
    _quiet_third_party_noise()  # again: spawned ranks start with fresh filters
    from megatron_lns.training.trainer import Trainer

    Trainer(cfg).run()


def _demo_job(cfg, stamp: str) -> None:
    _quiet_third_party_noise()
    from megatron_lns.demo import run_demo

    run_demo(cfg, stamp)


def _launch(cfg, job: Callable[..., Any], *args: Any) -> None:
    """Run ``job(cfg, *args)`` on every rank: in-process under torchrun/SLURM or for one
    device, else as ``trainer.devices`` local processes."""
    from megatron_lns.runtime import spawn_local

    world = cfg.trainer.num_nodes * cfg.trainer.devices
    if "RANK" in os.environ or world == 1:
        job(cfg, *args)
    elif cfg.trainer.num_nodes > 1:
        raise SystemExit(
            "error: trainer.num_nodes > 1 needs a multi-node launcher (torchrun or "
            "`megatron-lns submit` under SLURM)"
        )
    else:
        spawn_local(job, world, cfg, *args)


def _load(config: str | Path, overrides: list[str], dry_run: bool = False):
    from megatron_lns.config import load_config, validate
    from megatron_lns.config.validate import check_environment

    cfg = load_config(config, overrides)
    env_world = os.environ.get("WORLD_SIZE")
    world = int(env_world) if env_world else None
    if world is not None and world != cfg.trainer.num_nodes * cfg.trainer.devices:
        from megatron_lns.config import ConfigError

        raise ConfigError(
            f"WORLD_SIZE={world} from the launcher differs from trainer.num_nodes x "
            f"trainer.devices = {cfg.trainer.num_nodes} x {cfg.trainer.devices}"
        )
    validate(cfg, world)
    if not dry_run:
        check_environment(cfg)
    return cfg


def _print_config(cfg) -> None:
    from megatron_lns.config import to_yaml

    if os.environ.get("RANK", "0") == "0":
        print("# resolved config\n" + to_yaml(cfg), flush=True)


def _train(args: argparse.Namespace) -> int:
    cfg = _load(args.config, args.overrides, args.dry_run)
    _print_config(cfg)
    if args.dry_run:
        return 0
    _launch(cfg, _train_job)
    return 0


def _submit(args: argparse.Namespace) -> int:
    from megatron_lns.config import load_config, validate
    from megatron_lns.launch.submit import prepare_job, require_sbatch, sbatch, write_job

    # Checked as `train` checks it, except what the compute node must offer (CUDA, TE):
    # the login node may have no GPU; each task checks that when it starts.
    cfg = load_config(args.config, args.overrides)
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


def _demo(args: argparse.Namespace) -> int:
    config = Path(args.config) if args.config else DEMO_CONFIG
    if not config.is_file():
        raise SystemExit(f"error: demo config {config} not found; pass --config PATH")
    cfg = _load(config, args.overrides, args.dry_run)
    if args.dry_run:
        _print_config(cfg)
        return 0
    _launch(cfg, _demo_job, time.strftime("%Y%m%d-%H%M%S"))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-lns", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="pretrain from a NeMo-style YAML config")
    train.add_argument("config", help="YAML file (trainer / exp_manager / model sections)")
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

    demo = sub.add_parser("demo", help="train the CPU demo with LNS and with Pre-LN side by side")
    demo.add_argument("overrides", nargs="*", help="key=value overrides of the demo YAML")
    demo.add_argument(
        "--config", default=None, help=f"default: {DEMO_CONFIG.relative_to(REPO_ROOT)}"
    )
    demo.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    demo.set_defaults(func=_demo)

    prep = sub.add_parser("preprocess", help="jsonl / text -> megatron indexed dataset")
    prep.add_argument(
        "--input", nargs="+", required=True, help=".jsonl files or text files (a document per line)"
    )
    prep.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json"
    )
    prep.add_argument(
        "--tokenizer-library", default="byte", choices=("byte", "huggingface", "sentencepiece")
    )
    prep.add_argument("--tokenizer-type", default=None, help="Hugging Face tokenizer directory")
    prep.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    prep.add_argument("--json-key", default="text")
    prep.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=_preprocess)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_third_party_noise()
    args = build_parser().parse_args(argv)
    from megatron_lns.config import ConfigError
    from megatron_lns.data.datasets import DataMismatchError
    from megatron_lns.launch.submit import SubmitError
    from megatron_lns.training.checkpoint import CheckpointError

    try:
        return args.func(args)
    except (
        ConfigError,
        DataMismatchError,
        CheckpointError,
        FileNotFoundError,
        SubmitError,
    ) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
