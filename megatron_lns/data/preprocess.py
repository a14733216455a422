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

import contextlib
import itertools
import json
import multiprocessing
import os
import signal
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_lns.base.disk import disk_full_reported
from megatron_lns.base.path_kind import not_a_file
from megatron_lns.data.errors import DataError
from megatron_lns.data.metadata import DatasetMetadata
from megatron_lns.data.tokenizer import Tokenizer, build_tokenizer


class PreprocessError(DataError):
    """Input that cannot be tokenized (bad JSON, wrong key or type, not UTF-8, nothing in it)."""


def _records(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every non-blank line, decoded as strict UTF-8."""
    try:
        f = path.open("rb")
    except PermissionError as err:
        raise PreprocessError(f"cannot read input {path}: {err.strerror}") from None
    with f:
        for line_number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise PreprocessError(
                    f"{path}:{line_number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at "
                    f"column {err.start + 1})"
                ) from None
            if line.strip():
                yield line_number, line.rstrip("\r\n")


def _json_text(path: Path, line_number: int, line: str, json_key: str) -> str:
    where = f"{path}:{line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PreprocessError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise PreprocessError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if json_key not in record:
        raise PreprocessError(f"{where}: no '{json_key}' key (keys: {', '.join(record)[:80]})")
    text = record[json_key]
    if not isinstance(text, str):
        raise PreprocessError(f"{where}: '{json_key}' is {type(text).__name__}, not a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PreprocessError(f"{where}: '{json_key}' holds an unpaired surrogate") from None
    return text


def read_documents(paths: Iterable[str | Path], json_key: str = "text") -> Iterator[str]:
    """Documents from ``.jsonl`` files (one JSON object per line, text under ``json_key``)
    or plain text files (one document per non-empty line).

    Bad input raises :class:`PreprocessError` naming the file and line; input with no
    document at all is refused too.
    """
    paths = [Path(p) for p in paths]
    count = 0
    for path in paths:
        why = not_a_file(path)
        if why:
            raise PreprocessError(f"input file {path} {why}")
        is_json = path.suffix in (".jsonl", ".json")
        for line_number, line in _records(path):
            count += 1
            yield _json_text(path, line_number, line, json_key) if is_json else line
    if count == 0:
        raise PreprocessError(f"no documents in {', '.join(map(str, paths))}: the input is empty")


_worker_tokenizer: Tokenizer | None = None


# Documents handed to the worker pool at a time (see ``preprocess``).
POOL_BATCH_DOCUMENTS = 4096


def _init_worker(library: str, type_: str | None, model: str | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(library, type_, model)


def _init_pool_worker(library: str, type_: str | None, model: str | None) -> None:
    # Ctrl-C reaches the whole process group: the parent stops the pool and cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(library, type_, model)


def _encode(text: str) -> list[int]:
    assert _worker_tokenizer is not None
    return [*_worker_tokenizer.encode(text), _worker_tokenizer.eod]


class _StopSignals:
    """Ctrl-C and SIGTERM, noted when they arrive and acted on between documents.

    Raising from the signal handler itself could interrupt the worker pool inside its
    own locks, after which terminating the pool hangs; so the handler only records the
    signal and :meth:`check` raises at a safe point: ``KeyboardInterrupt`` for SIGINT,
    ``SystemExit(128 + signum)`` for SIGTERM, and the cleanup runs as for any error.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def check(self) -> None:
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is not None:
            raise SystemExit(128 + self.received)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _publish(tmp_prefix: str, output_prefix: Path) -> None:
    """Rename the finished files into place, ``.json`` last, with Ctrl-C and SIGTERM held
    back so a signal cannot leave new ``.bin`` beside an old ``.idx``."""
    held = {signal.SIGINT, signal.SIGTERM}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        for suffix in (".bin", ".idx", ".json"):
            os.replace(f"{tmp_prefix}{suffix}", f"{output_prefix}{suffix}")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def preprocess(
    documents: Iterable[str],
    output_prefix: str | Path,
    library: str = "byte",
    tokenizer_type: str | None = None,
    tokenizer_model: str | None = None,
    workers: int = 1,
    progress: bool = False,
) -> DatasetMetadata:
    """Tokenize ``documents`` into ``<output_prefix>.bin/.idx`` (+ ``.json``).

    Everything is written under a temporary name and renamed into place at the end: an
    error, Ctrl-C or SIGTERM midway leaves neither temporary files nor a partial
    dataset, and an existing dataset at ``output_prefix`` stays as it was.
    """
    tokenizer = build_tokenizer(library, tokenizer_type, tokenizer_model)
    output_prefix = Path(output_prefix)
    for suffix in (".bin", ".idx", ".json"):
        if Path(f"{output_prefix}{suffix}").is_dir():  # found before tokenizing, not after
            raise PreprocessError(f"cannot write {output_prefix}{suffix}: it is a directory")
    try:
        output_prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PreprocessError(f"cannot create {output_prefix.parent}: {err.strerror}") from None
    if not os.access(output_prefix.parent, os.W_OK | os.X_OK):
        raise PreprocessError(f"cannot write to {output_prefix.parent}: permission denied")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    # Unique per process and host: concurrent writers of one prefix never share a file.
    tmp_prefix = str(output_prefix.with_name(f"{output_prefix.name}.tmp-{uuid.uuid4().hex[:12]}"))
    num_documents = num_tokens = 0
    max_token_id = -1

    def encoded() -> Iterator[list[int]]:
        if workers <= 1:
            _init_worker(library, tokenizer_type, tokenizer_model)
            yield from map(_encode, documents)
            return
        context = multiprocessing.get_context("spawn")
        with context.Pool(
            workers, _init_pool_worker, (library, tokenizer_type, tokenizer_model)
        ) as pool:  # leaving the block (even on error) terminates the workers
            # One bounded batch at a time, not imap over the whole input: imap's feeder
            # thread runs ahead and can block on a full task pipe, and terminating the
            # pool then waits for it forever. Between batches the pipe is empty.
            for batch in itertools.batched(documents, POOL_BATCH_DOCUMENTS):
                yield from pool.map(_encode, batch, chunksize=64)

    untouched = (
        f"; {output_prefix}.bin/.idx left as they were"
        if Path(f"{output_prefix}.bin").exists()
        else "; nothing written"
    )
    with _StopSignals() as stop, disk_full_reported(f"{output_prefix}.bin", then=untouched):
        builder = IndexedDatasetBuilder(f"{tmp_prefix}.bin", dtype=dtype)
        generator = encoded()
        stream: Iterable[list[int]] = generator
        if progress:
            from tqdm import tqdm

            stream = tqdm(generator, unit=" docs", desc=f"tokenizing -> {output_prefix.name}")
        try:
            for ids in stream:
                stop.check()
                array = np.asarray(ids, dtype=np.int64)
                top = int(array.max())
                if array.min() < 0 or top >= tokenizer.vocab_size:
                    raise PreprocessError(
                        f"tokenizer {tokenizer.name} produced id {top} outside its vocab of "
                        f"{tokenizer.vocab_size}"
                    )
                max_token_id = max(max_token_id, top)
                builder.add_document(torch.from_numpy(array), [len(array)])
                num_documents += 1
                num_tokens += len(array)
            stop.check()
            if num_documents == 0:
                raise PreprocessError("no documents to preprocess: the input is empty")
            builder.finalize(f"{tmp_prefix}.idx")
            metadata = DatasetMetadata(
                tokenizer=tokenizer.name,
                vocab_size=tokenizer.vocab_size,
                eod=tokenizer.eod,
                max_token_id=max_token_id,
                num_documents=num_documents,
                num_tokens=num_tokens,
            )
            metadata.save(f"{tmp_prefix}.json")
            _publish(tmp_prefix, output_prefix)
        finally:
            generator.close()
            if stream is not generator:
                stream.close()  # the progress bar
            with contextlib.suppress(OSError):  # its buffer cannot go to a full disk either
                builder.data_file.close()
            for suffix in (".bin", ".idx", ".json"):
                Path(f"{tmp_prefix}{suffix}").unlink(missing_ok=True)
    return metadata
