"""Documents to token ids in batches, each followed by the end-of-document id.

One call per batch of texts, through each library's own batch path: the Rust encoder of
a Hugging Face fast tokenizer (its threads), SentencePiece's C++ batch encoder (its
threads), and numpy for the byte tokenizer. The ids are those ``Tokenizer.encode``
gives each text, so a dataset is the same whatever the batch size
(``tests/data/test_corpus_preprocess.py`` checks it document by document).
"""

from __future__ import annotations

import numpy as np

from megatron_lns.data.corpus_inputs import PreprocessError
from megatron_lns.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer


def encode_documents(
    tokenizer: Tokenizer, texts: list[str], threads: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(the ids of every document, each followed by EOD, concatenated; the length of each)."""
    if not texts:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
    if isinstance(tokenizer, ByteTokenizer):
        encoded = [text.encode("utf-8") for text in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int32)
        ids = np.insert(flat, np.cumsum(lengths), tokenizer.eod)
        return ids, (lengths + 1).astype(np.int32)
    if hasattr(tokenizer, "encode_flat"):  # --encoder gigatoken
        flat, lengths = tokenizer.encode_flat(texts, parallel=threads > 1)
        _check_ids(tokenizer, flat)
        ids = np.insert(flat.astype(np.int32), np.cumsum(lengths), tokenizer.eod)
        return ids, (lengths + 1).astype(np.int32)
    if isinstance(tokenizer, SentencePieceTokenizer):
        batch = tokenizer.encode_batch(texts, threads=threads)
    elif hasattr(tokenizer, "encode_batch"):
        batch = tokenizer.encode_batch(texts)
    else:  # a tokenizer with no batch path of its own
        batch = [tokenizer.encode(text) for text in texts]
    flat: list[int] = []
    eod = tokenizer.eod
    for document in batch:
        flat += document
        flat.append(eod)
    ids = np.array(flat, dtype=np.int64)
    _check_ids(tokenizer, ids)
    lengths = np.fromiter((len(d) + 1 for d in batch), dtype=np.int32, count=len(batch))
    return ids.astype(np.int32), lengths


def _check_ids(tokenizer: Tokenizer, ids: np.ndarray) -> None:
    if not len(ids):
        return
    low, top = int(ids.min()), int(ids.max())
    if low < 0 or top >= tokenizer.vocab_size:
        raise PreprocessError(
            f"tokenizer {tokenizer.name} produced id {top if top >= 0 else low} outside its "
            f"vocab of {tokenizer.vocab_size}"
        )
