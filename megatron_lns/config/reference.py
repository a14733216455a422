"""The key tables of docs/configuration.md, rendered from the declarations.

The page's prose is written by hand; each table of keys sits between two markers::

    <!-- keys: architecture -->
    | key | default | meaning |
    ...
    <!-- /keys -->

and is rendered here from the declarations of that group (``settings.setting``), in
declaration order. A group with model settings that shape parameters or have a role in
Hugging Face export also shows both facts (``shapes``, ``hf``): "yes" where a checkpoint
under another value is another model, and the ``config.json`` field, "refused" (export
refuses a value other than the default) or "converter" (``convert/architectures`` maps or
refuses each value). ``tests/config/test_reference.py`` fails when the committed page
differs from what the declarations give; after changing a declaration, run::

    python -m megatron_lns.config.reference docs/configuration.md
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.settings import (
    HF_CONVERTER,
    HF_REFUSE,
    Declared,
    declared_settings,
)

# The header of a group's table where it is not the usual one.
HEADERS = {"performance": ("key", "default", "megatron-core meaning; what null resolves to")}
DEFAULT_HEADER = ("key", "default", "meaning")
# The columns of the model facts, before the meaning, in groups that declare any.
FACT_COLUMNS = ("shapes parameters", "Hugging Face")
HF_SHOWN = {HF_REFUSE: "refused", HF_CONVERTER: "converter"}
_BLOCK = re.compile(r"(<!-- keys: (?P<group>[\w.]+) -->\n)(?P<table>.*?)(<!-- /keys -->)", re.S)


def group_of(item: Declared) -> str:
    """The declared group, else the key's section: ``trainer``, ``exp_manager``,
    ``cluster``, ``model.optim``, ``model.data``, ...; ``top`` for top-level keys."""
    if item.setting.group:
        return item.setting.group
    parts = item.key.split(".")
    if len(parts) == 1:
        return "top"
    return ".".join(parts[:2]) if parts[0] == "model" else parts[0]


def shown_default(value: Any, null_means: str | None = None) -> str:
    """A default as the tables show it: YAML's spelling, names in code font."""
    if value is None:
        return f"null ({null_means})" if null_means else "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, float):
        if value.is_integer() and abs(value) >= 1e6:
            return str(int(value))
        if 0 < abs(value) < 1e-3:
            mantissa, exponent = f"{value:.0e}".split("e")
            return f"{mantissa}e{int(exponent)}"
        return repr(value)
    if isinstance(value, (list, dict)):
        return f"`{value}`"
    return str(value)


def key_table(group: str) -> str:
    """The markdown table of every key declared in ``group``."""
    rows = [item for item in declared_settings(ExperimentConfig) if group_of(item) == group]
    if not rows:
        raise ValueError(f"no key is declared in group {group!r}")
    header = HEADERS.get(group, DEFAULT_HEADER)
    facts = any(item.setting.shapes or item.setting.hf for item in rows)
    if facts:
        header = (*header[:-1], *FACT_COLUMNS, header[-1])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for item in rows:
        cells = [f"`{item.key}`", shown_default(item.default, item.setting.null_means)]
        if facts:
            cells += model_facts(item)
        lines.append("| " + " | ".join([*cells, item.setting.doc]) + " |")
    return "\n".join(lines) + "\n"


def model_facts(item: Declared) -> list[str]:
    """The shapes and Hugging Face cells of a key's row (module doc)."""
    hf = item.setting.hf
    shown_hf = HF_SHOWN.get(hf, f"`{hf}`") if hf else ""
    return ["yes" if item.setting.shapes else "", shown_hf]


def groups() -> list[str]:
    """Every declared group, in declaration order."""
    return list(dict.fromkeys(group_of(item) for item in declared_settings(ExperimentConfig)))


def render(page: str) -> str:
    """``page`` with every marked table rendered from the declarations."""
    return _BLOCK.sub(lambda m: m.group(1) + key_table(m.group("group")) + m.group(4), page)


def tabled_groups(page: str) -> list[str]:
    return [m.group("group") for m in _BLOCK.finditer(page)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render the key tables of a markdown page.")
    parser.add_argument("page", type=Path, help="docs/configuration.md")
    parser.add_argument("--check", action="store_true", help="only report whether it is current")
    args = parser.parse_args(argv)
    if not args.page.is_file():
        print(f"error: {args.page} does not exist", file=sys.stderr)
        return 1
    page = args.page.read_text()
    rendered = render(page)
    missing = sorted(set(groups()) - set(tabled_groups(page)))
    if missing:
        print(f"error: {args.page} has no table for group(s) {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.check:
        if rendered != page:
            print(f"{args.page} is out of date: run python -m {__spec__.name} {args.page}")
            return 1
        return 0
    args.page.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
