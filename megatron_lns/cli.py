"""``megatron-lns`` command line: train, plan, submit, compare, demo, preprocess, export-hf,
import-hf, analyze, status.

Errors in the input (config, data, checkpoints, run directory) end the command with one
line, ``error: ...``, and exit code 2; ``MEGATRON_LNS_DEBUG=1`` shows their traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_lns.base.third_party_noise import quiet_third_party_noise
from megatron_lns.commands import (
    analyze,
    compare,
    demo,
    export_hf,
    import_hf,
    plan,
    preprocess,
    status,
    submit,
    train,
)

# Every command, in the order ``--help`` lists them: a module of megatron_lns.commands.
COMMANDS = [train, plan, submit, compare, demo, preprocess, export_hf, import_hf, analyze, status]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-lns", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
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


# What a Unix tool's shell status is when a reader closed its output (128 + SIGPIPE).
BROKEN_PIPE_EXIT_CODE = 141


def main(argv: list[str] | None = None) -> int:
    quiet_third_party_noise()
    try:
        args = _parse_args(argv)
        from megatron_lns.base.exit_status import exit_status

        status = exit_status(lambda: args.func(args))
        sys.stdout.flush()  # here, not at exit, where a closed pipe could not be handled
        return status
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """End quietly when the reader of our output went away (``submit ... | head -1``), as
    Unix tools do: Python ignores SIGPIPE, so a write raises instead. stdout is pointed
    at /dev/null so that the flush at exit does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (captured): nothing flushes it at exit
        pass
    return BROKEN_PIPE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
