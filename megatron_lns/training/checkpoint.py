"""Checkpoints through megatron's ``dist_checkpointing`` (torch_dist format).

Layout under the experiment directory::

    checkpoints/iter_0000100/           a complete checkpoint
        (dist_checkpointing shards)     model, optimizer, scheduler, RNG, data position
        config.yaml                     the resolved experiment config
        complete.json                   written last: the commit marker
    checkpoints/iter_0000200.partial/   a save in progress (or one that was killed)

A save writes into ``iter_N.partial`` and, once every rank has finished, rank 0 adds
``complete.json`` and renames the directory to ``iter_N``: a killed job can only
leave a ``.partial`` directory behind, which resume never picks. Sharded tensors carry
global keys and offsets, so a checkpoint written at one TP/PP/VP layout loads at any
other. Each virtual-pipeline chunk is stored under ``model{i}`` as Megatron-LM does.
"""

from __future__ import annotations

import json
import queue
import random
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lns.errors import UserError
from megatron_lns.model import unwrap

CHECKPOINT_DIR_RE = re.compile(r"^iter_(\d{7})$")
COMPLETE_MARKER = "complete.json"
# Set in the marker of a checkpoint that holds model weights only (``import-hf`` writes
# them): training starts from it with a fresh optimizer and schedule.
WEIGHTS_ONLY = "weights_only"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, partial, or does not fit this run."""


def sharded_state_dict_metadata() -> dict:
    """How model and optimizer describe their shards (Megatron-LM's content metadata).

    ``fully_reshardable`` makes the distributed optimizer save its state in model space,
    so a checkpoint loads at another TP/PP/DP layout (its default, ``dp_reshardable``,
    only allows a different DP size).
    """
    return {
        "distrib_optim_sharding_type": "fully_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


def model_sharded_state_dict(model: Sequence[torch.nn.Module]) -> dict:
    metadata = sharded_state_dict_metadata()
    return {
        f"model{i}": unwrap(chunk).sharded_state_dict(metadata=metadata)
        for i, chunk in enumerate(model)
    }


def _save(sharded_state_dict: dict, directory: str | Path) -> None:
    """``dist_checkpointing.save``, synchronous, without a helper process.

    megatron's writer reports through a ``multiprocessing.Manager().Queue()`` created on
    first use: a server process per rank that outlives a rank that is killed. A
    synchronous save writes from threads of this process, for which an ordinary queue
    serves.
    """
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, str(directory))


def save_model_weights(model: Sequence[torch.nn.Module], directory: str | Path) -> None:
    """Write this rank's shards of every chunk (weights only); all ranks must call it."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    _save(model_sharded_state_dict(model), directory)


def check_shapes_match(template: dict, directory: str | Path) -> None:
    """Refuse a checkpoint whose tensors have other global shapes than this model's.

    ``dist_checkpointing`` would load the overlapping part of a differently shaped
    tensor (say, an embedding padded for another vocabulary) without complaint.
    """
    saved = dist_checkpointing.load_tensors_metadata(str(directory))
    for tensor in nested_values(template):
        if not isinstance(tensor, ShardedTensor) or tensor.key not in saved:
            continue
        saved_shape = tuple(saved[tensor.key].global_shape)
        if saved_shape != tuple(tensor.global_shape):
            raise CheckpointError(
                f"checkpoint {directory}: '{tensor.key}' has shape {saved_shape}, this model "
                f"expects {tuple(tensor.global_shape)} (different architecture or vocabulary)"
            )


def _load(template: dict, directory: str | Path, parallel: bool = False) -> dict:
    """``dist_checkpointing.load`` after a shape check; any failure names the checkpoint.

    ``parallel``: megatron-core's fully parallel load, in which the data-parallel replicas
    split the reads of the shards they share and exchange them (NeMo's
    ``dist_ckpt_parallel_load``), instead of every replica reading all of them.
    """
    try:
        check_shapes_match(template, directory)
        strategy = _parallel_load_strategy(directory) if parallel else None
        return dist_checkpointing.load(template, str(directory), sharded_strategy=strategy)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        # torch's CheckpointException derives from BaseException.
        cause = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"could not load checkpoint {directory}: {cause}") from err


def _parallel_load_strategy(directory: str | Path):
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    return FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(str(directory)),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )


def _load_chunks(model: Sequence[torch.nn.Module], loaded: dict) -> None:
    for i, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)


def load_model_weights(model: Sequence[torch.nn.Module], directory: str | Path) -> None:
    """Load weights saved at any parallel layout into this rank's chunks (strict)."""
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise CheckpointError(f"{directory} is not a megatron distributed checkpoint")
    _load_chunks(model, _load(model_sharded_state_dict(model), directory))


