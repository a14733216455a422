"""``PREFIX.json``: what ``preprocess`` records next to the token files it writes.

The tokenizer's name and vocabulary size, and the largest id, so a run can refuse data
made with another tokenizer. Read without torch or megatron-core: the same comparison
runs on the login node before a job is queued (``config/data_checks.py``) and again on
every rank against the loaded tokenizer (``datasets.check_dataset_fits``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_lns.data.errors import DataError


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
