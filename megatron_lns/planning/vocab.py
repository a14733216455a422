"""What ``plan`` reads besides the config: the config itself with its unset inputs
filled, and the tokenizer's vocabulary size, without loading a tokenizer library."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_lns.base.errors import UserError
from megatron_lns.config.schema import ExperimentConfig

BYTE_VOCAB = 257  # megatron_lns.data.tokenizer's byte tokenizer: 256 bytes + EOD
# When the tokenizer cannot be read here (not given, or a SentencePiece model): the
# GPT-NeoX / OLMo tokenizer's size, which the bundled 7B configs use. Stated in the
# output as an assumption; --vocab-size replaces it.
ASSUMED_VOCAB = 50280


class UnreadableTokenizerError(UserError):
    pass


# The run's inputs cost no GPU memory: where a config leaves them unset (``???``), plan
# fills them with these placeholders so that it can be planned before the data exists.
PLACEHOLDERS = {
    "model.data.data_prefix": ["unused"],
    "model.tokenizer.type": "unused",
    "model.tokenizer.model": "unused",
}


def load_for_plan(
    source: str | Path, overrides: list[str] | None = None, nodes: int | None = None
) -> ExperimentConfig:
    """The config as ``train`` loads it (through the same loader, so that it refuses the
    same inputs the same way), with the placeholders for the inputs it leaves unset (the
    user's overrides win over them) and ``--nodes``, set last so that it also holds
    over a whole ``trainer={...}`` override (``plan`` refuses an override of
    ``trainer.num_nodes`` itself given with it)."""
    from megatron_lns.config.sources import load_run_config

    nodes_override = [f"trainer.num_nodes={nodes}"] if nodes is not None else []
    cfg = load_run_config(source, [*(overrides or []), *nodes_override], PLACEHOLDERS)
    _drop_unread_tokenizer_placeholder(cfg)
    return cfg


def _drop_unread_tokenizer_placeholder(cfg: ExperimentConfig) -> None:
    """A placeholder in the tokenizer file of another library than the one the run uses
    (llama_130m's ``model: ???`` planned with ``model.tokenizer.library=huggingface``)
    stands in for no input: it is dropped, as validate refuses a file the library does
    not read."""
    from megatron_lns.data.tokenizer import TOKENIZER_FILE_FIELD

    tokenizer = cfg.model.tokenizer
    for library, field in TOKENIZER_FILE_FIELD.items():
        placeholder = PLACEHOLDERS[f"model.tokenizer.{field}"]
        if tokenizer.library != library and getattr(tokenizer, field) == placeholder:
            setattr(tokenizer, field, None)


def vocab_size_of(cfg: ExperimentConfig, given: int | None = None) -> tuple[int, str]:
    """The tokenizer's vocabulary size and where it came from."""
    if given is not None:
        return given, "--vocab-size"
    tokenizer = cfg.model.tokenizer
    if tokenizer.library == "byte":
        return BYTE_VOCAB, "the byte tokenizer"
    if tokenizer.library == "huggingface" and tokenizer.type:
        size = _huggingface_vocab(Path(tokenizer.type))
        if size:
            return size, f"{tokenizer.type}/tokenizer.json"
    return ASSUMED_VOCAB, "ASSUMED: the tokenizer is not readable here; pass --vocab-size"


def _huggingface_vocab(directory: Path) -> int | None:
    """The token ids a Hugging Face tokenizer.json defines (its vocabulary and added
    tokens), read as JSON."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        vocab = (data.get("model") or {}).get("vocab") or {}
        # BPE / WordPiece: token -> id; Unigram: a list of [token, score], ids by position.
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [token["id"] for token in data.get("added_tokens", [])]
        return max(ids) + 1 if ids else None
    except (ValueError, AttributeError, TypeError, KeyError) as error:
        raise UnreadableTokenizerError(
            f"{path}: not a Hugging Face tokenizer.json ({type(error).__name__}: {error}); "
            "pass --vocab-size N to plan without reading it"
        ) from None
