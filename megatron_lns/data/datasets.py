"""megatron ``GPTDataset`` splits through ``BlendedMegatronDatasetBuilder``, and the
per-data-parallel-rank micro-batch stream that feeds the training loop.

Sample order is a pure function of (seed, blend, split, sequence length, sample
count), and the loader position is one integer (``consumed_samples``), so a resumed
run sees exactly the samples the uninterrupted run would have seen.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_lns.data.blend import DataBlend
from megatron_lns.data.errors import DataError
from megatron_lns.data.metadata import DatasetMetadata
from megatron_lns.data.splits import (
    DatasetSplitError,
    check_split_shares,
    check_split_string,
    split_weights,
)
from megatron_lns.data.tokenizer import Tokenizer, build_tokenizer


class DataMismatchError(DataError):
    """A dataset that does not belong to this tokenizer or model vocabulary."""


def check_dataset_fits(prefix: str, tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Refuse data made with another tokenizer or with ids the model cannot embed."""
    metadata = DatasetMetadata.load(prefix)
    if metadata is not None:
        mismatch = metadata.tokenizer_mismatch(prefix, tokenizer.name, tokenizer.vocab_size)
        if mismatch:
            raise DataMismatchError(mismatch)
        max_id = metadata.max_token_id
    else:
        # Prepared elsewhere (e.g. Megatron-LM's tools): scan the memory-mapped tokens.
        tokens = np.memmap(f"{prefix}.bin", dtype=IndexedDataset(prefix).index.dtype, mode="r")
        max_id = int(tokens.max()) if tokens.size else -1
    if max_id >= model_vocab_size:
        raise DataMismatchError(
            f"dataset {prefix} contains token id {max_id}, which does not fit the model's "
            f"vocabulary of {model_vocab_size} (tokenizer vocab {tokenizer.vocab_size})"
        )


def index_fingerprint(prefix: str) -> str:
    """A hash of ``PREFIX.idx``: the document lengths megatron's index mappings are built from.

    The document, sample and shuffle indices depend on the data only through ``.idx``
    (tokens are read from ``.bin`` when a sample is drawn), so a hash of ``.idx`` is
    exactly what a cached mapping must match; size and mtime are not content.
    """
    try:
        with open(f"{prefix}.idx", "rb") as f:
            return hashlib.file_digest(f, "blake2b").hexdigest()[:32]
    except OSError as err:
        raise DataError(f"cannot read {prefix}.idx: {err.strerror}") from None


@dataclass
class ContentKeyedGPTDatasetConfig(GPTDatasetConfig):
    """``GPTDatasetConfig`` plus the ``.idx`` fingerprint of every prefix in the blend."""

    data_fingerprints: dict[str, str] = field(default_factory=dict)


class ContentKeyedGPTDataset(GPTDataset):
    """megatron's ``GPTDataset`` whose cache key includes the data's content.

    megatron names its cached index mappings by a hash of the dataset path, seed, split,
    sequence length and tokenizer: re-preprocessing a prefix in place would reuse
    mappings built for the old documents. Adding ``data_fingerprints`` to the key
    attributes puts the content of the blend's ``.idx`` files in that hash, both under
    ``path_to_cache`` and in megatron's default cache next to the data.
    """

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return [*GPTDataset._key_config_attributes(), "data_fingerprints"]

    def _build_document_sample_shuffle_indices(self):
        """megatron's, with a cache file cut short (a run killed while writing it) named."""
        cache = self.config.path_to_cache or os.path.join(
            self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices"
        )
        files = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}-*"
        # Only a mapping read from the cache can be blamed on it; building one fails for
        # other reasons (megatron's ValueError for a seed numpy refuses, once blamed here).
        cached = bool(glob.glob(os.path.join(glob.escape(cache), files)))
        try:
            return super()._build_document_sample_shuffle_indices()
        except (ValueError, EOFError, OSError) as err:
            if not cached:
                raise
            raise DataError(
                f"cannot read the cached index mapping {os.path.join(cache, files)} of "
                f"{self.dataset_path} ({err}); a run stopped while writing it leaves it cut "
                "short: delete those files and start again"
            ) from None


@dataclass
class DataSplits:
    train: GPTDataset | None  # None only when built held_out_only
    valid: GPTDataset | None
    test: GPTDataset | None = None


