"""Training checkpoints through megatron's ``dist_checkpointing``: save and resume a run.

A checkpoint holds the model, optimizer, scheduler, RNG states and data position of one
step, and records the architecture that wrote it (``architecture_checkpoint.py``), its
parallel layout (RNG states restore at the same one only) and its provenance: package
versions, backend, config hash (``provenance.py``). The pieces: where checkpoints live
and which count (``checkpoint_dirs.py``), writing, committing and strictly reading shards
(``checkpoint_io.py``), model weights alone (``checkpoint_weights.py``), the optimizer's
state (``checkpoint_optimizer.py``). The names other packages import from here are
re-exported below.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from megatron_lns.runtime.fault_injection import inject_fault
from megatron_lns.training import architecture_checkpoint as architecture
from megatron_lns.training import provenance
from megatron_lns.training.checkpoint_dirs import (
    COMPLETE_MARKER,
    WEIGHTS_ONLY,
    CheckpointError,
    TrainingState,
    checkpoint_problem,
    read_marker,
)
from megatron_lns.training.checkpoint_io import (
    commit,
    extra_state_may_differ,
    key_filter,
    load_sharded,
    load_strategy,
    metadata_write_failures_kept,
    model_sharded_state_dict,
    prepare_partial,
    read_common_state,
    save_sharded,
    sharded_state_dict_metadata,
    start_sharded_save,
    write_failure,
)
from megatron_lns.training.checkpoint_optimizer import (
    allocate_distributed_optimizer_state,
    check_optimizer_parts,
    load_optimizer_state,
    parts_of,
    regroup_optimizer_state,
)
from megatron_lns.training.checkpoint_weights import (
    load_chunks,
    load_model_weights,
    save_model_weights,
    save_weights_only_checkpoint,
    translate_architecture,
)

# isort: split
# Re-exported: other packages import these from here.
from megatron_lns.training.checkpoint_dirs import (
    CHECKPOINT_DIR_RE,
    ArchitectureMismatchError,
    CheckpointMismatchError,
    complete_checkpoints,
    latest_complete_checkpoint,
)

__all__ = [
    "CHECKPOINT_DIR_RE",
    "COMPLETE_MARKER",
    "ArchitectureMismatchError",
    "CheckpointError",
    "CheckpointMismatchError",
    "TrainingState",
    "checkpoint_problem",
    "complete_checkpoints",
    "latest_complete_checkpoint",
    "layout_record",
    "load_checkpoint",
    "load_model_weights",
    "load_strategy",
    "save_checkpoint",
    "save_model_weights",
    "save_weights_only_checkpoint",
    "start_checkpoint_save",
    "write_failure",
]


def layout_record() -> dict[str, int]:
    """The parallel sizes a checkpoint records; its RNG states are restored only at the
    same ones. The expert sizes count too (each expert rank keeps its own
    ``expert-parallel-rng`` state) and are recorded only where they differ from a dense
    run's (EP=1, expert TP = TP), so a dense checkpoint's record is what it always was."""
    tensor = parallel_state.get_tensor_model_parallel_world_size()
    layout = {
        "tensor": tensor,
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "data": parallel_state.get_data_parallel_world_size(),
    }
    expert = parallel_state.get_expert_model_parallel_world_size()
    expert_tensor = parallel_state.get_expert_tensor_parallel_world_size()
    if expert != 1:
        layout["expert"] = expert
    if expert_tensor != tensor:
        layout["expert_tensor"] = expert_tensor
    return layout


def _rng_state() -> ShardedObject:
    """This rank's RNG states; one object per (pipeline, tensor, data) rank."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    layout = layout_record()
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


