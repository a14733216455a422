"""The embedded demo corpus: English prose that ships with every CPython.

``pydoc_data.topics`` holds the text of the Python language reference (about 0.7M
characters), so the demo needs no download. Tokens are UTF-8 bytes (ids 0-255)
with an end-of-document id after each topic: a tokenizer with nothing to train and
nothing to get wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BYTE_VOCAB_SIZE = 256
EOD_ID = 256
VOCAB_SIZE = BYTE_VOCAB_SIZE + 1


def demo_documents() -> list[str]:
    """Every topic of ``pydoc_data.topics``, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def encode_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_bytes(ids: list[int]) -> str:
    return bytes(i for i in ids if i < BYTE_VOCAB_SIZE).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenSplits:
    train: np.ndarray
    valid: np.ndarray


def demo_token_splits(valid_fraction: float = 0.05) -> TokenSplits:
    """Byte tokens of the corpus; the last ``valid_fraction`` of the stream is held out."""
    ids: list[int] = []
    for doc in demo_documents():
        ids.extend(encode_bytes(doc))
        ids.append(EOD_ID)
    tokens = np.asarray(ids, dtype=np.int64)
    split = int(len(tokens) * (1 - valid_fraction))
    return TokenSplits(train=tokens[:split], valid=tokens[split:])


class RandomWindows:
    """Random ``seq_length + 1`` token windows from a token stream, reproducibly seeded."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int) -> None:
        if len(tokens) <= seq_length + 1:
            raise ValueError(
                f"corpus of {len(tokens)} tokens is too short for seq_length {seq_length}"
            )
        self.tokens = torch.from_numpy(tokens)
        self.seq_length = seq_length
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, batch_size: int) -> torch.Tensor:
        high = len(self.tokens) - self.seq_length - 1
        starts = torch.randint(0, high, (batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_length + 1)
        return self.tokens[starts[:, None] + offsets[None, :]]
