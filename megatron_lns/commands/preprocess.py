"""``megatron-lns preprocess``: jsonl / text -> megatron indexed dataset."""

from __future__ import annotations

import argparse
import os

from megatron_lns.data.tokenizer import TOKENIZER_LIBRARIES


def add_parser(commands: argparse._SubParsersAction) -> None:
    prep = commands.add_parser("preprocess", help="jsonl / text -> megatron indexed dataset")
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
    prep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
