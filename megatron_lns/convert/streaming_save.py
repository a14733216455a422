"""megatron's ``torch_dist`` save of a model whose weights are made one group at a time.

``import-hf`` must write a checkpoint that training, ``analyze`` and ``export-hf`` read
as any other, without holding the model: a 7B model in fp32 is larger than many
machines' memory. megatron's ``dist_checkpointing.save`` takes the whole sharded state
dict at once, and its writer (``FileSystemWriterAsync.prepare_write_data``) resolves
every tensor before it writes the first. Only that last step is replaced here.

The model is built on the meta device, so its sharded state dict (keys, global shapes,
offsets, the SwiGLU split of ``linear_fc1``, the ``_extra_state`` objects, the common
state) is megatron's own and costs no memory. :class:`StreamingSaveStrategy` is
megatron's ``TorchDistSaveShardedStrategy`` (so ``dist_checkpointing.save`` runs its own
preprocessing, validation and ``metadata.json``) with the same translation to PyTorch
DCP, megatron's planner and megatron's finalisation (``.metadata``); its writer hands
megatron's file writer (``write_preloaded_data``, unchanged) the tensor items as a lazy
sequence in group order. Each item is a view of one parameter, so the first item of a
group asks ``produce(group)`` for all of that group's parameters (the previous group's
are dropped first), and the item's bytes are the same view of the real tensor. Peak
memory is one group's tensors plus one item being serialised.

The files are what megatron's writer would write from the same state dict, in another
order within the file: the ``.metadata`` records each item's offset, so the order is
not part of the format (``tests/convert/test_hf_import.py`` compares the two).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    FileSystemWriterAsync,
    get_write_results_queue,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

# Group index -> {parameter name: tensor} for every parameter of that group.
Producer = Callable[[int], dict[str, torch.Tensor]]


class GroupedParameters:
    """The real values of a meta model's parameters, one group at a time.

    ``group_of(name)`` says which group makes parameter ``name``; groups must be asked
    for in increasing order, each once, so at most one is held.
    """

    def __init__(
        self, model: torch.nn.Module, group_of: Callable[[str], int], produce: Producer
    ) -> None:
        self.params = dict(model.named_parameters())
        self.group_of = {name: group_of(name) for name in self.params}
        self.produce = produce
        self.current: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.written: set[str] = set()
        # The first error raised while making a tensor: megatron's writer reports it
        # wrapped in a CheckpointException, the strategy raises it as it was.
        self.failure: BaseException | None = None

    def tensor(self, name: str) -> torch.Tensor:
        group = self.group_of[name]
        if group != self.current:
            if self.current is not None and group < self.current:
                raise AssertionError(f"group {group} asked for again after group {self.current}")
            self.tensors = {}  # dropped before the next group is made
            self.current = group
            self.tensors = self._checked(group, self.produce(group))
        self.written.add(name)
        return self.tensors[name]

    def _checked(self, group: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expected = {name for name, g in self.group_of.items() if g == group}
        if tensors.keys() != expected:
            raise AssertionError(
                f"group {group} made {sorted(tensors.keys() ^ expected)[:3]} unlike the model"
            )
        out = {}
        for name, tensor in tensors.items():
            param = self.params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise AssertionError(
                    f"'{name}' would get shape {tuple(tensor.shape)}, the model has "
                    f"{tuple(param.shape)}"
                )
            out[name] = tensor.to(param.dtype).contiguous()
        return out

    def unwritten(self) -> list[str]:
        return sorted(set(self.params) - self.written)


class _View:
    """Where a checkpoint item's data lies in its parameter: the meta tensor megatron
    saves for it is a view of the parameter, and the same view of the real tensor is
    the item's data."""

    def __init__(self, name: str, data: torch.Tensor) -> None:
        self.name = name
        self.size, self.stride, self.offset = data.size(), data.stride(), data.storage_offset()

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.as_strided(self.size, self.stride, self.offset)


class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's ``torch_dist`` save strategy for a meta model whose parameters'
    values come from ``parameters`` one group at a time (single process)."""

    def __init__(self, parameters: GroupedParameters) -> None:
        super().__init__()
        self.parameters = parameters
        self.names = {id(param): name for name, param in parameters.params.items()}

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        try:
            super().save(sharded_state_dict, checkpoint_dir)
        except BaseException:
            if self.parameters.failure is not None:
                raise self.parameters.failure from None
            raise

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy="mcore"):
        """``TorchDistSaveShardedStrategy.async_save`` with megatron's own writer: the
        same translation, planner and finalisation, the streaming writer."""
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        views = {
            (key, tuple(shard.global_offset)): self._view(shard)
            for key, shards in by_key.items()
            for shard in shards
            if isinstance(shard, ShardedTensor)
        }
        pyt_state_dict = mcore_to_pyt_state_dict(by_key, False)
        writer = _StreamingWriter(checkpoint_dir, self.parameters, views)
        planned = save_state_dict_async_plan(
            pyt_state_dict,
            writer,
            None,
            0,
            planner=MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica,
                flatten_state_dict=False,
                flatten_sharded_tensors=False,
            ),
        )
        return self._get_save_and_finalize_callbacks(writer, planned[0], "mcore")

    def _view(self, shard: ShardedTensor) -> _View:
        if shard.flattened_range is not None:
            raise AssertionError(f"{shard.key}: flattened shards are not streamed")
        base = shard.data if shard.data._base is None else shard.data._base
        if id(base) not in self.names:
            raise AssertionError(f"{shard.key} is no view of a parameter of the model")
        return _View(self.names[id(base)], shard.data)


class _StreamingWriter(FileSystemWriterAsync):
    """megatron's file writer, given its tensors lazily and in group order."""

    def __init__(self, path, parameters: GroupedParameters, views: dict) -> None:
        super().__init__(path, thread_count=1)
        self.parameters = parameters
        self.views = views

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        bytes_data = [
            (item, planner.resolve_data(item))
            for item in plan.items
            if item.type == WriteItemType.BYTE_IO
        ]
        tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        tensors.sort(key=lambda item: self.parameters.group_of[self._view(item).name])
        file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        lazy = _LazyTensors(tensors, self)
        self.write_buckets = [
            (os.path.join(self.checkpoint_dir, file_name), file_name, (bytes_data, lazy))
        ]
        self.results_queue = get_write_results_queue()

    def get_save_function_and_args(self):
        save, _stage_all_tensors, args = super().get_save_function_and_args()
        return save, None, args

    def _view(self, item: WriteItem) -> _View:
        return self.views[(item.index.fqn, tuple(item.index.offset))]

    def data(self, item: WriteItem) -> torch.Tensor:
        view = self._view(item)
        tensor = view.of(self.parameters.tensor(view.name))
        sizes = item.tensor_data.chunk.sizes  # with the layer axis megatron prepends
        if tensor.numel() != sizes.numel():
            raise AssertionError(f"{item.index}: {tuple(tensor.shape)} is no chunk {sizes}")
        tensor = tensor.reshape(sizes)
        # torch.save writes a view's whole storage: a view that is part of one is copied.
        whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        return tensor if whole and tensor.is_contiguous() else tensor.clone()


class _LazyTensors:
    """``(item, tensor)`` pairs made as megatron's writer iterates over them."""

    def __init__(self, items: list[WriteItem], writer: _StreamingWriter) -> None:
        self.items = items
        self.writer = writer

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[tuple[WriteItem, torch.Tensor]]:
        for item in self.items:
            try:
                tensor = self.writer.data(item)
            except BaseException as err:
                self.writer.parameters.failure = self.writer.parameters.failure or err
                raise
            yield item, tensor
