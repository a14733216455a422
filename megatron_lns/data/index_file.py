"""The document lengths in a megatron ``PREFIX.idx``, read without megatron-core or torch.

The split checks (``splits.py``) and the size check of ``PREFIX.bin`` need only how many
tokens each document holds, and they run on login nodes before a job is queued, where
importing megatron-core costs seconds. The layout is megatron's ``_IndexReader``: a
9-byte ``MMIDIDX`` header, the version (``<Q``, 1), the token dtype code (``<B``), the
sequence and document counts (``<Q`` each), then one ``int32`` length per sequence, one
``int64`` pointer per sequence, one ``int64`` index per document, and (multimodal
datasets only) one ``int8`` mode per sequence. :func:`read_index_header` checks that
the file holds all the header says it does: megatron maps each array without asking,
and fails on a file cut short only when the ranks build their datasets.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING

from megatron_lns.data.errors import DataError

if TYPE_CHECKING:
    import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
_AFTER_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequence count, document count
# Bytes per token of each megatron ``DType`` code (uint8, int8, int16, int32, int64,
# float64, float32, uint16).
TOKEN_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
# Bytes per sequence (its int32 length and int64 pointer) and per document (its int64
# index) after the header.
_SEQUENCE_BYTES, _DOCUMENT_BYTES = 4 + 8, 8


def sequence_lengths(prefix: str) -> np.ndarray:
    """The tokens of each sequence (document) of ``PREFIX.idx``."""
    return _read_index(prefix)[1]


def check_token_file(prefix: str) -> None:
    """Refuse a ``PREFIX.bin`` shorter than its index says: cut short by a full disk or an
    interrupted copy, it would fail in megatron's memory map on every rank."""
    token_bytes, lengths = _read_index(prefix)
    expected = int(lengths.sum(dtype="int64")) * token_bytes
    try:
        size = os.path.getsize(f"{prefix}.bin")
    except OSError as err:
        raise DataError(f"cannot read {prefix}.bin: {err.strerror or err}") from None
    if size < expected:
        raise DataError(
            f"{prefix}.bin is cut short: {size} bytes where {prefix}.idx lists {len(lengths)} "
            f"documents of {expected} bytes; preprocess the data again"
        )


def read_index_header(prefix: str) -> tuple[int, int, int]:
    """(bytes per token, sequence count, offset of the lengths) of ``PREFIX.idx``, a file
    that holds every array its header announces (module doc)."""
    path = f"{prefix}.idx"
    try:
        with open(path, "rb") as f:
            header = f.read(len(INDEX_HEADER) + _AFTER_HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    if not header.startswith(INDEX_HEADER):
        raise DataError(
            f"{path} is not a megatron index file (no MMIDIDX header): preprocess the data again"
        )
    if len(header) < len(INDEX_HEADER) + _AFTER_HEADER.size:
        raise DataError(f"{path} is cut short (its header is incomplete): preprocess again")
    version, code, count, documents = _AFTER_HEADER.unpack_from(header, len(INDEX_HEADER))
    if version != 1:
        raise DataError(f"{path} is a megatron index of version {version}, not 1")
    if code not in TOKEN_BYTES:
        raise DataError(f"{path} names an unknown token type (code {code})")
    _check_index_size(path, size, len(header), count, documents)
    return TOKEN_BYTES[code], count, len(header)


def _check_index_size(path: str, size: int, offset: int, count: int, documents: int) -> None:
    """Refuse an index shorter than the arrays its header announces."""
    lengths = (size - offset) // 4
    if lengths < count:
        raise DataError(
            f"{path} is cut short: it lists {count} documents but holds the lengths of "
            f"{lengths}; preprocess the data again"
        )
    expected = offset + count * _SEQUENCE_BYTES + documents * _DOCUMENT_BYTES
    if size < expected:
        raise DataError(
            f"{path} is cut short: {size} bytes where the {count} sequences and {documents} "
            f"document indices of its header need {expected}; preprocess the data again"
        )


def _read_index(prefix: str) -> tuple[int, np.ndarray]:
    """(bytes per token, tokens of each sequence) of ``PREFIX.idx``."""
    import numpy as np

    path = f"{prefix}.idx"
    token_bytes, count, offset = read_index_header(prefix)
    try:
        lengths = np.fromfile(path, dtype=np.int32, count=count, offset=offset)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    if len(lengths) < count:
        raise DataError(
            f"{path} is cut short: it lists {count} documents but holds the lengths of "
            f"{len(lengths)}; preprocess the data again"
        )
    return token_bytes, lengths
