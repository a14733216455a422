"""The inputs of ``preprocess_throughput.py``, made on this machine: no download.

A JSONL corpus recombined from the text that ships with the Python running this script
(the paragraphs of ``pydoc_data.topics`` and of the standard library's ``.py`` files:
English prose and code), deterministic for a seed and that Python; a 32k byte-level BPE
trained with the ``tokenizers`` library and saved as a Hugging Face tokenizer directory
(what both ``megatron-lns preprocess --tokenizer-library huggingface`` and Megatron-LM's
``--tokenizer-type HuggingFaceTokenizer`` load); and a 32k SentencePiece BPE model
(byte fallback).
Each is made once in the work directory and reused by later runs (their names carry
the parameters they were made with).
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EOS = "<|endoftext|>"
VOCAB_SIZE = 32_000
# Documents drawn per 1 MB of corpus: ~6 KB each on average (log-normal around 3 KB),
# web-page-like lengths, so per-document overheads count as they do on real corpora.
MEDIAN_DOCUMENT_CHARS = 3000
DOCUMENT_SIGMA = 1.1
# Text the tokenizers are trained on: enough for a 32k vocabulary, quick to train.
TRAINING_CHARS = 30_000_000


def source_paragraphs() -> list[str]:
    """Paragraphs (blank-line separated) of ``pydoc_data.topics`` and the standard
    library's sources, in a fixed order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        paragraphs.extend(p.strip() for p in topics[key].split("\n\n") if p.strip())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        paragraphs.extend(p.strip("\n") for p in text.split("\n\n") if p.strip())
    return paragraphs


def documents(total_bytes: int, seed: int, paragraphs: list[str]) -> Iterator[str]:
    """Documents of paragraphs drawn at random (``seed``) until their JSON lines add up
    to ``total_bytes``."""
    rng = random.Random(seed)
    written = 0
    while written < total_bytes:
        target = int(rng.lognormvariate(0, DOCUMENT_SIGMA) * MEDIAN_DOCUMENT_CHARS) + 1
        parts: list[str] = []
        size = 0
        while size < target:
            part = paragraphs[rng.randrange(len(paragraphs))]
            parts.append(part)
            size += len(part) + 2
        text = "\n\n".join(parts)
        written += len(json.dumps({"text": text})) + 1
        yield text


def write_corpus(path: Path, total_bytes: int, seed: int, paragraphs: list[str]) -> Path:
    """``path`` (JSONL, ``{"text": ...}`` per line), written once: a file already there
    (named by size and seed) is reused."""
    if path.exists():
        return path
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for text in documents(total_bytes, seed, paragraphs):
            out.write(json.dumps({"text": text}) + "\n")
    tmp.replace(path)
    return path


def training_text(corpus: Path) -> Iterator[str]:
    """The first ``TRAINING_CHARS`` characters of the corpus, a paragraph at a time."""
    seen = 0
    with corpus.open(encoding="utf-8") as lines:
        for line in lines:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                yield paragraph
                seen += len(paragraph)
            if seen >= TRAINING_CHARS:
                return


def train_bpe(directory: Path, corpus: Path) -> Path:
    """A byte-level BPE of ``VOCAB_SIZE`` ids with ``EOS`` as its eos token, saved by
    transformers' ``save_pretrained`` into ``directory`` (once)."""
    if (directory / "tokenizer.json").exists():
        return directory
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(corpus), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    tmp = directory.with_name(directory.name + ".tmp")
    fast.save_pretrained(str(tmp))
    tmp.replace(directory)
    return directory


def train_sentencepiece(model: Path, corpus: Path) -> Path:
    """A SentencePiece BPE model with byte fallback (LLaMA 2's kind, which gigatoken also
    encodes) of ``VOCAB_SIZE`` pieces (unk 0, bos 1, eos 2), written to ``model`` (once)."""
    if model.exists():
        return model
    import sentencepiece

    prefix = model.with_name(model.stem + ".tmp")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=(p for p in training_text(corpus) if p.strip()),
        model_prefix=str(prefix),
        vocab_size=VOCAB_SIZE,
        model_type="bpe",
        hard_vocab_limit=False,  # a small --corpus-mb (a trial run) gives fewer pieces
        character_coverage=1.0,
        byte_fallback=True,
        input_sentence_size=400_000,
        shuffle_input_sentence=True,
        max_sentence_length=16_384,
        minloglevel=2,
        num_threads=2,
    )
    Path(f"{prefix}.model").replace(model)
    Path(f"{prefix}.vocab").unlink(missing_ok=True)
    return model
