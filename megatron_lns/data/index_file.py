"""The document lengths in a megatron ``PREFIX.idx``, read without megatron-core or torch.

The split checks (``splits.py``) need only how many tokens each document holds, and
they run on login nodes before a job is queued, where importing megatron-core costs
seconds. The layout is megatron's ``_IndexReader``: a 9-byte ``MMIDIDX`` header, the
version (``<Q``, 1), the token dtype code (``<B``), the sequence and document counts
(``<Q`` each), then one ``int32`` length per sequence.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from megatron_lns.data.errors import DataError

if TYPE_CHECKING:
    import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
_AFTER_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequence count, document count


def sequence_lengths(prefix: str) -> np.ndarray:
    """The tokens of each sequence (document) of ``PREFIX.idx``."""
    import numpy as np

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
    version, _, count, _ = _AFTER_HEADER.unpack_from(header, len(INDEX_HEADER))
    if version != 1:
        raise DataError(f"{path} is a megatron index of version {version}, not 1")
    try:
        lengths = np.fromfile(path, dtype=np.int32, count=count, offset=len(header))
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    if len(lengths) < count:
        raise DataError(
            f"{path} is cut short: it lists {count} documents but holds the lengths of "
            f"{len(lengths)}; preprocess the data again"
        )
    return lengths
