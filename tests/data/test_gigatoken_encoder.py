"""``preprocess --encoder gigatoken``: the reference encoders' ids, or a refusal by name."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.gigatoken_encoder import GigatokenTokenizer
from megatron_lns.data.preprocess import CorpusRun, PreprocessError, preprocess_corpus
from megatron_lns.data.tokenizer import build_tokenizer
from megatron_lns.data.unit_worker import TokenizerSpec

pytest.importorskip("gigatoken", reason="the fast extra (megatron-lns[fast]) is not installed")

# Held-out documents (the tokenizers were trained on the corpus's first ones), and text
# that byte-level BPE and byte fallback handle on their own paths.
DOCS = [*demo_documents()[-300:], "naïve café 😀 \t tabs\n\nand\r\nlines", " leading", ""]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("gigatoken")
    paths = []
    for i in range(3):
        lines = b"".join(json.dumps({"text": d}).encode() + b"\n" for d in DOCS[i::3])
        (root / f"{i}.jsonl.gz").write_bytes(gzip.compress(lines))
        paths.append(str(root / f"{i}.jsonl.gz"))
    return paths


def _files(prefix: Path) -> dict[str, bytes]:
    return {s: Path(f"{prefix}{s}").read_bytes() for s in (".bin", ".idx", ".json")}


def test_the_same_bytes_as_the_reference_encoder(tmp_path, shards, factory):
    """A byte-level BPE (GPT-2's kind), in this process and in worker processes."""
    directory = str(factory.hf_bpe(byte_alphabet=True))
    for encoder, workers in [("standard", 1), ("gigatoken", 1), ("gigatoken", 2)]:
        spec = TokenizerSpec("huggingface", directory, None, encoder)
        preprocess_corpus(
            CorpusRun(shards, tmp_path / f"{encoder}{workers}", spec, workers=workers)
        )
    expected = _files(tmp_path / "standard1")
    assert _files(tmp_path / "gigatoken1") == expected
    assert _files(tmp_path / "gigatoken2") == expected
    receipt = json.loads((tmp_path / "gigatoken2.parts/units/000000.json").read_text())
    assert receipt["encoder"] == "gigatoken"


def test_what_gigatoken_cannot_encode_exactly_is_refused_by_name(factory):
    """SentencePiece BPE (measured: other ids on 32 benchmark documents), a byte-level BPE
    trained without every byte, and the byte tokenizer."""
    llama = build_tokenizer("sentencepiece", model=str(factory.sentencepiece("llama")))
    with pytest.raises(PreprocessError, match=r"--encoder gigatoken cannot encode with sentencepiece:.*: it is exact here only for byte-level BPE .* differed from SentencePiece's on 32 of 17,116 benchmark documents; use --encoder standard"):  # fmt: skip
        GigatokenTokenizer(llama)
    partial = build_tokenizer("huggingface", factory.tokenizer("huggingface").type)
    with pytest.raises(PreprocessError, match=r"no single-byte vocab entry for byte 0x00"):
        GigatokenTokenizer(partial)  # a byte-level BPE trained without every byte
    with pytest.raises(PreprocessError, match="the byte tokenizer is encoded with numpy already"):
        GigatokenTokenizer(build_tokenizer("byte"))


def test_a_document_gigatoken_gets_wrong_stops_the_run(factory, monkeypatch):
    reference = build_tokenizer("huggingface", str(factory.hf_bpe(byte_alphabet=True)))
    fast = GigatokenTokenizer(reference)
    monkeypatch.setattr(reference, "encode", lambda text: [1, 2, 3])
    with pytest.raises(PreprocessError, match=r"gives other ids than huggingface:.* for the document starting 'Some text here'"):  # fmt: skip
        fast.encode_flat(["Some text here", "more"])
