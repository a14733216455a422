"""megatron ``GPTDataset`` splits through ``BlendedMegatronDatasetBuilder``, and the
per-data-parallel-rank micro-batch stream that feeds the training loop.

Sample order is a pure function of (seed, blend, split, sequence length, sample
count), and the loader position is one integer (``consumed_samples``), so a resumed
run sees exactly the samples the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_lns.data.blend import DataBlend
from megatron_lns.data.preprocess import DatasetMetadata
from megatron_lns.data.tokenizer import Tokenizer, build_tokenizer
from megatron_lns.errors import UserError


class DataMismatchError(UserError, ValueError):
    """A dataset that does not belong to this tokenizer or model vocabulary."""


def check_dataset_fits(prefix: str, tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Refuse data made with another tokenizer or with ids the model cannot embed."""
    metadata = DatasetMetadata.load(prefix)
    if metadata is not None:
        if metadata.tokenizer != tokenizer.name or metadata.vocab_size != tokenizer.vocab_size:
            raise DataMismatchError(
                f"dataset {prefix} was tokenized with {metadata.tokenizer} (vocab "
                f"{metadata.vocab_size}) but model.tokenizer is {tokenizer.name} (vocab "
                f"{tokenizer.vocab_size})"
            )
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


@dataclass
class DataSplits:
    train: GPTDataset
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
) -> DataSplits:
    """Train/valid/test ``GPTDataset``s (blended with ``weights``, split by ``split``)."""
    config = GPTDatasetConfig(
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
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_train_samples, num_valid_samples, num_test_samples], lambda: True, config
    ).build()
    if train is None:
        raise ValueError(f"the split '{split}' leaves no training data in {prefixes}")
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
        )


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in keys}
    batch["loss_mask"] = batch["loss_mask"].float()
    return batch


class PretrainingBatchSampler:
    """Index lists of one data-parallel rank's micro-batches, from ``consumed_samples`` on.

    Within each step of ``M * D`` samples (``M`` micro batch size, ``D`` data-parallel
    size), rank ``r`` takes ``[r*M, (r+1)*M)``: the layout of Megatron-LM's pretraining
    sampler. The position is a single integer, which is what a checkpoint stores.
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
