"""``model.data`` and ``model.tokenizer``: the token stream the model trains on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lns.config.rules import (
    non_negative,
    one_of,
    positive,
    split_weights,
)
from megatron_lns.config.settings import HF_CONVERTER, setting
from megatron_lns.data.tokenizer import TOKENIZER_LIBRARIES


@dataclass
class DataConfig:
    data_prefix: list[Any] = setting(default_factory=list, target="GPTDatasetConfig.blend")
    """`[prefix, ...]` or `[weight, prefix, weight, prefix, ...]`: `GPTDatasetConfig.blend`;
    `builtin:pydoc` is the embedded demo corpus"""

    splits_string: str = setting("949,50,1", split_weights, target="GPTDatasetConfig.split")
    """train/valid/test document split, three non-negative numbers, the train weight positive
    (`GPTDatasetConfig.split`)"""

    seq_length: int = setting(
        512, positive, target="GPTDatasetConfig.sequence_length", resume="data"
    )
    """must equal `model.encoder_seq_length` (NeMo interpolates it)"""

    index_mapping_dir: str | None = setting(None, target="GPTDatasetConfig.path_to_cache")
    """where `BlendedMegatronDatasetBuilder` caches its index mappings (`path_to_cache`)"""

    num_workers: int = setting(2, non_negative)
    """`torch` DataLoader workers per rank"""

    reset_position_ids: bool = setting(False, target="GPTDatasetConfig")
    """`GPTDatasetConfig.reset_position_ids`"""

    reset_attention_mask: bool = setting(False, target="GPTDatasetConfig")
    """`GPTDatasetConfig.reset_attention_mask`"""

    eod_mask_loss: bool = setting(False, target="GPTDatasetConfig")
    """`GPTDatasetConfig.eod_mask_loss`"""


@dataclass
class TokenizerConfig:
    library: str = setting("byte", one_of(TOKENIZER_LIBRARIES), shapes=True, hf=HF_CONVERTER)
    """`byte` (UTF-8 bytes + EOD, vocab 257), `huggingface`, `sentencepiece`"""

    type: str | None = setting(None, shapes=True, resume="tensors", hf=HF_CONVERTER)
    """`huggingface` only: a local tokenizer directory (never downloaded)"""

    model: str | None = setting(None, shapes=True, resume="tensors", hf=HF_CONVERTER)
    """`sentencepiece` only: the `.model` file"""
