"""``megatron-lns preprocess``: jsonl / text -> megatron indexed dataset."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

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


# The flag each tokenizer library needs, and what it names.
TOKENIZER_FLAGS = {
    "huggingface": ("tokenizer_type", "--tokenizer-type (a local tokenizer directory)"),
    "sentencepiece": ("tokenizer_model", "--tokenizer-model (a .model file)"),
}


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, what the library would refuse in the words of the config
    keys, or mis-name: a tokenizer without its file, an output prefix that ends in '/'
    (``Path`` drops the '/', so ``data/new/`` wrote ``data/new.bin``); an input that is
    not a file, before the progress bar starts."""
    from megatron_lns.base.path_kind import not_a_file
    from megatron_lns.data.preprocess import PreprocessError

    for path in args.input:
        why = not_a_file(path)
        if why:
            raise PreprocessError(f"input file {path} {why}")
    needed = TOKENIZER_FLAGS.get(args.tokenizer_library)
    if needed and not getattr(args, needed[0]):
        raise PreprocessError(f"--tokenizer-library {args.tokenizer_library} needs {needed[1]}")
    prefix = args.output_prefix
    if prefix.endswith(("/", os.sep)):
        example = f"{prefix}{Path(args.input[0]).stem}"
        raise PreprocessError(
            f"output prefix {prefix} ends in '/': it names the files, not a directory "
            f"(e.g. {example} writes {example}.bin)"
        )


def run(args: argparse.Namespace) -> int:
    from megatron_lns.data.preprocess import preprocess, read_documents

    check_arguments(args)
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
