"""Which files a preprocessing run reads, and how each is read.

``--input`` takes files, directories (every data file under them, recursively) and globs
(``'shards/*.jsonl.zst'``, quoted so the shell leaves them to us), in any mix. The order
is the order given, each directory or glob expanded in sorted order: the dataset's bytes
follow it, so it must not depend on the file system's listing order.

A file's format comes from its name: ``.jsonl``/``.json``/``.ndjson`` are JSON lines,
``.parquet`` is parquet, anything else is text (a document per non-blank line); JSON
lines and text may be compressed, ``.gz`` or ``.zst``; another compression (``.bz2``,
``.xz``, ...) is refused by name, where it would have been read as text.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.base.path_kind import not_a_file
from megatron_lns.data.errors import PreprocessError
from megatron_lns.data.output_files import output_file_finder

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
# Compressions not read: refused by name (read as text, their bytes were documents), and
# in a directory counted as data files, so that they are refused rather than left out.
UNREAD_COMPRESSIONS = {
    ".bz2": "bzip2",
    ".xz": "xz",
    ".lzma": "lzma",
    ".lz4": "lz4",
    ".br": "brotli",
    ".zip": "zip",
    ".7z": "7-zip",
}
# What a directory contributes: data files only, not its README or a tool's markers.
DATA_SUFFIXES = (*JSON_SUFFIXES, ".parquet", ".txt")


@dataclass(frozen=True)
class InputFormat:
    kind: str  # "json", "parquet" or "text"
    compression: str | None  # "gzip", "zstd" or None

    @property
    def splittable(self) -> bool:
        """Whether byte ranges of the file can be read on their own (uncompressed lines)."""
        return self.compression is None and self.kind != "parquet"


def input_format(path: Path) -> InputFormat:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in UNREAD_COMPRESSIONS:
        raise PreprocessError(
            f"{path}: {UNREAD_COMPRESSIONS[suffixes[-1]]} compression is not read; "
            "decompress the file, or recompress it with gzip or zstd (.gz, .zst)"
        )
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last == ".parquet":
        if compression:
            raise PreprocessError(
                f"{path}: a compressed parquet file; parquet compresses its own pages, "
                "decompress the file first"
            )
        return InputFormat("parquet", None)
    return InputFormat("json" if last in JSON_SUFFIXES else "text", compression)


def _is_data_file(path: Path) -> bool:
    name = path.name.lower()
    for ending in (*COMPRESSIONS, *UNREAD_COMPRESSIONS):
        name = name.removesuffix(ending)
    return not path.name.startswith(".") and name.endswith(DATA_SUFFIXES)


def expand_inputs(inputs: list[str], output_prefix: Path | None = None) -> list[Path]:
    """The files ``inputs`` name, in order; a missing one, an empty directory or glob,
    or a file named twice is refused by name.

    The files of the output at ``output_prefix`` are never inputs: a directory or glob
    leaves them out (``--input data --output-prefix data/corpus`` reruns with the inputs
    of its first run, not its own ``corpus.json``), and one named as an input is refused
    (the run would overwrite it)."""
    is_output = (
        output_file_finder(output_prefix) if output_prefix is not None else lambda path: None
    )
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and _is_data_file(p) and not is_output(p)
            )
            if not found:
                raise PreprocessError(
                    f"input directory {item} holds no data files "
                    f"({', '.join(DATA_SUFFIXES)}, optionally .gz or .zst)"
                )
            files += found
        elif glob.has_magic(item) and not path.exists():
            matches = map(Path, glob.glob(item, recursive=True))
            found = sorted(p for p in matches if p.is_file() and not is_output(p))
            if not found:
                raise PreprocessError(f"input pattern {item} matches no file")
            files += found
        else:
            if why := not_a_file(path):
                raise PreprocessError(f"input file {item} {why}")
            if output := is_output(path):
                raise PreprocessError(
                    f"input {item} is {output}, which --output-prefix {output_prefix} "
                    "writes: the run would overwrite it; give another prefix"
                )
            files.append(path)
    seen: dict[Path, Path] = {}
    for path in files:
        key = path.resolve()
        if key in seen:
            raise PreprocessError(
                f"input {path} is named twice (also as {seen[key]}): its documents would "
                "be in the dataset twice"
            )
        seen[key] = path
    for path in files:
        input_format(path)  # refuses what cannot be read, before any work starts
    return files
