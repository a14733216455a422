"""``PREFIX.json``: what ``preprocess`` records next to the token files it writes.

The tokenizer's name and vocabulary size, and the largest id, so a run can refuse data
made with another tokenizer. Read without torch or megatron-core: the same comparison
runs on the login node before a job is queued (``config/data_checks.py``) and again on
every rank against the loaded tokenizer (``datasets.check_dataset_fits``).

It also holds the identity of the token files (``dataset_id``), which every checkpoint
records so that a resume on other data under the same prefix is refused (issue 34):
:func:`dataset_identity` and :func:`same_data`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_lns.data.errors import DataError
from megatron_lns.data.index_file import read_index_header

# Starts every weaker identity (:func:`weak_dataset_identity`); a full ``dataset_id`` is
# 64 hex digits, so the two can never be equal.
WEAK_IDENTITY_PREFIX = "idx-sha256+bin-size:"
_CHUNK_BYTES = 16 << 20


@dataclass
class DatasetMetadata:
    tokenizer: str
    vocab_size: int
    eod: int
    max_token_id: int
    num_documents: int
    num_tokens: int
    # sha256 of PREFIX.idx then PREFIX.bin, computed by ``preprocess`` as it writes them:
    # what a checkpoint records of the data it was trained on. None in older datasets.
    dataset_id: str | None = None

    @staticmethod
    def path_for(prefix: str | Path) -> Path:
        return Path(f"{prefix}.json")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, prefix: str | Path) -> DatasetMetadata | None:
        path = cls.path_for(prefix)
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as err:
            raise DataError(
                f"{path} is not a megatron-lns dataset description ({err}): delete it or "
                "preprocess the data again"
            ) from None

    def tokenizer_mismatch(self, prefix: str, name: str, vocab_size: int | None) -> str | None:
        """Why data ``prefix`` with this description does not belong to the tokenizer
        ``name`` of ``vocab_size`` ids (None: not known here), or None if it does."""
        if self.tokenizer == name and vocab_size in (None, self.vocab_size):
            return None
        vocab = "" if vocab_size is None else f" (vocab {vocab_size})"
        return (
            f"dataset {prefix} was tokenized with {self.tokenizer} (vocab {self.vocab_size}) "
            f"but model.tokenizer is {name}{vocab}"
        )

    def describes(self, prefix: str | Path) -> bool:
        """Whether ``PREFIX.idx`` and ``PREFIX.bin`` are still the files described here, as
        far as their header and size tell: a .json left beside token files copied over
        from elsewhere must not lend them its ``dataset_id``."""
        token_bytes, documents, _ = read_index_header(str(prefix))
        try:
            size = os.path.getsize(f"{prefix}.bin")
        except OSError as err:
            raise DataError(f"cannot read {prefix}.bin: {err.strerror or err}") from None
        return documents == self.num_documents and size == self.num_tokens * token_bytes


def dataset_identity(prefix: str | Path) -> str:
    """What a checkpoint records of the data under ``prefix``.

    The ``dataset_id`` of ``PREFIX.json`` (sha256 of ``PREFIX.idx`` then ``PREFIX.bin``,
    computed by ``preprocess`` as it writes them) when it has one and still describes the
    files. Otherwise (data preprocessed before datasets recorded it, or by other tools) the
    weaker :func:`weak_dataset_identity`: hashing a 40 GB ``.bin`` at every start-up of
    every run would cost minutes.
    """
    metadata = DatasetMetadata.load(prefix)
    if metadata is not None and metadata.dataset_id and metadata.describes(prefix):
        return metadata.dataset_id
    return weak_dataset_identity(prefix)


def weak_dataset_identity(prefix: str | Path) -> str:
    """:data:`WEAK_IDENTITY_PREFIX` and the sha256 of ``PREFIX.idx``'s bytes followed by
    the size of ``PREFIX.bin`` (8 bytes, little-endian).

    Weaker than a ``dataset_id``: the index holds every document's length, so documents
    added, removed or re-tokenized to other lengths change it, but tokens replaced by
    others in documents of the same lengths do not. Cheap: the index is a small fraction
    of the data (about 20 bytes per document), and megatron-lns reads it whole at every
    start-up already (``datasets.index_fingerprint``).
    """
    digest = hashlib.sha256()
    _hash_file(digest, f"{prefix}.idx")
    try:
        size = os.path.getsize(f"{prefix}.bin")
    except OSError as err:
        raise DataError(f"cannot read {prefix}.bin: {err.strerror or err}") from None
    digest.update(size.to_bytes(8, "little"))
    return WEAK_IDENTITY_PREFIX + digest.hexdigest()


def same_data(recorded: str, prefix: str | Path, current: str) -> bool:
    """Whether the data under ``prefix``, of identity ``current`` (:func:`dataset_identity`),
    is the data whose identity a checkpoint recorded as ``recorded``.

    Identities of two strengths are compared at the strength of the recorded one: a weaker
    record against the files' weaker identity (the same documents preprocessed again by a
    ``preprocess`` that records a ``dataset_id`` are still the same data), a full record
    against the full identity, computed from the files where ``PREFIX.json`` has none.
    """
    if recorded == current:
        return True
    if recorded.startswith(WEAK_IDENTITY_PREFIX):
        return recorded == weak_dataset_identity(prefix)
    if current.startswith(WEAK_IDENTITY_PREFIX):
        # Reads every token: rare (a full record, files whose .json has no dataset_id).
        from megatron_lns.data.token_files import token_files_sha256

        try:
            return recorded == token_files_sha256(str(prefix))
        except OSError as err:
            raise DataError(f"cannot read the token files of {prefix}: {err}") from None
    return False


def _hash_file(digest, path: str) -> None:
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