def _layout() -> dict[str, int]:
    return {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "data": parallel_state.get_data_parallel_world_size(),
    }


def _rng_state() -> ShardedObject:
    """This rank's RNG states; one object per (pipeline, tensor, data) rank."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    layout = _layout()
    return ShardedObject(
        "rng_state",
        state,
        (layout["pipeline"], layout["tensor"], layout["data"]),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
        ),
        replica_id=0,
    )


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


@dataclass
class TrainingState:
    """What a checkpoint restores besides weights and optimizer."""

    iteration: int = 0
    consumed_samples: int = 0


def _state_dict(
    model, optimizer, scheduler, state: TrainingState, with_rng: bool, is_loading: bool = False
) -> dict:
    sharded = model_sharded_state_dict(model)
    # is_loading makes a fresh optimizer allocate its state (Adam moments), so the
    # template asks the checkpoint for it.
    sharded["optimizer"] = optimizer.sharded_state_dict(
        sharded, is_loading=is_loading, metadata=sharded_state_dict_metadata()
    )
    sharded["scheduler"] = scheduler.state_dict()
    sharded["iteration"] = state.iteration
    sharded["consumed_samples"] = state.consumed_samples
    sharded["parallel_layout"] = _layout()
    if with_rng:
        sharded["rng_state"] = _rng_state()
    return sharded


def checkpoint_path(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def save_checkpoint(
    root: str | Path,
    model,
    optimizer,
    scheduler,
    state: TrainingState,
    config_yaml: str,
) -> Path:
    """Save everything needed to resume; returns the committed directory."""
    final = checkpoint_path(root, state.iteration)
    partial = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a killed save of this step
        partial.mkdir(parents=True)
    dist.barrier()
    _save(_state_dict(model, optimizer, scheduler, state, True), partial)
    dist.barrier()
    if dist.get_rank() == 0:
        (partial / "config.yaml").write_text(config_yaml)
        marker = {"iteration": state.iteration, "consumed_samples": state.consumed_samples}
        (partial / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    dist.barrier()
    return final


def save_weights_only_checkpoint(
    model: Sequence[torch.nn.Module],
    directory: str | Path,
    config_yaml: str,
    state: TrainingState | None = None,
) -> Path:
    """A complete checkpoint of the weights alone (``import-hf`` writes these), from a
    single process: training resumes from it with a fresh optimizer and schedule, at
    ``state`` (iteration 0 by default)."""
    directory, state = Path(directory), state or TrainingState()
    save_model_weights(model, directory)
    (directory / "config.yaml").write_text(config_yaml)
    marker = {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        WEIGHTS_ONLY: True,
    }
    (directory / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
    return directory


def is_complete(path: Path) -> bool:
    return (
        CHECKPOINT_DIR_RE.match(path.name) is not None
        and (path / COMPLETE_MARKER).is_file()
        and dist_checkpointing.check_is_distributed_checkpoint(str(path))
    )


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under ``root``, newest first; partial ones never appear."""
    root = Path(root)
    if not root.is_dir():
        return []
    candidates = sorted(
        (p for p in root.iterdir() if p.is_dir() and CHECKPOINT_DIR_RE.match(p.name)),
        key=lambda p: int(CHECKPOINT_DIR_RE.match(p.name).group(1)),
        reverse=True,
    )
    return [p for p in candidates if is_complete(p)]


def latest_complete_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``; partial ones are never chosen."""
    found = complete_checkpoints(root)
    return found[0] if found else None


def load_checkpoint(
    path: str | Path, model, optimizer, scheduler, parallel_load: bool = False
) -> TrainingState:
    """Restore model, optimizer, scheduler, RNG (same layout only) and data position
    (``parallel_load``: see ``_load``).

    A weights-only checkpoint (``WEIGHTS_ONLY`` in its marker) restores the weights and
    the data position and leaves optimizer, scheduler and RNG as they are.
    """
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} or missing shards)"
        )
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text() or "{}")
    except ValueError as err:
        raise CheckpointError(f"{path / COMPLETE_MARKER} is not valid JSON: {err}") from err
    if isinstance(marker, dict) and marker.get(WEIGHTS_ONLY):
        load_model_weights(model, path)
        return TrainingState(marker.get("iteration", 0), marker.get("consumed_samples", 0))
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"could not load checkpoint {path}: {err}") from err
    same_layout = common.get("parallel_layout") == _layout()
    template = _state_dict(
        model, optimizer, scheduler, TrainingState(), with_rng=same_layout, is_loading=True
    )
    loaded = _load(template, path, parallel=parallel_load)
    _load_chunks(model, loaded)
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return TrainingState(iteration=loaded["iteration"], consumed_samples=loaded["consumed_samples"])