def _state_dict(
    model,
    optimizer,
    scheduler,
    state: TrainingState,
    with_rng: bool,
    is_loading: bool = False,
    config_yaml: str | None = None,
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
    sharded["parallel_layout"] = layout_record()
    sharded[architecture.ARCHITECTURE] = architecture.model_architecture(model)
    if with_rng:
        sharded["rng_state"] = _rng_state()
    if not is_loading:
        sharded[provenance.PROVENANCE] = provenance.provenance_record(model, config_yaml)
    return sharded


def save_checkpoint(
    root: str | Path,
    model,
    optimizer,
    scheduler,
    state: TrainingState,
    config_yaml: str,
    strategy=None,
) -> Path:
    """Save everything needed to resume; returns the committed directory."""
    final, partial = prepare_partial(root, state.iteration)
    sharded = _state_dict(model, optimizer, scheduler, state, True, config_yaml=config_yaml)
    with metadata_write_failures_kept():
        save_sharded(sharded, partial, strategy)
        inject_fault("save", state.iteration)  # written, not committed: a test's fault
        dist.barrier()
        commit(partial, final, state, config_yaml)
    return final


def start_checkpoint_save(
    root: str | Path,
    model,
    optimizer,
    scheduler,
    state: TrainingState,
    config_yaml: str,
    strategy,
    results_queue,
) -> tuple[Path, AsyncRequest]:
    """Plan an asynchronous save of everything needed to resume.

    Returns the directory the checkpoint will have and megatron's request, whose last
    finalisation step commits it. Nothing counts until that step has run on every rank.
    Schedule the request before the model or optimizer change again: the state is
    taken when it is scheduled (copied off the GPU, or forked on CPU).
    """
    final, partial = prepare_partial(root, state.iteration)
    # A copy: the request outlives this step, the trainer's state does not.
    saved = TrainingState(state.iteration, state.consumed_samples, dict(state.data))
    sharded = _state_dict(model, optimizer, scheduler, saved, True, config_yaml=config_yaml)
    request = start_sharded_save(sharded, partial, strategy, results_queue)
    request.add_finalize_fn(lambda: commit(partial, final, saved, config_yaml))
    return final, request


def load_checkpoint(
    path: str | Path, model, optimizer, scheduler, strategy=None, common: dict | None = None
) -> TrainingState:
    """Restore model, optimizer, scheduler, RNG (same layout only) and data position.

    A weights-only checkpoint (``WEIGHTS_ONLY`` in its marker) restores the weights and
    the data position and leaves optimizer, scheduler and RNG as they are. ``strategy``:
    megatron's reader (:func:`load_strategy`); the default reads everything each rank
    needs itself. ``common``: the checkpoint's common state (:func:`read_common_state`)
    where the caller has read it already, as a resume has to compare schedules.
    """
    path = Path(path)
    if problem := checkpoint_problem(path):
        raise CheckpointError(f"{path} is not a complete checkpoint: it {problem}")
    marker = read_marker(path)
    if marker.get(WEIGHTS_ONLY):
        load_model_weights(model, path, common)
        return TrainingState(marker.get("iteration", 0), marker.get("consumed_samples", 0))
    if common is None:
        common = read_common_state(path)
    same_layout = common.get("parallel_layout") == layout_record()
    check_optimizer_parts(path, common.get("optimizer"), optimizer)
    allocate_distributed_optimizer_state(optimizer)
    template = _state_dict(
        model, optimizer, scheduler, TrainingState(), with_rng=same_layout, is_loading=True
    )
    translate_architecture(template, model, path, common)
    extra_state = extra_state_may_differ(common, model)
    # At another layout the checkpoint's RNG states are left unread.
    unread_rng = () if same_layout else ("rng_state",)
    loaded = load_sharded(template, path, strategy, key_filter(extra_state, unread_rng))
    load_chunks(model, loaded, path, extra_state)
    optimizer_state = loaded["optimizer"]
    saved_optimizer = common.get("optimizer")
    if len(parts_of(saved_optimizer)) != len(getattr(optimizer, "chained_optimizers", [0])):
        optimizer_state = regroup_optimizer_state(path, optimizer_state, saved_optimizer, optimizer)
    load_optimizer_state(optimizer, optimizer_state)
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return TrainingState(iteration=loaded["iteration"], consumed_samples=loaded["consumed_samples"])
