"""The tokenizer of an export: ``AutoTokenizer`` must give the ids the run trained on.

* byte (the built-in tokenizer: UTF-8 bytes are ids 0-255, id 256 ends a document):
  written as a ``tokenizers`` byte-level BPE with no merges, so every byte is its own
  token with its own id; the end-of-document token is special, and text that happens
  to spell it is still split into bytes (``split_special_tokens``), as in training.
* huggingface: the tokenizer files of ``model.tokenizer.type`` are copied as they are.
* sentencepiece: a ``tokenizer.json`` converted from the ``.model`` file
  (``hf_sentencepiece.py``) that encodes as ``SentencePieceProcessor.encode``, without
  added BOS/EOS; what it cannot reproduce fails the check below.

Whatever the library, the export is checked before it is committed: the written
tokenizer must encode probe texts (unicode, whitespace, the demo corpus) to the
training tokenizer's ids, and its EOS must be the training end-of-document id.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.config.schema import TokenizerConfig
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.hf_sentencepiece import sentencepiece_tokenizer_fast
from megatron_lns.data.tokenizer import Tokenizer, build_tokenizer

BYTE_EOD_TOKEN = "<|endoftext|>"
# Files that make up a Hugging Face tokenizer directory.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
PROBE_TEXTS = (
    "Hello, world!",
    "  two leading spaces, a tab\tand a newline\n",
    "unicode: héllo wörld, 日本語, emoji 😀",
    f"text that spells the end token {BYTE_EOD_TOKEN} inside it",
    # Whitespace that SentencePiece's normalizer removes or keeps, a literal dummy prefix,
    # and text spelling SentencePiece's control and byte pieces, which it never matches.
    "trailing spaces   ",
    "   ",
    "\n\tafter a newline and a tab, then  two   runs of spaces",
    "▁a literal dummy prefix",
    "<s> </s> <unk> <pad> <0x41> are text, not tokens",
    "digits 1234567890 and 3.14159; full-width \uff46\uff55\uff4c\uff4c and ligature \ufb01",
)


@dataclass(frozen=True)
class TokenizerIds:
    vocab_size: int
    bos: int | None
    eos: int
    # Set when probe texts come out as the training's pieces in another order (Unigram
    # ties, see hf_sentencepiece.py): accepted, and said, not refused.
    warning: str | None = None


def training_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer the run trained with, as its config names it."""
    try:
        return build_tokenizer(cfg.library, cfg.type, cfg.model)
    except Exception as err:  # tokenizer libraries raise many types for a bad directory
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConversionError(f"model.tokenizer ({cfg.library}): {message}") from err


def byte_tokenizer_fast():
    """The built-in byte tokenizer as a ``transformers`` fast tokenizer."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # The byte-level pre-tokenizer shows byte b as the printable character
    # bytes_to_unicode()[b] (GPT-2's table); that character gets id b.
    byte_chars = bytes_to_unicode()
    backend = RustTokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(BYTE_EOD_TOKEN, special=True, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=BYTE_EOD_TOKEN,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )


def write_tokenizer(
    cfg: TokenizerConfig,
    trained: Tokenizer,
    out_dir: Path,
    probes: list[str],
) -> TokenizerIds:
    """Write the export's tokenizer files into ``out_dir``; check them against ``trained``."""
    if cfg.library == "byte":
        _save_fast(byte_tokenizer_fast(), out_dir)
    elif cfg.library == "huggingface":
        source = Path(cfg.type)
        files = [source / name for name in HF_TOKENIZER_FILES if (source / name).is_file()]
        if not files:
            raise ConversionError(f"model.tokenizer.type: no tokenizer files in {source}")
        for path in files:
            shutil.copy2(path, out_dir / path.name)
    elif cfg.library == "sentencepiece":
        _save_fast(sentencepiece_tokenizer_fast(Path(cfg.model)), out_dir)
    else:
        raise ConversionError(f"model.tokenizer.library={cfg.library} cannot be exported")
    return check_tokenizer(out_dir, trained, probes)


def _save_fast(tokenizer, out_dir: Path) -> None:
    """Save a ``PreTrainedTokenizerFast`` so that transformers 4.x and 5 both load it.

    transformers 5 names its tokenizers-backed class TokenizersBackend, which 4.x does
    not know; both versions load PreTrainedTokenizerFast.
    """
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def check_tokenizer(out_dir: Path, trained: Tokenizer, probes: list[str]) -> TokenizerIds:
    """Load ``out_dir`` with ``AutoTokenizer``; refuse it unless it encodes like ``trained``."""
    from transformers import AutoTokenizer

    try:
        exported = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    except Exception as err:
        raise ConversionError(f"the exported tokenizer does not load: {err}") from err
    exported.model_max_length = 2**62  # probes are documents, not model inputs: no warning
    reordered = []
    texts = [*PROBE_TEXTS, *probes]
    for text in texts:
        got = exported(text, add_special_tokens=False)["input_ids"]
        want = trained.encode(text)
        if got != want and sorted(got) == sorted(want):
            # The same multiset of pieces has the same total score: an exact tie, which
            # SentencePiece and tokenizers each break by their own rounding.
            reordered.append((text, _first_difference(exported, got, want)))
        elif got != want:
            raise ConversionError(
                f"the exported tokenizer encodes {text[:40]!r} unlike training: "
                f"{_first_difference(exported, got, want)}; transformers does not reproduce "
                "this tokenizer: export with --no-tokenizer and supply one that does"
            )
    if exported.eos_token_id != trained.eod:
        raise ConversionError(
            f"the exported tokenizer's eos id is {exported.eos_token_id}, training ended "
            f"documents with id {trained.eod}"
        )
    if len(exported) != trained.vocab_size:
        raise ConversionError(
            f"the exported tokenizer has {len(exported)} tokens, training had {trained.vocab_size}"
        )
    warning = None
    if reordered:
        text, difference = reordered[0]
        warning = (
            f"the exported tokenizer orders tied Unigram pieces unlike SentencePiece in "
            f"{len(reordered)} of {len(texts)} probe texts (first: {text[:40]!r}, {difference}): "
            "tied pieces come out in another order (docs/conversion.md, 'Unigram ties'); "
            "--no-tokenizer exports without it"
        )
    return TokenizerIds(len(exported), exported.bos_token_id, exported.eos_token_id, warning)


def _first_difference(exported, got: list[int], want: list[int]) -> str:
    """Where two id lists part, with the pieces on each side, for the refusal message."""
    same = [a == b for a, b in zip(got, want, strict=False)]
    at = same.index(False) if False in same else len(same)
    ours, theirs = got[at : at + 6], want[at : at + 6]
    return (
        f"from token {at}, ids {ours} {exported.convert_ids_to_tokens(ours)} where training "
        f"has {theirs} {exported.convert_ids_to_tokens(theirs)}"
    )
