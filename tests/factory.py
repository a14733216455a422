"""What tests share, built in one place: tokenizers (SentencePiece, Hugging Face BPE,
byte), preprocessed datasets and trained tiny runs (of ``helpers.tiny_run_config``, the
one tiny run config; ``helpers.tiny_config`` is the one tiny model config).

Each thing is built once per test session, however many tests and pytest-xdist workers
ask for it: it is kept in a directory of the session's shared folder named by a hash of
its recipe, and the first process to need it builds it under a file lock while the
others wait, then read it. Recipes are plain data (names, numbers, options), so two
tests asking for the same thing get the same directory. A test reads what it gets and
never writes to it: what a test changes, it copies first.

The session fixtures of ``conftest.py`` hand out a :class:`Factory` (``factory``) and
the things many tests want (``straight_tiny_run``, the shared corpus cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# filelock comes with torch (a dependency of the package): no test-only requirement.
from filelock import FileLock
from helpers import DEMO_CONFIG, ROOT, fresh_launch_env, train_tiny_run

# -- tokenizers -----------------------------------------------------------------------------

# SentencePiece models of the kinds that matter, on the demo corpus's first documents:
# T5's and LLaMA's recipes shrunk (each trains in well under a second), variants of them
# that decode differently, and a word model (a type export refuses).
SENTENCEPIECE_TRAIN_DOCS = 1200  # (~180K characters); the corpus's last documents are held out
_LLAMA = {
    "model_type": "bpe",
    "byte_fallback": True,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "split_digits": True,
}
SENTENCEPIECE_RECIPES: dict[str, dict[str, Any]] = {
    "t5": {"model_type": "unigram"},
    "t5_no_prefix": {"model_type": "unigram", "add_dummy_prefix": False},
    "llama": {**_LLAMA, "allow_whitespace_only_pieces": True},
    "llama_no_prefix": {**_LLAMA, "add_dummy_prefix": False},
    "unigram_specials": {
        "model_type": "unigram",
        "byte_fallback": True,
        "user_defined_symbols": ["<sep>", "@@"],
        "control_symbols": ["<ctl>"],
        "pad_id": 3,
    },
    "bpe_nfkc": {"model_type": "bpe"},
    # Extra spaces removed, but tabs and newlines kept (no NFKC maps them to spaces).
    "unigram_identity": {"model_type": "unigram", "normalization_rule_name": "identity"},
}
SENTENCEPIECE_VOCAB = 800
# The word model: a type Hugging Face export refuses; its own small size.
WORD_MODEL = {"model_type": "word", "vocab_size": 300, "documents": 200}

# A byte-level BPE tokenizer as Hugging Face trains one, with its unknown and EOS tokens.
HF_BPE_VOCAB = 400
HF_BPE_TRAIN_DOCS = 200


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer as a run's config names it (``model.tokenizer.*``)."""

    library: str
    type: str | None = None  # huggingface: the tokenizer directory
    model: str | None = None  # sentencepiece: the .model file

    def preprocess_options(self) -> dict[str, str | None]:
        """The keyword arguments ``preprocess`` takes for it."""
        return {"tokenizer_type": self.type, "tokenizer_model": self.model}

    def build(self):
        """The tokenizer itself, as training builds it."""
        from megatron_lns.data.tokenizer import build_tokenizer

        return build_tokenizer(self.library, self.type, self.model)


# -- the shared folder ----------------------------------------------------------------------


