"""The embedded demo corpus: English prose that ships with every CPython.

``pydoc_data.topics`` holds the text of the Python language reference (about 0.5M
characters), so the demo needs no download. Each paragraph is a document. The corpus
goes through the same ``preprocess`` path as any user data and is cached as a
megatron indexed dataset, keyed by the tokenizer.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from megatron_lns.data.preprocess import DatasetMetadata, preprocess

BUILTIN_CORPORA = ("pydoc",)


def demo_documents() -> list[str]:
    """Paragraphs of every ``pydoc_data.topics`` entry, in a fixed order."""
    from pydoc_data.topics import topics

    documents = []
    for key in sorted(topics):
        documents.extend(p.strip() for p in topics[key].split("\n\n") if p.strip())
    return documents


def cache_dir() -> Path:
    root = os.environ.get("MEGATRON_LNS_CACHE") or Path.home() / ".cache" / "megatron_lns"
    return Path(root)


def builtin_dataset_prefix(
    name: str, library: str, tokenizer_type: str | None, tokenizer_model: str | None
) -> Path:
    """Prefix of the prepared built-in corpus, preprocessing it on first use."""
    if name not in BUILTIN_CORPORA:
        raise ValueError(f"unknown built-in corpus 'builtin:{name}'; available: {BUILTIN_CORPORA}")
    key = hashlib.sha256(f"{library}|{tokenizer_type}|{tokenizer_model}".encode()).hexdigest()[:12]
    prefix = cache_dir() / f"{name}_{library}_{key}"
    if DatasetMetadata.load(prefix) is None or not Path(f"{prefix}.idx").is_file():
        preprocess(demo_documents(), prefix, library, tokenizer_type, tokenizer_model)
    return prefix
