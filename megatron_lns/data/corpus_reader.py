"""Documents of one unit of input (a file, or a byte range of a large uncompressed one),
streamed in batches: memory holds one batch, whatever the size of the file.

A record that cannot be a document (bad JSON, no such key, text that is not a string, a
null in parquet, bytes that are not UTF-8) is yielded as a :class:`BadRecord` with where
it is and why, for the caller to count against ``--max-bad-records``. A file that cannot
be read at all (a truncated ``.gz``, a corrupt ``.zst``, parquet without the column)
raises :class:`PreprocessError` naming it.

Libraries, each for what it does best: zlib through ``gzip``, ``zstandard`` (with a
check that the stream ends where a frame ends: its stream reader returns a truncated
file's first part without a word), ``orjson`` (parses bytes and checks UTF-8 itself),
pyarrow for parquet.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import orjson

from megatron_lns.data.corpus_inputs import InputFormat, PreprocessError

READ_BYTES = 4 << 20
BATCH_CHARACTERS = 4 << 20  # text per batch handed to the tokenizer
BATCH_DOCUMENTS = 4096


@dataclass(frozen=True)
class BadRecord:
    where: str  # "FILE:LINE" or "FILE row N"
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.why}"


@dataclass
class RecordBatch:
    texts: list[str] = field(default_factory=list)
    bad: list[BadRecord] = field(default_factory=list)
    input_bytes: int = 0  # of the file read since the last batch (compressed bytes if compressed)
    characters: int = 0


def _zstd_chunks(raw: BinaryIO, path: Path) -> Iterator[bytes]:
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    stream = decompressor.decompressobj()
    ended = True  # an empty file is an empty stream (refused later as holding no documents)
    try:
        while data := raw.read(READ_BYTES):
            while data:
                if stream.eof:  # the next frame of a multi-frame file
                    stream = decompressor.decompressobj()
                ended = False
                if out := stream.decompress(data):
                    yield out
                data = stream.unused_data if stream.eof else b""
                ended = stream.eof
    except zstandard.ZstdError as err:
        raise PreprocessError(f"{path}: corrupt zstd data ({err})") from None
    if not ended:
        raise PreprocessError(f"{path}: truncated zstd file (its last frame is incomplete)")


def _gzip_chunks(raw: BinaryIO, path: Path) -> Iterator[bytes]:
    stream = gzip.GzipFile(fileobj=raw, mode="rb")
    try:
        while data := stream.read(READ_BYTES):
            yield data
    except EOFError:
        raise PreprocessError(f"{path}: truncated gzip file (it ends inside its data)") from None
    except (gzip.BadGzipFile, zlib.error) as err:
        raise PreprocessError(f"{path}: corrupt gzip data ({err})") from None


def _plain_chunks(raw: BinaryIO, start: int, end: int | None) -> Iterator[bytes]:
    """The file from ``start`` to the end of the line that holds byte ``end - 1``."""
    raw.seek(start)
    position = start
    while data := raw.read(READ_BYTES):
        yield data
        first, position = position, position + len(data)
        if end is not None and position >= end and b"\n" in data[max(0, end - 1 - first) :]:
            return


def _lines(
    chunks: Iterator[bytes], start: int, end: int | None
) -> Iterator[tuple[int, int, bytes]]:
    """(offset, line number counted from ``start``, line without its newline) of each line
    that starts in ``[start, end)`` of the (uncompressed) stream."""
    rest = b""
    offset = start
    number = 0
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if end is not None and offset >= end:
                return
            number += 1
            yield offset, number, line
            offset += len(line) + 1
    if rest and (end is None or offset < end):
        yield offset, number + 1, rest


def _line_number(path: Path, offset: int) -> int:
    """The line at ``offset`` of an uncompressed file, for a bad record in a byte range
    (which does not know how many lines precede it): counted only when needed."""
    line = 1
    with open(path, "rb") as f:
        while offset > 0 and (data := f.read(min(READ_BYTES, offset))):
            line += data.count(b"\n")
            offset -= len(data)
    return line


def _json_text(line: bytes, json_key: str) -> str:
    """The document of a JSON line, or raises ValueError with why it is not one."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as err:
        message = str(err).split(": line ")[0]
        raise ValueError(
            "not UTF-8 text" if "not valid UTF-8" in message else f"not valid JSON ({message})"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if json_key not in record:
        raise ValueError(f"no '{json_key}' key (keys: {', '.join(record)[:80]})")
    text = record[json_key]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise ValueError(f"'{json_key}' is {kind}, not a string")
    return text


def _line_text(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"not UTF-8 text (byte 0x{line[err.start]:02x} at column {err.start + 1})"
        ) from None


def _read_lines(
    path: Path, fmt: InputFormat, start: int, end: int | None, json_key: str
) -> Iterator[RecordBatch]:
    try:
        raw = open(path, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError as err:
        raise PreprocessError(f"cannot read input {path}: {err.strerror}") from None
    with raw:
        # A range that starts mid-line leaves that line to the range before it.
        skip_first = False
        if start > 0:
            raw.seek(start - 1)
            skip_first = raw.read(1) != b"\n"
        if fmt.compression == "gzip":
            chunks = _gzip_chunks(raw, path)
        elif fmt.compression == "zstd":
            chunks = _zstd_chunks(raw, path)
        else:
            chunks = _plain_chunks(raw, start, end)
        parse = (lambda line: _json_text(line, json_key)) if fmt.kind == "json" else _line_text
        batch = RecordBatch()
        read_until = start
        for offset, number, line in _lines(chunks, start, end):
            if skip_first:
                skip_first = False
                continue
            if not line.strip():
                continue
            try:
                text = parse(line.removesuffix(b"\r") if fmt.kind == "text" else line)
            except ValueError as err:
                line_number = number if start == 0 else _line_number(path, offset)
                batch.bad.append(BadRecord(f"{path}:{line_number}", str(err)))
                continue
            batch.texts.append(text)
            batch.characters += len(text)
            if batch.characters >= BATCH_CHARACTERS or len(batch.texts) >= BATCH_DOCUMENTS:
                position = raw.tell() if fmt.compression else offset
                batch.input_bytes, read_until = position - read_until, position
                yield batch
                batch = RecordBatch()
        batch.input_bytes = (raw.tell() if fmt.compression else (end or raw.tell())) - read_until
        yield batch


def _read_parquet(path: Path, json_key: str) -> Iterator[RecordBatch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (OSError, pa.ArrowException) as err:
        raise PreprocessError(f"{path}: not a readable parquet file ({_one_line(err)})") from None
    if json_key not in schema.names:
        raise PreprocessError(
            f"{path}: no column '{json_key}' (columns: {', '.join(schema.names)[:120]}); "
            "--json-key names the text column"
        )
    if (columns := schema.names.count(json_key)) > 1:
        raise PreprocessError(
            f"{path}: {columns} columns are named '{json_key}': which one holds the text "
            "is not known; write the file with one"
        )
    kind = schema.field(json_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise PreprocessError(f"{path}: column '{json_key}' holds {kind}, not strings")
    size = path.stat().st_size
    rows = max(1, parquet.metadata.num_rows)
    row = 0
    reported = 0
    try:
        for table in parquet.iter_batches(batch_size=BATCH_DOCUMENTS, columns=[json_key]):
            batch = RecordBatch()
            for text in table.column(0).to_pylist():
                row += 1
                if text is None:
                    batch.bad.append(BadRecord(f"{path} row {row}", f"'{json_key}' is null"))
                    continue
                batch.texts.append(text)
                batch.characters += len(text)
            position = size * row // rows
            batch.input_bytes, reported = position - reported, position
            yield batch
    except (OSError, pa.ArrowException) as err:
        raise PreprocessError(
            f"{path}: cannot read parquet row {row + 1} on ({_one_line(err)})"
        ) from None


def _one_line(err: Exception) -> str:
    """pyarrow's message on one line: its lines (thrift's, then pyarrow's) joined by '; '."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def read_batches(
    path: Path, fmt: InputFormat, json_key: str, start: int = 0, end: int | None = None
) -> Iterator[RecordBatch]:
    """The documents of ``path`` (bytes ``[start, end)`` of an uncompressed line file:
    the lines that start there), a batch at a time."""
    if fmt.kind == "parquet":
        return _read_parquet(path, json_key)
    return _read_lines(path, fmt, start, end, json_key)
