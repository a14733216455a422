"""megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), written in bounded memory.

The layout is megatron-core's ``_IndexWriter``: a 9-byte ``MMIDIDX`` header, the version
(``<Q`` 1), the token dtype code (``<B``), the sequence and document counts (``<Q``
each), then one ``int32`` length per sequence, one ``int64`` byte offset per sequence,
and the ``int64`` document boundaries ``0, 1, ..., n`` (a document is one sequence here).
The files are byte for byte what ``IndexedDatasetBuilder`` writes
(``tests/data/test_token_files.py`` compares them). They are written here rather than by
that builder because it keeps every document's length in Python lists and computes the
offsets in a Python loop: its memory grows with the corpus (Megatron-LM #444 reports
250 GB), where these writers hold one chunk of lengths at a time, so a unit of any size
and a merge of thousands of units run in the same few megabytes. Torch-free: the worker
processes that tokenize import nothing heavier than numpy.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from megatron_lns.data.index_file import INDEX_HEADER, read_index_header

# megatron's DType codes of the two token types its preprocessing picks.
_DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}
_CHUNK = 1 << 20  # lengths per chunk when writing or merging an index
_COPY_BYTES = 16 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """megatron's ``DType.optimal_dtype``: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def _write_index(
    path: str,
    dtype: np.dtype,
    count: int,
    length_chunks: Callable[[], Iterator[np.ndarray]],
    digest: hashlib._Hash | None = None,
) -> None:
    """Write ``path`` for ``count`` sequences whose lengths ``length_chunks()`` yields
    (called twice: lengths, then the offsets computed from them)."""

    def write(data: bytes) -> None:
        f.write(data)
        if digest is not None:
            digest.update(data)

    with open(path, "wb") as f:
        write(INDEX_HEADER + struct.pack("<QBQQ", 1, _DTYPE_CODES[dtype], count, count + 1))
        for chunk in length_chunks():
            write(np.ascontiguousarray(chunk, dtype=np.int32).tobytes())
        offset = 0
        for chunk in length_chunks():
            ends = np.cumsum(chunk, dtype=np.int64) * dtype.itemsize + offset
            write((ends - chunk.astype(np.int64) * dtype.itemsize).tobytes())
            offset = int(ends[-1]) if len(ends) else offset
        for start in range(0, count + 1, _CHUNK):
            write(np.arange(start, min(count + 1, start + _CHUNK), dtype=np.int64).tobytes())


def _length_chunks(prefix: str) -> Callable[[], Iterator[np.ndarray]]:
    """The sequence lengths of an existing ``PREFIX.idx``, a chunk at a time."""
    _, count, offset = read_index_header(prefix)

    def chunks() -> Iterator[np.ndarray]:
        if count == 0:
            return
        lengths = np.memmap(f"{prefix}.idx", dtype=np.int32, mode="r", offset=offset, shape=count)
        for start in range(0, count, _CHUNK):
            yield np.array(lengths[start : start + _CHUNK])

    return chunks


class TokenFileWriter:
    """Appends documents to ``PREFIX.bin``; ``finish`` writes ``PREFIX.idx``.

    The lengths wait in a scratch file (``PREFIX.lengths``, removed by ``finish`` and
    ``discard``), not in memory.
    """

    def __init__(self, prefix: str, dtype: np.dtype) -> None:
        self.prefix = prefix
        self.dtype = dtype
        self.documents = 0
        self.tokens = 0
        # Closed by finish() or discard().
        self._bin = open(f"{prefix}.bin", "wb")  # noqa: SIM115
        self._lengths = open(f"{prefix}.lengths", "wb")  # noqa: SIM115

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as their concatenated ids and the length of each."""
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self._lengths.write(lengths.astype(np.int32, copy=False).tobytes())
        self.documents += len(lengths)
        self.tokens += len(ids)

    def finish(self) -> None:
        self._bin.close()
        self._lengths.close()
        scratch = f"{self.prefix}.lengths"

        def chunks() -> Iterator[np.ndarray]:
            with open(scratch, "rb") as f:
                while chunk := f.read(_CHUNK * 4):
                    yield np.frombuffer(chunk, dtype=np.int32)

        _write_index(f"{self.prefix}.idx", self.dtype, self.documents, chunks)
        os.unlink(scratch)

    def discard(self) -> None:
        """Close and remove whatever was written (after an error or a stop)."""
        for f in (self._bin, self._lengths):
            with contextlib.suppress(OSError):  # its buffer cannot go to a full disk either
                f.close()
        for suffix in (".bin", ".lengths", ".idx"):
            Path(f"{self.prefix}{suffix}").unlink(missing_ok=True)


def merge_token_files(parts: list[str], prefix: str, dtype: np.dtype) -> str:
    """Concatenate the datasets ``parts`` (in order) into ``PREFIX.bin/.idx``, as
    megatron's ``IndexedDatasetBuilder.add_index`` would, and return the result's
    identity: the sha256 of the ``.idx`` bytes followed by the ``.bin`` bytes."""
    counts = [read_index_header(part)[1] for part in parts]

    def all_lengths() -> Iterator[np.ndarray]:
        for part in parts:
            yield from _length_chunks(part)()

    digest = hashlib.sha256()
    _write_index(f"{prefix}.idx", dtype, sum(counts), all_lengths, digest)
    with open(f"{prefix}.bin", "wb") as out:
        for part in parts:
            with open(f"{part}.bin", "rb") as f:
                while chunk := f.read(_COPY_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
    return digest.hexdigest()


def token_files_sha256(prefix: str) -> str:
    """The identity ``merge_token_files`` returns, computed from existing files."""
    digest = hashlib.sha256()
    for suffix in (".idx", ".bin"):
        with open(f"{prefix}{suffix}", "rb") as f:
            while chunk := f.read(_COPY_BYTES):
                digest.update(chunk)
    return digest.hexdigest()
