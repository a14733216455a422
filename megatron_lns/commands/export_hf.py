"""``megatron-lns export-hf``: checkpoint -> Hugging Face model (LNS folded into the norms)."""

from __future__ import annotations

import argparse

from megatron_lns.commands.arguments import add_out_dir


def add_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export-hf", help="checkpoint -> Hugging Face model (LNS folded into the norm weights)"
    )
    export.add_argument("checkpoint", help="an iter_NNNNNNN directory, or a run directory")
    add_out_dir(export, "the Hugging Face model directory to write")
    export.add_argument(
        "--max-shard-size", default="2GB", help="largest safetensors shard (default: 2GB)"
    )
    export.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="write no tokenizer files (for a tokenizer transformers cannot reproduce)",
    )
    export.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
