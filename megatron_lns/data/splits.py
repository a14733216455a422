"""Documents and tokens per train/valid/test split, counted as megatron-core counts them,
and checked before any ``GPTDataset`` is built.

megatron's ``GPTDataset`` repeats a split's documents epoch after epoch until it holds
the samples asked for; a split that gets no tokens never gets there and loops forever at
100% CPU (a small corpus with ``949,50,1`` or ``998,2,0``). An unweighted blend of
several prefixes takes exactly one pass over each, and a prefix whose split is shorter
than one sample fails an assertion deep in ``BlendedDataset``. Both are refused here
with the prefix, the split and what to do.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_lns.data.errors import DataError
from megatron_lns.data.index_file import sequence_lengths

SplitMatrix = Sequence[tuple[float, float] | None]
SPLITS = ("train", "valid", "test")  # megatron.core.datasets.utils.Split, in order


class DatasetSplitError(DataError):
    """A split string, or a split of one dataset, that megatron cannot build samples from."""


@dataclass(frozen=True)
class SplitShare:
    """The documents one split takes from one prefix: ``[begin, end)`` of its documents."""

    split: str
    begin: int
    end: int
    tokens: int

    @property
    def documents(self) -> int:
        return self.end - self.begin


def split_weights(split: str) -> list[float] | None:
    """The normalised weights of a split string as megatron-core's
    ``parse_and_normalize_split`` reads it (numbers in order, missing ones 0), or None
    where megatron cannot use it (more than three, or none positive)."""
    try:
        weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    except ValueError:  # a lone "."
        return None
    weights += [0.0] * (len(SPLITS) - len(weights))
    total = sum(weights)
    if len(weights) != len(SPLITS) or total <= 0:
        return None
    return [w / total for w in weights]


def split_bookends(split: str, num_samples: Sequence[int]) -> list[tuple[float, float] | None]:
    """The document bookends of each split megatron builds for a run that draws
    ``num_samples`` (train, valid, test): those of megatron-core's
    ``convert_split_vector_to_split_matrix``, None for a split with no weight or no samples."""
    weights = split_weights(split)
    if weights is None:
        raise DatasetSplitError(f"split '{split}' is not up to three non-negative weights")
    matrix: list[tuple[float, float] | None] = []
    begin = 0.0
    for weight, samples in zip(weights, num_samples, strict=True):
        end = begin + weight
        matrix.append((begin, end) if end > begin and samples else None)
        begin = end
    return matrix


def check_split_string(split: str) -> None:
    """A ``train,valid,test`` weight string megatron can parse, with a training share."""
    weights = split_weights(split)
    if weights is None or weights[0] <= 0:
        raise DatasetSplitError(
            f"split '{split}' must be up to three non-negative weights 'train,valid,test' "
            "with a positive train weight, e.g. '949,50,1'"
        )


def document_range(num_documents: int, bookends: tuple[float, float]) -> tuple[int, int]:
    """The documents ``[begin, end)`` a split with these bookends takes, rounded exactly as
    ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`` rounds them."""
    begin, end = bookends
    return round(begin * float(num_documents)), round(end * float(num_documents))


def split_shares(
    sequence_lengths: np.ndarray, split_matrix: SplitMatrix
) -> list[SplitShare | None]:
    """What each split takes from one prefix (``None``: the split is not built)."""
    shares: list[SplitShare | None] = []
    for split, bookends in zip(SPLITS, split_matrix, strict=True):
        if bookends is None:
            shares.append(None)
            continue
        begin, end = document_range(len(sequence_lengths), bookends)
        tokens = int(np.sum(sequence_lengths[begin:end], dtype=np.int64))
        shares.append(SplitShare(split, begin, end, tokens))
    return shares


def samples_in_split(
    prefixes: Sequence[str],
    split_string: str,
    split: str,
    seq_length: int,
    add_extra_token: bool = True,
) -> int:
    """The distinct samples one pass over ``split`` of ``prefixes`` holds: what megatron's
    ``GPTDataset`` makes of each prefix's share per epoch, summed over the blend (more
    samples than that repeat the split)."""
    matrix = split_bookends(split_string, [1] * len(SPLITS))
    total = 0
    for prefix in prefixes:
        share = split_shares(sequence_lengths(prefix), matrix)[SPLITS.index(split)]
        if share is not None:
            total += max(0, (share.tokens - int(add_extra_token)) // seq_length)
    return total


def _documents_needed(num_documents: int, bookends: tuple[float, float]) -> int | None:
    """The smallest corpus (above ``num_documents``) in which the split gets a document."""
    for n in range(num_documents + 1, num_documents + 100_000):
        begin, end = document_range(n, bookends)
        if end > begin:
            return n
    return None


def check_split_shares(
    prefixes: Sequence[str],
    split: str,
    split_matrix: SplitMatrix,
    one_pass_per_prefix: bool,
    seq_length: int,
    add_extra_token: bool = True,
) -> None:
    """Refuse a built split that gets no tokens from a prefix, before megatron loops on it.

    ``one_pass_per_prefix`` is megatron's unweighted blend of several prefixes: each
    split then also needs one whole sample (``seq_length`` + 1 tokens) from every prefix.
    """
    for prefix in prefixes:
        lengths = sequence_lengths(prefix)
        for share, bookends in zip(split_shares(lengths, split_matrix), split_matrix, strict=True):
            if share is None or bookends is None:
                continue
            where = f"the {share.split} split of {prefix} (split '{split}')"
            if share.documents == 0:
                needed = _documents_needed(len(lengths), bookends)
                more = f"at least {needed} documents" if needed else "more documents"
                raise DatasetSplitError(
                    f"{where} gets 0 of its {len(lengths)} documents and megatron would loop "
                    f"forever building it: give {more}, or a larger {share.split} share "
                    "(e.g. split '90,10,0')"
                )
            if share.tokens == 0:
                raise DatasetSplitError(
                    f"{where} gets {share.documents} documents that hold no tokens and megatron "
                    "would loop forever building it: re-preprocess the data or change the split"
                )
            sample = seq_length + int(add_extra_token)
            if one_pass_per_prefix and share.tokens < sample:
                raise DatasetSplitError(
                    f"{where} holds {share.tokens} tokens, less than one sample of {sample}, "
                    "and an unweighted blend reads each prefix once: give the blend weights "
                    "(e.g. [0.5, a, 0.5, b]), more documents, or a larger share"
                )