def shared_root(tmp_path_factory) -> Path:
    """The session's folder common to all its processes: under pytest-xdist each worker's
    base temporary directory is a folder of the session's (named after the worker), so the
    workers share its parent."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


class Factory:
    """Builds each recipe once under ``root`` and hands out its directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def corpus_cache(self) -> Path:
        """``$MEGATRON_LNS_CACHE`` for the session: each built-in corpus is prepared once
        per tokenizer (the package makes processes preparing one at once safe)."""
        return self.root / "corpus_cache"

    def built(self, kind: str, recipe: Any, build: Callable[[Path], None]) -> Path:
        """The directory of ``recipe``, made by ``build(directory)`` if no process has."""
        digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
        directory = self.root / f"{kind}_{digest[:12]}"
        done = directory / ".built"
        with FileLock(f"{directory}.lock"):
            if not done.exists():
                shutil.rmtree(directory, ignore_errors=True)  # what a failed build left
                directory.mkdir()
                build(directory)
                done.touch()
        return directory

    # -- tokenizers

    def sentencepiece(self, name: str) -> Path:
        """The ``.model`` file of :data:`SENTENCEPIECE_RECIPES` ``[name]`` (or ``"word"``)."""
        if name == "word":
            options = dict(WORD_MODEL)
        else:
            options = {
                **SENTENCEPIECE_RECIPES[name],
                "vocab_size": SENTENCEPIECE_VOCAB,
                "documents": SENTENCEPIECE_TRAIN_DOCS,
            }

        def build(directory: Path) -> None:
            import sentencepiece

            from megatron_lns.data.demo_corpus import demo_documents

            trainer_options = {k: v for k, v in options.items() if k != "documents"}
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(demo_documents()[: options["documents"]]),
                model_prefix=str(directory / "sp"),
                minloglevel=2,
                **trainer_options,
            )

        return self.built("sentencepiece", options, build) / "sp.model"

    def hf_bpe(self, byte_alphabet: bool = False) -> Path:
        """A real Hugging Face tokenizer directory, trained here (no download); with
        ``byte_alphabet``, every byte has its own token, as in GPT-2's and LLaMA 3's."""

        def build(directory: Path) -> None:
            from tokenizers import Tokenizer, models, pre_tokenizers, trainers
            from transformers import PreTrainedTokenizerFast

            from megatron_lns.data.demo_corpus import demo_documents

            tok = Tokenizer(models.BPE(unk_token="<unk>"))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else []
            trainer = trainers.BpeTrainer(
                vocab_size=HF_BPE_VOCAB + len(alphabet),
                special_tokens=["<unk>", "</s>"],
                initial_alphabet=alphabet,
            )
            tok.train_from_iterator(demo_documents()[:HF_BPE_TRAIN_DOCS], trainer)
            PreTrainedTokenizerFast(
                tokenizer_object=tok, unk_token="<unk>", eos_token="</s>"
            ).save_pretrained(directory)

        recipe = {"vocab_size": HF_BPE_VOCAB, "documents": HF_BPE_TRAIN_DOCS}
        if byte_alphabet:
            recipe["byte_alphabet"] = True
        return self.built("hf_bpe", recipe, build)

    def tokenizer(self, library: str) -> TokenizerFiles:
        """A tokenizer of ``library``: bytes, :meth:`hf_bpe` or the ``t5`` SentencePiece."""
        if library == "byte":
            return TokenizerFiles("byte")
        if library == "huggingface":
            return TokenizerFiles(library, type=str(self.hf_bpe()))
        if library == "sentencepiece":
            return TokenizerFiles(library, model=str(self.sentencepiece("t5")))
        raise ValueError(f"no tokenizer of library {library!r}: byte, huggingface, sentencepiece")

    # -- datasets

    def dataset(self, documents: int, library: str = "byte") -> Path:
        """The prefix of the demo corpus's first ``documents`` preprocessed with
        :meth:`tokenizer` ``(library)``."""
        tokenizer = self.tokenizer(library)

        def build(directory: Path) -> None:
            from megatron_lns.data.demo_corpus import demo_documents
            from megatron_lns.data.preprocess import preprocess

            options = tokenizer.preprocess_options()
            preprocess(demo_documents()[:documents], directory / "corpus", library, **options)

        recipe = {"documents": documents, "tokenizer": dataclasses.asdict(tokenizer)}
        return self.built("dataset", recipe, build) / "corpus"

    # -- trained runs

    def tiny_run(self, *overrides: str) -> dict[str, Any]:
        """:func:`train_tiny_run` ``(*overrides)``, trained once: its summary. The run
        directory (checkpoints at steps 3 and 6) is shared: read it, never write to it."""

        def build(directory: Path) -> None:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("MEGATRON_LNS_CACHE", str(self.corpus_cache))
                summary = train_tiny_run(directory, *overrides)
            (directory / "summary.pkl").write_bytes(pickle.dumps(summary))

        directory = self.built("tiny_run", list(overrides), build)
        return pickle.loads((directory / "summary.pkl").read_bytes())

    def cli_run(self, *overrides: str) -> Path:
        """``megatron-lns train`` of the demo config with ``overrides``, run once: its run
        directory (``<exp_dir>/lns``), shared: read it, never write to it."""

        def build(directory: Path) -> None:
            env = fresh_launch_env(MEGATRON_LNS_CACHE=str(self.corpus_cache))
            env.pop("MEGATRON_LNS_ATTEMPT", None)
            command = [sys.executable, "-m", "megatron_lns.cli", "train", str(DEMO_CONFIG),
                       *overrides, f"exp_manager.exp_dir={directory}"]  # fmt: skip
            run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=600)  # fmt: skip
            assert run.returncode == 0, run.stderr

        return self.built("cli_run", list(overrides), build) / "lns"
