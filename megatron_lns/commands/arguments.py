"""The arguments several commands share: one name, one meaning and one help text each."""

from __future__ import annotations

import argparse

# The grammar of load_run_config's overrides, which every command taking a config reads.
OVERRIDES_HELP = "key=value, +key=value (add), ~key (delete)"


def add_config(parser: argparse.ArgumentParser, help: str) -> None:
    """CONFIG (a YAML file or a bundled config's name) and its key=value overrides."""
    parser.add_argument("config", help=help)
    parser.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)


def add_out_dir(parser: argparse.ArgumentParser, help: str) -> None:
    """OUT_DIR, the directory the command writes, and ``--overwrite``: without it a
    non-empty OUT_DIR is refused."""
    parser.add_argument("out_dir", help=help)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
