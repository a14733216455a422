"""The document lengths in a megatron ``PREFIX.idx``, read without megatron-core or torch.

The split checks (``splits.py``) and the size check of ``PREFIX.bin`` need only how many
tokens each document holds, and they run on login nodes before a job is queued, where
importing megatron-core costs seconds. The layout is megatron's ``_IndexReader``: a
9-byte ``MMIDIDX`` header, the version (``<Q``, 1), the token dtype code (``<B``), the
sequence and document counts (``<Q`` each), then one ``int32`` length per sequence.
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
    """(bytes per token, sequence count, offset of the lengths) of ``PREFIX.idx``."""
    path = f"{prefix}.idx"
    try:
        with open(path, "rb") as f:
            header = f.read(len(INDEX_HEADER) + _AFTER_HEADER.size)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    if not header.startswith(INDEX_HEADER):
        raise DataError(
            f"{path} is not a megatron index file (no MMIDIDX header): preprocess the data again"
        )
    if len(header) < len(INDEX_HEADER) + _AFTER_HEADER.size:
        raise DataError(f"{path} is cut short (its header is incomplete): preprocess again")
    version, code, count, _ = _AFTER_HEADER.unpack_from(header, len(INDEX_HEADER))
    if version != 1:
        raise DataError(f"{path} is a megatron index of version {version}, not 1")
    if code not in TOKEN_BYTES:
        raise DataError(f"{path} names an unknown token type (code {code})")
    return TOKEN_BYTES[code], count, len(header)


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
