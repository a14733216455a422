"""``megatron-lns preprocess``: a corpus (JSON lines, parquet, text; .gz/.zst) -> megatron
indexed dataset, resumable, in worker processes, or split over the tasks of a SLURM job."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron_lns.data.tokenizer import TOKENIZER_LIBRARIES


def add_parser(commands: argparse._SubParsersAction) -> None:
    prep = commands.add_parser(
        "preprocess", help="corpus (jsonl, parquet, text; .gz/.zst) -> megatron indexed dataset"
    )
    add_arguments(prep)
    prep.set_defaults(func=run, overrides=[])


def preprocess_options() -> list[argparse.Action]:
    """The options of ``megatron-lns preprocess``, as its parser declares them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return list(parser._actions)


def add_arguments(prep: argparse.ArgumentParser) -> None:
    """preprocess's options; ``--submit`` reads them too, to pass each one to the job."""
    prep.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, directories and quoted globs: .jsonl/.json (plain, .gz, .zst), .parquet, "
        "or text (a document per line)",
    )
    prep.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX.bin/.idx/.json/.manifest.json; work in progress in PREFIX.parts/",
    )
    prep.add_argument("--tokenizer-library", default="byte", choices=TOKENIZER_LIBRARIES)
    prep.add_argument("--tokenizer-type", default=None, help="Hugging Face tokenizer directory")
    prep.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    prep.add_argument(
        "--encoder",
        default="standard",
        choices=("standard", "gigatoken"),
        help="gigatoken: the same ids from an exact fast re-implementation of byte-level BPE "
        "(pip install 'megatron-lns[fast]')",
    )
    prep.add_argument("--json-key", default="text", help="the text's key (parquet: its column)")
    prep.add_argument(
        "--workers",
        type=int,
        default=None,
        help="cores to use (default: all this process may use; in a SLURM job, the task's)",
    )
    prep.add_argument(
        "--max-bad-records",
        default="0",
        help="skip up to N malformed records (or a fraction, 0.001), each reported; "
        "default 0: the first one stops the run",
    )
    prep.add_argument(
        "--overwrite", action="store_true", help="replace an existing dataset at PREFIX"
    )
    prep.add_argument(
        "--plan-only", action="store_true", help="check and record the plan, tokenize nothing"
    )
    prep.add_argument(
        "--task",
        default=None,
        metavar="I/N|slurm",
        help="tokenize task I's share of N (slurm: SLURM_PROCID/SLURM_NTASKS), merge nothing; "
        "needs --plan-only first",
    )
    prep.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    prep.add_argument(
        "--submit",
        nargs="+",
        default=None,
        metavar="CONFIG [KEY=VALUE]",
        help="run as a SLURM job, with CONFIG's cluster: section (and cluster.* overrides) "
        "as `megatron-lns submit` reads it",
    )
    prep.add_argument(
        "--nodes", type=int, default=None, help="with --submit: the nodes to tokenize on (1)"
    )
    prep.add_argument(
        "--dry-run",
        action="store_true",
        help="with --submit: print the sbatch script; write and submit nothing",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, what would fail later or mean something else: a tokenizer
    without its file, another library's tokenizer file (which the run would ignore: with
    no --tokenizer-library, it tokenized bytes), an output prefix that names a directory
    (``data/new/``: ``Path`` drops the '/', so it wrote ``data/new.bin``; ``.``, ``..``,
    ``data/.``: no file name to add ``.bin`` to), a worker count below one."""
    from megatron_lns.data.preprocess import PreprocessError
    from megatron_lns.data.tokenizer import TOKENIZER_FILE_FIELD, TOKENIZER_FILE_KIND

    library = args.tokenizer_library
    needed = TOKENIZER_FILE_FIELD.get(library)
    if needed and not getattr(args, f"tokenizer_{needed}"):
        raise PreprocessError(
            f"--tokenizer-library {library} needs --tokenizer-{needed} "
            f"({TOKENIZER_FILE_KIND[library]})"
        )
    for user, field in TOKENIZER_FILE_FIELD.items():
        given = getattr(args, f"tokenizer_{field}")
        if user != library and given is not None:
            raise PreprocessError(
                f"--tokenizer-{field} {given}: --tokenizer-library {library} does not read "
                f"it (--tokenizer-library {user} does)"
            )
    prefix = args.output_prefix
    last_part = prefix.replace(os.sep, "/").rpartition("/")[2]
    if last_part in ("", ".", ".."):
        name = Path(args.input[0]).name.split(".")[0] or "corpus"
        example = os.path.join(prefix, name) if prefix else name
        if prefix.endswith(("/", os.sep)):
            problem = f"{prefix} ends in '/': it names the files, not a directory"
        else:
            shown = prefix or "''"
            problem = f"{shown} names a directory, not the files"
        raise PreprocessError(f"output prefix {problem} (e.g. {example} writes {example}.bin)")
    if args.workers is not None and args.workers < 1:
        raise PreprocessError(f"--workers {args.workers}: give at least 1")
    from megatron_lns.data.unit_worker import BadRecordLimit

    BadRecordLimit.parse(args.max_bad_records)  # here: --submit passes the text to the job
    if args.task is not None and args.plan_only:
        raise PreprocessError("--task and --plan-only: give one (the plan comes first)")


def parse_task(text: str | None) -> tuple[int, int] | None:
    """``--task I/N`` or ``slurm`` (this srun task of the job's)."""
    from megatron_lns.data.preprocess import PreprocessError

    if text is None:
        return None
    if text == "slurm":
        try:
            text = f"{os.environ['SLURM_PROCID']}/{os.environ['SLURM_NTASKS']}"
        except KeyError as missing:
            raise PreprocessError(
                f"--task slurm outside an srun task: {missing.args[0]} is not set"
            ) from None
    task, _, tasks = text.partition("/")
    if not (task.isdigit() and tasks.isdigit() and int(task) < int(tasks)):
        raise PreprocessError(f"--task {text}: give I/N with 0 <= I < N, or slurm")
    return int(task), int(tasks)


def run(args: argparse.Namespace) -> int:
    from megatron_lns.data.preprocess import CorpusRun, PreprocessError, preprocess_corpus
    from megatron_lns.data.unit_worker import BadRecordLimit, TokenizerSpec

    check_arguments(args)
    if args.submit is not None:
        from megatron_lns.commands.preprocess_submit import submit_preprocess

        return submit_preprocess(args, preprocess_options())
    if args.overrides:
        raise PreprocessError(
            f"unrecognized arguments: {' '.join(args.overrides)} (KEY=VALUE overrides of "
            "the cluster: section go with --submit CONFIG)"
        )
    if args.dry_run or args.nodes is not None:
        given = "--dry-run" if args.dry_run else f"--nodes {args.nodes}"
        raise PreprocessError(f"{given}: only with --submit CONFIG")
    outcome = preprocess_corpus(
        CorpusRun(
            inputs=args.input,
            output_prefix=Path(args.output_prefix),
            tokenizer=TokenizerSpec(
                args.tokenizer_library, args.tokenizer_type, args.tokenizer_model, args.encoder
            ),
            json_key=args.json_key,
            workers=args.workers or len(os.sched_getaffinity(0)),
            bad_records=BadRecordLimit.parse(args.max_bad_records),
            overwrite=args.overwrite,
            progress=not args.quiet,
            task=parse_task(args.task),
            plan_only=args.plan_only,
        )
    )
    for line in outcome.lines:
        print(line)
    return 0
