"""Tokenizers: byte-level, Hugging Face (local directory) and SentencePiece.

A thin common interface (``encode``, ``vocab_size``, ``eod``, ``name``) over the
libraries that do the work, which is also what megatron's ``GPTDataset`` needs
from ``GPTDatasetConfig.tokenizer``. Nothing is downloaded: a Hugging Face
tokenizer is loaded from a local directory with the hub offline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from megatron_lns.choices import TOKENIZER_LIBRARIES
from megatron_lns.data.errors import DataError


class TokenizerError(DataError):
    """A tokenizer that is not specified fully or cannot be loaded from its files."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    @property
    def unique_identifiers(self) -> dict: ...


class _Identified:
    """megatron's dataset cache keys include ``tokenizer.unique_identifiers``."""

    name: str
    vocab_size: int

    @property
    def unique_identifiers(self) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size}


@dataclass(frozen=True)
class ByteTokenizer(_Identified):
    """UTF-8 bytes as ids 0-255; id 256 ends a document."""

    name: str = "byte"
    vocab_size: int = 257
    eod: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer(_Identified):
    def __init__(self, path: str) -> None:
        if not Path(path).exists():
            raise FileNotFoundError(f"Hugging Face tokenizer directory {path} does not exist")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise TokenizerError(
                f"cannot load a Hugging Face tokenizer from {path}: {first_line}"
            ) from None
        eod = self._tok.eos_token_id
        if eod is None:
            raise TokenizerError(f"tokenizer at {path} has no eos token to use as end-of-document")
        self.name = f"huggingface:{Path(path).resolve()}"
        self.vocab_size = len(self._tok)
        self.eod = int(eod)

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]


class SentencePieceTokenizer(_Identified):
    def __init__(self, model_path: str) -> None:
        import sentencepiece

        if not Path(model_path).is_file():
            raise FileNotFoundError(f"SentencePiece model {model_path} does not exist")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"cannot load SentencePiece model {model_path}: {err}") from None
        self.name = f"sentencepiece:{Path(model_path).resolve()}"
        self.vocab_size = int(self._sp.get_piece_size())
        eos = self._sp.eos_id()
        if eos < 0:
            raise TokenizerError(
                f"SentencePiece model {model_path} has no eos id to use as end-of-document"
            )
        self.eod = int(eos)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)


def build_tokenizer(library: str, type: str | None = None, model: str | None = None) -> Tokenizer:
    """``library`` and paths as in the YAML's ``model.tokenizer`` section."""
    if library == "byte":
        return ByteTokenizer()
    if library == "huggingface":
        if not type:
            raise TokenizerError(
                "a Hugging Face tokenizer needs model.tokenizer.type (a local directory)"
            )
        return HuggingFaceTokenizer(type)
    if library == "sentencepiece":
        if not model:
            raise TokenizerError(
                "a SentencePiece tokenizer needs model.tokenizer.model (a .model file)"
            )
        return SentencePieceTokenizer(model)
    raise TokenizerError(
        f"unknown tokenizer library {library!r}; choose from {', '.join(TOKENIZER_LIBRARIES)}"
    )
