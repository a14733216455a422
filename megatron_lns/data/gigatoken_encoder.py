"""``preprocess --encoder gigatoken``: the same ids, about nine times faster on one core
(docs/preprocessing.md: 5.0 s against 45.8 s for the 120 MB benchmark corpus).

gigatoken re-implements byte-level BPE (the Hugging Face fast tokenizers of GPT-2, LLaMA 3,
OLMo, Qwen, ...) in Rust, exactly (``tests/data/test_gigatoken_encoder.py`` and the
preprocessing benchmark compare every document here). It is built from the very backend
the training tokenizer loaded (the Hugging Face backend's JSON). Its SentencePiece BPE
path is refused: on the benchmark corpus its ids differed from SentencePiece's on 32
documents (:data:`SENTENCEPIECE_REFUSAL`).

What it is given is what this package's readers parsed, a batch of texts at a time, so its
own file readers (which stop at a file's first malformed line without a word) play no part;
every batch must come back with one row per document, and the first document of every
batch is also encoded by the reference encoder and compared: a tokenizer gigatoken gets
wrong stops the run, naming the document, instead of writing other ids.
"""

from __future__ import annotations

import numpy as np

from megatron_lns.data.corpus_inputs import PreprocessError
from megatron_lns.data.tokenizer import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    RustBackendTokenizer,
    Tokenizer,
)

ENCODERS = ("standard", "gigatoken")
# Measured, not assumed (benchmarks/results/preprocess_throughput.md): on SentencePiece
# BPE with byte fallback, gigatoken 0.10's ids differed from SentencePiece's on 32 of the
# benchmark corpus's 17,116 documents, and a spot check per batch did not catch them.
SENTENCEPIECE_REFUSAL = (
    "it is exact here only for byte-level BPE (GPT-2, LLaMA 3, OLMo, Qwen); on SentencePiece "
    "BPE its ids differed from SentencePiece's on 32 of 17,116 benchmark documents"
)


def _not_byte_level_bpe(backend_json: str) -> str | None:
    """Why a Hugging Face backend is not a byte-level BPE (the kind gigatoken encodes
    exactly here), or None."""
    import json

    backend = json.loads(backend_json)
    model = backend.get("model") or {}
    pre_tokenizer = json.dumps(backend.get("pre_tokenizer"))
    byte_level = '"ByteLevel"' in pre_tokenizer
    if model.get("type") != "BPE" or model.get("byte_fallback") or not byte_level:
        return SENTENCEPIECE_REFUSAL
    return None


class GigatokenTokenizer:
    """``reference``'s ids from gigatoken, as flat arrays (see :meth:`encode_flat`)."""

    def __init__(self, reference: Tokenizer) -> None:
        try:
            import gigatoken
        except ImportError:
            raise PreprocessError(
                "--encoder gigatoken needs the gigatoken package: pip install 'megatron-lns[fast]'"
            ) from None
        self.reference = reference
        self.name, self.vocab_size, self.eod = reference.name, reference.vocab_size, reference.eod
        self.unique_identifiers = reference.unique_identifiers
        try:
            if isinstance(reference, HuggingFaceTokenizer | RustBackendTokenizer):
                backend = reference.backend_json()
                if backend is None:
                    raise ValueError("it has no fast (Rust) backend to build from")
                if why := _not_byte_level_bpe(backend):
                    raise ValueError(why)
                self._fast = gigatoken.Tokenizer.from_json(backend)
            elif isinstance(reference, ByteTokenizer):
                raise ValueError("the byte tokenizer is encoded with numpy already")
            else:
                raise ValueError(SENTENCEPIECE_REFUSAL)
        except Exception as err:  # gigatoken's own errors are plain exceptions
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PreprocessError(
                f"--encoder gigatoken cannot encode with {reference.name}: {message}; use "
                "--encoder standard"
            ) from None

    def encode(self, text: str) -> list[int]:
        ids, _ = self.encode_flat([text])
        return ids.tolist()

    def encode_flat(
        self, texts: list[str], parallel: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(every document's ids, concatenated; the number of ids of each)."""
        import awkward

        rows = self._fast.encode_batch(texts, parallel=parallel)
        if len(rows) != len(texts):
            raise PreprocessError(
                f"--encoder gigatoken returned {len(rows)} documents for {len(texts)}: use "
                "--encoder standard"
            )
        ids = awkward.to_numpy(awkward.flatten(rows)).astype(np.int64)
        lengths = awkward.to_numpy(awkward.num(rows)).astype(np.int64)
        expected = self.reference.encode(texts[0])
        if ids[: lengths[0]].tolist() != expected:
            raise PreprocessError(
                f"--encoder gigatoken gives other ids than {self.name} for the document "
                f"starting {texts[0][:40]!r}: use --encoder standard"
            )
        return ids, lengths
