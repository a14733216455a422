"""Tokenizers: byte-level, Hugging Face (local directory) and SentencePiece.

A thin common interface (``encode``, ``vocab_size``, ``eod``, ``name``) over the
libraries that do the work, which is also what megatron's ``GPTDataset`` needs
from ``GPTDatasetConfig.tokenizer``. Nothing is downloaded: a Hugging Face
tokenizer is loaded from a local directory with the hub offline.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, get_args

from megatron_lns.base.path_kind import not_a_directory, not_a_file
from megatron_lns.data.errors import DataError

TokenizerLibrary = Literal["byte", "huggingface", "sentencepiece"]
TOKENIZER_LIBRARIES: tuple[str, ...] = get_args(TokenizerLibrary)
# The field of a config's model.tokenizer each library reads its files from (preprocess's
# flag --tokenizer-FIELD), and what it names; byte reads none. A library never reads the
# other field.
TOKENIZER_FILE_FIELD = {"huggingface": "type", "sentencepiece": "model"}
TOKENIZER_FILE_KIND = {
    "huggingface": "a local tokenizer directory",
    "sentencepiece": "a .model file",
}


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
        if problem := not_a_directory(path):
            raise FileNotFoundError(f"Hugging Face tokenizer directory {path} {problem}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            # Its own line where it finds the cause: transformers' error of an empty
            # directory is a paragraph whose first line names nothing.
            check_hugging_face_directory(path)
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise TokenizerError(
                f"cannot load a Hugging Face tokenizer from {path}: {first_line}"
            ) from None
        eod = self._tok.eos_token_id
        if eod is None:
            raise TokenizerError(f"tokenizer at {path} has no eos token to use as end-of-document")
        self.name = tokenizer_name("huggingface", type=path)
        self.vocab_size = len(self._tok)
        self.eod = int(eod)

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """What ``encode`` gives each text, from the Rust encoder's batch path (its
        threads: ``RAYON_NUM_THREADS``, set before the first batch) for a fast tokenizer."""
        backend = getattr(self._tok, "backend_tokenizer", None) if self._tok.is_fast else None
        if backend is None:
            return [self.encode(text) for text in texts]
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]

    def backend_json(self) -> str | None:
        """The fast tokenizer's Rust backend as loaded (with whatever transformers set on
        it), serialized: what :class:`RustBackendTokenizer` rebuilds. None for a slow one."""
        backend = getattr(self._tok, "backend_tokenizer", None) if self._tok.is_fast else None
        return None if backend is None else backend.to_str()


class RustBackendTokenizer(_Identified):
    """The Rust backend of a Hugging Face fast tokenizer, rebuilt from the JSON of one that
    a parent process loaded: the ids of :meth:`HuggingFaceTokenizer.encode_batch`, which
    calls that very backend, in a worker that imports neither transformers nor torch
    (seconds per process)."""

    def __init__(self, name: str, vocab_size: int, eod: int, backend_json: str) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        self.name, self.vocab_size, self.eod = name, vocab_size, eod
        self._json = backend_json
        self._backend = FastTokenizer.from_str(backend_json)

    def backend_json(self) -> str:
        return self._json

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


class SentencePieceTokenizer(_Identified):
    def __init__(self, model_path: str) -> None:
        import sentencepiece

        if problem := not_a_file(model_path):
            raise FileNotFoundError(f"SentencePiece model {model_path} {problem}")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"cannot load SentencePiece model {model_path}: {err}") from None
        self.name = tokenizer_name("sentencepiece", model=model_path)
        self.vocab_size = int(self._sp.get_piece_size())
        eos = self._sp.eos_id()
        if eos < 0:
            raise TokenizerError(
                f"SentencePiece model {model_path} has no eos id to use as end-of-document"
            )
        self.eod = int(eos)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        """What ``encode`` gives each text, from SentencePiece's batch path (C++ threads)."""
        return self._sp.encode(texts, num_threads=threads)


def tokenizer_name(
    library: str, type: str | None = None, model: str | None = None, resolve: bool = True
) -> str:
    """The name a tokenizer's data records (``PREFIX.json``): the library and the path of
    its files, symbolic links resolved unless ``resolve`` is false."""
    if library == "byte":
        return ByteTokenizer.name
    path = Path(type if library == "huggingface" else model)
    return f"{library}:{path.resolve() if resolve else path.absolute()}"


# Files a Hugging Face tokenizer directory holds: the fast tokenizer, its config, or a
# slow tokenizer's vocabulary. AutoTokenizer loads nothing from a directory without one.
HUGGING_FACE_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


HUGGING_FACE_DIRECTORY_HINT = "give the directory save_pretrained wrote"


def check_hugging_face_directory(path: str) -> None:
    """What can be known of a Hugging Face tokenizer directory without transformers (which
    imports torch: seconds on a login node): that it is one, that its JSON parses and that
    the ``tokenizers`` library loads its ``tokenizer.json``. Loading it fully is left to
    the ranks."""
    directory = Path(path)
    if problem := not_a_directory(directory):
        raise TokenizerError(f"{path} {problem}: {HUGGING_FACE_DIRECTORY_HINT}")
    if not any((directory / name).is_file() for name in HUGGING_FACE_TOKENIZER_FILES):
        raise TokenizerError(
            f"{path} holds no tokenizer files ({', '.join(HUGGING_FACE_TOKENIZER_FILES)})"
        )
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (directory / name).is_file():
            try:
                json.loads((directory / name).read_text())
            except (OSError, ValueError) as err:
                raise TokenizerError(f"{path}: {name} is not valid JSON ({err})") from None
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as FastTokenizer

        try:
            FastTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as err:  # the Rust library raises plain Exception
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise TokenizerError(
                f"{path}: cannot load a Hugging Face tokenizer from its tokenizer.json "
                f"({first_line})"
            ) from None


def checked_vocab_size(
    library: str, type: str | None = None, model: str | None = None
) -> int | None:
    """Check that the tokenizer's files load, as far as that is cheap: the whole tokenizer
    for ``byte`` and ``sentencepiece`` (a fraction of a second), the files of a Hugging
    Face one. Its vocabulary size where loaded, else None."""
    if library == "huggingface" and type:
        check_hugging_face_directory(type)
        return None
    if library == "sentencepiece" and model:
        return SentencePieceTokenizer(model).vocab_size
    return build_tokenizer(library, type, model).vocab_size


def build_tokenizer(library: str, type: str | None = None, model: str | None = None) -> Tokenizer:
    """``library`` and paths as in the YAML's ``model.tokenizer`` section."""
    if library == "byte":
        return ByteTokenizer()
    file = {"huggingface": type, "sentencepiece": model}.get(library)
    if library in TOKENIZER_FILE_FIELD and not file:
        raise TokenizerError(
            f"model.tokenizer.library={library} needs model.tokenizer."
            f"{TOKENIZER_FILE_FIELD[library]} ({TOKENIZER_FILE_KIND[library]})"
        )
    if library == "huggingface":
        return HuggingFaceTokenizer(type)
    if library == "sentencepiece":
        return SentencePieceTokenizer(model)
    raise TokenizerError(
        f"unknown tokenizer library {library!r}; choose from {', '.join(TOKENIZER_LIBRARIES)}"
    )
