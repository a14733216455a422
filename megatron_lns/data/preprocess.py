"""Corpus -> megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx`` + ``PREFIX.json``).

Each document is tokenized and followed by the tokenizer's end-of-document id, as
Megatron-LM's ``tools/preprocess_data.py --append-eod`` does; the files are byte for byte
what it writes (``benchmarks/preprocess_throughput.py`` checks) and what ``GPTDataset``
reads. Token ids are uint16 when the vocabulary fits, else int32, never truncated.

:func:`preprocess_corpus` (``corpus_run.py``) is the command's engine: input shards split
into units, tokenized by worker processes, merged into one prefix, resumable.
:func:`preprocess` writes documents held in memory (the built-in corpora, tests) the
same way, in one piece.

``PREFIX.json`` records the tokenizer, the largest id and the data's identity, so training
can refuse a dataset made with another tokenizer, one whose ids do not fit the model, or
(on resume) one that is not the data a checkpoint was trained on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

from megatron_lns.base.disk import disk_full_reported
from megatron_lns.data.corpus_inputs import PreprocessError, expand_inputs, input_format
from megatron_lns.data.corpus_reader import read_batches
from megatron_lns.data.corpus_run import CorpusRun, preprocess_corpus
from megatron_lns.data.document_encoder import encode_documents
from megatron_lns.data.metadata import DatasetMetadata
from megatron_lns.data.output_files import (
    StopSignals,
    check_output_place,
    publish,
    remove_temporaries,
    temporary_prefix,
)
from megatron_lns.data.token_files import TokenFileWriter, token_dtype, token_files_sha256
from megatron_lns.data.tokenizer import build_tokenizer

__all__ = ["CorpusRun", "PreprocessError", "preprocess", "preprocess_corpus", "read_documents"]


def read_documents(paths: Iterable[str | Path], json_key: str = "text") -> Iterator[str]:
    """Every document of ``paths`` (any input format), stopping at the first bad record."""
    files = expand_inputs([str(p) for p in paths])
    count = 0
    for path in files:
        for batch in read_batches(path, input_format(path), json_key):
            if batch.bad:
                raise PreprocessError(str(batch.bad[0]))
            count += len(batch.texts)
            yield from batch.texts
    if count == 0:
        raise PreprocessError(f"no documents in {', '.join(map(str, files))}: the input is empty")


def preprocess(
    documents: Iterable[str],
    output_prefix: str | Path,
    library: str = "byte",
    tokenizer_type: str | None = None,
    tokenizer_model: str | None = None,
) -> DatasetMetadata:
    """Tokenize ``documents`` (held by the caller) into ``<output_prefix>.bin/.idx/.json``.

    Written under a temporary name and renamed into place at the end: an error, Ctrl-C or
    SIGTERM midway leaves neither temporary files nor a partial dataset, and an existing
    dataset at ``output_prefix`` stays as it was.
    """
    tokenizer = build_tokenizer(library, tokenizer_type, tokenizer_model)
    output_prefix = Path(output_prefix)
    check_output_place(output_prefix)
    temporary = temporary_prefix(output_prefix)
    writer = TokenFileWriter(temporary, token_dtype(tokenizer.vocab_size))
    untouched = (
        f"; {output_prefix}.bin/.idx left as they were"
        if Path(f"{output_prefix}.bin").exists()
        else "; nothing written"
    )
    top = -1
    with StopSignals() as stop, disk_full_reported(f"{output_prefix}.bin", then=untouched):
        try:
            for batch in itertools.batched(documents, 1024):
                stop.check()
                ids, lengths = encode_documents(tokenizer, list(batch))
                top = max(top, int(ids.max()))
                writer.add(ids, lengths)
            stop.check()
            if writer.documents == 0:
                raise PreprocessError("no documents to preprocess: the input is empty")
            writer.finish()
            metadata = DatasetMetadata(
                tokenizer=tokenizer.name,
                vocab_size=tokenizer.vocab_size,
                eod=tokenizer.eod,
                max_token_id=top,
                num_documents=writer.documents,
                num_tokens=writer.tokens,
                dataset_id=token_files_sha256(temporary),
            )
            metadata.save(f"{temporary}.json")
            publish(temporary, output_prefix, (".bin", ".idx", ".json"))
        finally:
            writer.discard()
            remove_temporaries(temporary)
    return metadata
