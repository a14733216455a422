"""jsonl / plain text -> megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``).

Each document is tokenized, followed by the tokenizer's end-of-document id, and
appended with megatron-core's ``IndexedDatasetBuilder``: the files are exactly what
Megatron-LM's own preprocessing writes and what ``GPTDataset`` reads. Token ids are
stored as uint16 when the vocabulary fits, else int32, never truncated.

A ``<prefix>.json`` sidecar records the tokenizer and the largest id, so training
can refuse a dataset made with a different tokenizer or one whose ids do not fit the
model's vocabulary.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_lns.data.tokenizer import Tokenizer, build_tokenizer


@dataclass
class DatasetMetadata:
    tokenizer: str
    vocab_size: int
    eod: int
    max_token_id: int
    num_documents: int
    num_tokens: int

    @staticmethod
    def path_for(prefix: str | Path) -> Path:
        return Path(f"{prefix}.json")

    def save(self, prefix: str | Path) -> None:
        self.path_for(prefix).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, prefix: str | Path) -> DatasetMetadata | None:
        path = cls.path_for(prefix)
        return cls(**json.loads(path.read_text())) if path.is_file() else None


def read_documents(paths: Iterable[str | Path], json_key: str = "text") -> Iterator[str]:
    """Documents from ``.jsonl`` files (one JSON object per line, text under ``json_key``)
    or plain text files (one document per non-empty line)."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"input file {path} does not exist")
        with path.open(encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if path.suffix in (".jsonl", ".json"):
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(
                            f"{path}:{line_number}: not valid JSON ({err.msg})"
                        ) from None
                    if json_key not in record:
                        raise ValueError(f"{path}:{line_number}: no '{json_key}' key")
                    yield record[json_key]
                else:
                    yield line.rstrip("\n")


_worker_tokenizer: Tokenizer | None = None


def _init_worker(library: str, type_: str | None, model: str | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(library, type_, model)


def _encode(text: str) -> list[int]:
    assert _worker_tokenizer is not None
    return [*_worker_tokenizer.encode(text), _worker_tokenizer.eod]


def preprocess(
    documents: Iterable[str],
    output_prefix: str | Path,
    library: str = "byte",
    tokenizer_type: str | None = None,
    tokenizer_model: str | None = None,
    workers: int = 1,
    progress: bool = False,
) -> DatasetMetadata:
    """Tokenize ``documents`` into ``<output_prefix>.bin/.idx`` (+ ``.json``)."""
    tokenizer = build_tokenizer(library, tokenizer_type, tokenizer_model)
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp_prefix = output_prefix.with_name(output_prefix.name + f".tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(f"{tmp_prefix}.bin", dtype=dtype)
    num_documents = num_tokens = 0
    max_token_id = -1

    def encoded() -> Iterator[list[int]]:
        if workers <= 1:
            _init_worker(library, tokenizer_type, tokenizer_model)
            yield from map(_encode, documents)
            return
        context = multiprocessing.get_context("spawn")
        with context.Pool(
            workers, _init_worker, (library, tokenizer_type, tokenizer_model)
        ) as pool:
            yield from pool.imap(_encode, documents, chunksize=64)

    stream = encoded()
    if progress:
        from tqdm import tqdm

        stream = tqdm(stream, unit=" docs", desc=f"tokenizing -> {output_prefix.name}")
    try:
        for ids in stream:
            array = np.asarray(ids, dtype=np.int64)
            top = int(array.max())
            if array.min() < 0 or top >= tokenizer.vocab_size:
                raise ValueError(
                    f"tokenizer {tokenizer.name} produced id {top} outside its vocab of "
                    f"{tokenizer.vocab_size}"
                )
            max_token_id = max(max_token_id, top)
            builder.add_document(torch.from_numpy(array), [len(array)])
            num_documents += 1
            num_tokens += len(array)
        if num_documents == 0:
            raise ValueError("no documents to preprocess: the input is empty")
        builder.finalize(f"{tmp_prefix}.idx")
    except BaseException:
        builder.data_file.close()
        for suffix in (".bin", ".idx"):
            Path(f"{tmp_prefix}{suffix}").unlink(missing_ok=True)
        raise
    # Publish atomically: a reader never sees a half-written dataset.
    for suffix in (".bin", ".idx"):
        os.replace(f"{tmp_prefix}{suffix}", f"{output_prefix}{suffix}")
    metadata = DatasetMetadata(
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        eod=tokenizer.eod,
        max_token_id=max_token_id,
        num_documents=num_documents,
        num_tokens=num_tokens,
    )
    metadata.save(output_prefix)
    return metadata