def build_gpt_datasets(
    prefixes: list[str],
    weights: list[float] | None,
    split: str,
    seq_length: int,
    tokenizer: Tokenizer,
    seed: int,
    num_train_samples: int,
    num_valid_samples: int,
    cache_dir: str | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    num_test_samples: int = 0,
    held_out_only: bool = False,
) -> DataSplits:
    """Train/valid/test ``GPTDataset``s (blended with ``weights``, split by ``split``).

    A split the run draws no samples from is not built (``None``): megatron would index
    it anyway, and loop forever on one that has no documents. Every built split is
    checked to get tokens from every prefix before megatron starts. ``held_out_only``
    (with no training samples) builds no training split and accepts a split string that
    gives training no share, as ``analyze`` reads only held-out data.
    """
    if held_out_only:
        if num_train_samples:
            raise ValueError("held_out_only builds no training split: ask for 0 training samples")
        if split_weights(split) is None:
            raise DatasetSplitError(
                f"split '{split}' must be up to three non-negative weights 'train,valid,test'"
            )
    else:
        check_split_string(split)
    config = ContentKeyedGPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(list(prefixes), None if weights is None else list(weights)),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
        data_fingerprints={prefix: index_fingerprint(prefix) for prefix in prefixes},
    )
    sizes = [num_train_samples, num_valid_samples, num_test_samples]
    config.split_matrix = [
        None if size == 0 else bookends
        for bookends, size in zip(config.split_matrix, sizes, strict=True)
    ]
    check_split_shares(
        prefixes,
        split,
        config.split_matrix,
        one_pass_per_prefix=weights is None and len(prefixes) > 1,
        seq_length=seq_length,
        add_extra_token=config.add_extra_token_to_sequence,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        ContentKeyedGPTDataset, sizes, lambda: True, config
    ).build()
    if train is None and not held_out_only:
        raise DatasetSplitError(
            f"no training data: the split '{split}' gives the train split no share, or the "
            f"run asks for {num_train_samples} training samples"
        )
    return DataSplits(train=train, valid=valid, test=test)


@dataclass(frozen=True)
class DatasetSettings:
    """Everything that decides which samples a run sees, in which order."""

    blend: DataBlend
    split: str
    seq_length: int
    seed: int
    cache_dir: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def build(
        self,
        tokenizer_spec: tuple[str, str | None, str | None],
        model_vocab_size: int,
        num_samples: tuple[int, int, int],
        held_out_only: bool = False,
    ) -> DataSplits:
        """The train/valid/test datasets: built-in corpora prepared, every file checked
        against the tokenizer and the model's vocabulary, then megatron's ``GPTDataset``s.

        ``tokenizer_spec`` is (library, type, model) as in ``model.tokenizer``;
        ``num_samples`` the (train, valid, test) sample counts the run will draw.
        """
        tokenizer = build_tokenizer(*tokenizer_spec)
        blend = self.blend.resolved(*tokenizer_spec)
        for prefix in blend.prefixes:
            check_dataset_fits(prefix, tokenizer, model_vocab_size)
        return build_gpt_datasets(
            list(blend.prefixes),
            None if blend.weights is None else list(blend.weights),
            self.split,
            self.seq_length,
            tokenizer,
            self.seed,
            num_train_samples=num_samples[0],
            num_valid_samples=num_samples[1],
            num_test_samples=num_samples[2],
            cache_dir=self.cache_dir,
            reset_position_ids=self.reset_position_ids,
            reset_attention_mask=self.reset_attention_mask,
            eod_mask_loss=self.eod_mask_loss,
            held_out_only=held_out_only,
        )


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in keys}
    batch["loss_mask"] = batch["loss_mask"].float()
    return batch


class PretrainingBatchSampler:
    """Index lists of one data-parallel rank's micro-batches, from ``consumed_samples`` on.

    Within each draw of ``M * D`` samples (``M`` micro batch size, ``D`` data-parallel
    size), rank ``r`` takes ``[r*M, (r+1)*M)``: the layout of Megatron-LM's pretraining
    sampler. A step of ``k`` micro-batches per rank therefore consumes the next ``k*M*D``
    samples in order, whatever ``k`` is (a batch-size ramp-up changes it between steps).
    The position is a single integer, which is what a checkpoint stores.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_size: int,
        data_parallel_rank: int,
    ) -> None:
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_size = data_parallel_size
        self.dp_rank = data_parallel_rank

    def __iter__(self) -> Iterator[list[int]]:
        position = self.consumed_samples
        while True:
            start = position + self.dp_rank * self.micro_batch_size
            yield [(start + i) % self.total_samples for i in range(self.micro_batch_size)]
            position += self.micro_batch_size * self.dp_size


def micro_batch_loader(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_size: int,
    data_parallel_rank: int,
    num_workers: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """An endless iterator of this rank's micro-batches (``torch`` DataLoader workers)."""
    sampler = PretrainingBatchSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_size, data_parallel_rank
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=_collate,
        persistent_workers=num_workers > 0,
    )
    return iter(loader)


def held_out_batches(
    dataset: torch.utils.data.Dataset,
    num_batches: int,
    micro_batch_size: int,
    num_microbatches: int,
    data_parallel_size: int,
    data_parallel_rank: int,
) -> Iterator[list[dict[str, torch.Tensor]]]:
    """The first ``num_batches`` global batches of ``dataset``, one global batch (this
    rank's ``num_microbatches`` micro-batches) at a time; every call yields the same."""
    loader = micro_batch_loader(
        dataset, 0, micro_batch_size, data_parallel_size, data_parallel_rank, 0
    )
    for _ in range(num_batches):
        yield [next(loader) for _ in range(num_microbatches)]
