"""Read tensors, or parts of them, from a megatron ``torch_dist`` checkpoint.

``torch_dist`` is PyTorch Distributed Checkpoint (DCP) underneath: every tensor is
stored under its megatron key with its *global* shape, as the chunks the saving ranks
held (per-layer tensors are stacked on a leading layer axis, one chunk per layer and
tensor-parallel rank). So a checkpoint saved at any TP/PP/VP layout reads the same,
and one layer can be read without touching the others. Reading needs no process
group, no GPU and no model; DCP deserialises chunks with ``weights_only=True``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_lns.convert.errors import ConversionError
from megatron_lns.training.checkpoint_damage import read_failure, read_index
from megatron_lns.training.checkpoint_dirs import CheckpointError


class _RegionLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, except that each destination tensor is a region of the stored one.

    DCP's default plan reads a plain tensor as the whole stored tensor; here
    ``offsets[key]`` says where the destination starts, so only the chunks that
    overlap it are read.
    """

    def __init__(self, offsets: dict[str, Sequence[int]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, tensor in self.state_dict.items():
            region = ChunkStorageMetadata(
                offsets=torch.Size(self.offsets[key]), sizes=tensor.size()
            )
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [region]
            )
        return LoadPlan(items)

    def lookup_tensor(self, index) -> torch.Tensor:
        # The read items address the destination by the region's global offset, which
        # DCP only resolves for sharded tensors; each destination here is one region.
        return self.state_dict[index.fqn]


class CheckpointReader:
    """Global shapes and dtypes of a checkpoint's tensors, and reads of their regions."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        backend = self._backend()
        if backend != "torch_dist":
            raise ConversionError(
                f"{self.directory}: checkpoint format '{backend}' is not supported "
                "(megatron-lns writes torch_dist)"
            )
        try:
            metadata = read_index(self.directory)
        except CheckpointError as err:  # a missing or corrupt .metadata file
            raise ConversionError(str(err)) from None
        self._tensors = {
            key: md
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }

    def _backend(self) -> str:
        path = self.directory / "metadata.json"
        try:
            return json.loads(path.read_text())["sharded_backend"]
        except (OSError, ValueError, KeyError) as err:
            raise ConversionError(
                f"{path} is missing or unreadable: not a megatron checkpoint"
            ) from err

    def tensor_keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].properties.dtype

    def read(
        self, requests: dict[str, tuple[Sequence[int], Sequence[int]]]
    ) -> dict[str, torch.Tensor]:
        """``{key: (offsets, sizes)}`` -> the regions, read in one pass over the files."""
        for key in requests:
            if key not in self._tensors:
                raise ConversionError(f"{self.directory}: tensor '{key}' is not in the checkpoint")
        state = {
            key: torch.empty(tuple(sizes), dtype=self.dtype(key))
            for key, (_, sizes) in requests.items()
        }
        planner = _RegionLoadPlanner({key: offsets for key, (offsets, _) in requests.items()})
        try:
            with warnings.catch_warnings():
                # DCP warns that it runs without a process group: that is the intent here.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_load(
                    state_dict=state,
                    storage_reader=FileSystemReader(str(self.directory)),
                    planner=planner,
                    no_dist=True,
                )
        except BaseException as err:  # DCP wraps reader failures in CheckpointException
            if isinstance(err, KeyboardInterrupt):
                raise
            cause = read_failure(self.directory, err)
            raise ConversionError(
                f"could not read {', '.join(requests)} from checkpoint {self.directory}: {cause}"
            ) from err
        return state

    def read_layer(self, keys: Sequence[str], layer_index: int) -> dict[str, torch.Tensor]:
        """Layer ``layer_index`` (0-based) of stacked per-layer tensors, without the layer axis."""
        requests = {}
        for key in keys:
            shape = self.shape(key)
            requests[key] = ((layer_index,) + (0,) * (len(shape) - 1), (1, *shape[1:]))
        return {key: tensor[0] for key, tensor in self.read(requests).items()}

    def read_rows(self, key: str, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of a 2-D tensor (an embedding without its padding)."""
        shape = self.shape(key)
        return self.read({key: ((0,) * len(shape), (rows, *shape[1:]))})[key]
