"""Checkpoints through megatron's ``dist_checkpointing`` (torch_dist format).

Layout under the experiment directory::

    checkpoints/iter_0000100/           a complete checkpoint
        (dist_checkpointing shards)     model, optimizer, scheduler, RNG, data position
        config.yaml                     the resolved experiment config
        complete.json                   written last: the commit marker
    checkpoints/iter_0000200.partial/   a save in progress (or one that was killed)

A save writes into ``iter_N.partial`` and, once every rank has finished, rank 0 adds
``complete.json`` and renames the directory to ``iter_N``: a killed job can only
leave a ``.partial`` directory behind, which resume never picks. An asynchronous save
(:func:`start_checkpoint_save`) commits the same way, from the finalisation step that
megatron runs once the background writes of every rank have finished
(``training/checkpoint_writer.py`` schedules it). Sharded tensors carry
global keys and offsets, so a checkpoint written at one TP/PP/VP layout loads at any
other. Each virtual-pipeline chunk is stored under ``model{i}`` as Megatron-LM does.
Every checkpoint records the architecture that wrote it (GPT, or the hybrid model and its
sublayers): a GPT checkpoint loads into the hybrid model, nothing else crosses
(``architecture_checkpoint.py``); and its provenance: package versions, backend, config
hash (``provenance.py``).

Loading is strict: a tensor this model has and the checkpoint lacks, or one the checkpoint
holds and this model has no place for, is an error naming it. Only Transformer Engine's
``_extra_state`` entries (FP8 metadata) may differ, and only when the backend changed
(``te`` <-> ``local``) or the checkpoint does not say which backend wrote it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import queue
import random
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lns.base.disk import (
    DiskFullError,
    disk_full_error,
    disk_full_reported,
    free_bytes,
    is_disk_full,
)
from megatron_lns.base.errors import UserError
from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.model.language_model import unwrap
from megatron_lns.training import architecture_checkpoint as architecture
from megatron_lns.training import provenance
from megatron_lns.training.rewind import CHECKPOINT_ID, new_checkpoint_id

CHECKPOINT_DIR_RE = re.compile(r"^iter_(\d{7})$")
COMPLETE_MARKER = "complete.json"
# Set in the marker of a checkpoint that holds model weights only (``import-hf`` writes
# them): training starts from it with a fresh optimizer and schedule.
WEIGHTS_ONLY = "weights_only"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, partial, or does not fit this run."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint whose tensors are not this model's (one more or one less)."""


class ArchitectureMismatchError(CheckpointMismatchError):
    """A checkpoint of another architecture (GPT, hybrid, another hybrid pattern); the
    message says which setting to change."""


# Transformer Engine's per-module FP8 metadata: present with one backend only.
EXTRA_STATE = "_extra_state"


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


# megatron-core's own asynchronous writer (``async_utils`` / ``filesystem_async``). Its
# default, "nvrx", needs nvidia-resiliency-ext, which megatron-lns does not depend on.
ASYNC_STRATEGY = "mcore"


@contextlib.contextmanager
def _write_results_into(results_queue) -> Iterator[None]:
    """megatron's writer reports its results through a queue it takes from a module
    global when it plans the write (and keeps): make that global ``results_queue``.

    megatron would otherwise create a ``multiprocessing.Manager().Queue()``: a server
    process per rank that outlives a rank that is killed. A synchronous save writes from
    threads of this process, for which an ordinary queue serves; an asynchronous one
    brings a queue whose server dies with this rank (``checkpoint_writer.py``).
    """
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = results_queue
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def save_strategy(
    parallel: bool = False,
) -> TorchDistSaveShardedStrategy | FullyParallelSaveStrategyWrapper:
    """megatron's torch_dist writer; ``parallel`` spreads the writing of replicated
    shards (weights and optimizer state held by every data-parallel rank) over the
    data-parallel ranks instead of leaving it all to the first of them
    (``model.dist_ckpt_parallel_save``, Megatron-LM's ``--ckpt-fully-parallel-save``)."""
    strategy = TorchDistSaveShardedStrategy()
    if not parallel:
        return strategy
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelSaveStrategyWrapper(strategy, group)


def load_strategy(
    parallel: bool = False,
) -> TorchDistLoadShardedStrategy | FullyParallelLoadStrategyWrapper:
    """megatron's torch_dist reader; ``parallel`` has each data-parallel rank read a
    part of the replicated shards and exchange them with the others
    (``model.dist_ckpt_parallel_load``, Megatron-LM's ``--ckpt-fully-parallel-load``)."""
    strategy = TorchDistLoadShardedStrategy()
    if not parallel:
        return strategy
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelLoadStrategyWrapper(strategy, group)


# Free bytes under which a failed write is taken for a full disk when the writer lost
# the reason (megatron's writer keeps only the text of its threads' errors).
NEARLY_FULL_BYTES = 1 << 20


@contextlib.contextmanager
def _writer_errors() -> Iterator[list[str]]:
    """The errors megatron's writer logs (its threads' ``OSError`` as text, the only place
    their errno survives), collected for the one-line report instead of printed."""
    logger = logging.getLogger(filesystem_async.__name__)
    messages: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _logged_oserror(messages: list[str]) -> OSError | None:
    for message in messages:
        if code := re.search(r"\[Errno (\d+)\]", message):
            return OSError(int(code.group(1)), message)
    return None


def _full_disk_in(err: BaseException) -> OSError | None:
    """The full-disk ``OSError`` that caused ``err``, through causes and the per-rank
    failures of torch's ``CheckpointException``; None where there is none."""
    seen, todo = set(), [err]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if is_disk_full(current):
            return current
        todo += [current.__cause__, current.__context__]
        for failure in getattr(current, "failures", {}).values():  # (exception, traceback)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def write_failure(
    final: Path, partial: Path, err: BaseException, logged: Sequence[str] = ()
) -> CheckpointError | DiskFullError:
    """The one-line error of a checkpoint write into ``partial`` that failed with ``err``
    (``logged``: what megatron's writer logged meanwhile, :func:`_writer_errors`).

    A full disk (``err`` or the log says so, or, where megatron's writer lost the reason,
    fewer bytes are free than the newest checkpoint beside it takes, and at least
    :data:`NEARLY_FULL_BYTES`) names ``final``, the space free and needed, and removes
    ``partial`` to give its space back; resume never picks it either way. The space free
    is measured once ``partial`` is gone, as ``df`` shows it afterwards. Every rank that
    failed calls this and removes what it still finds of ``partial`` (the files of a rank
    on another node's disk included) before measuring.
    """
    if isinstance(err, (CheckpointError, DiskFullError)):  # already said (``_commit``)
        return err
    oserror = _full_disk_in(err) or _logged_oserror(list(logged))
    if oserror is not None and not is_disk_full(oserror):
        err, oserror = oserror, None  # the writer's own reason, for the message
    free, needed = free_bytes(partial), saved_bytes(final.parent)
    if oserror is None and (free is None or free >= max(needed or 0, NEARLY_FULL_BYTES)):
        cause = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        return CheckpointError(
            f"could not save checkpoint {final} (left as {partial.name}, which resume "
            f"ignores): {cause}"
        )
    if oserror is None:
        oserror = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    shutil.rmtree(partial, ignore_errors=True)  # ranks racing here skip what is gone
    previous = latest_complete_checkpoint(final.parent)
    rerun = f"resumes from {previous.name}" if previous is not None else "starts afresh"
    then = f"; {partial.name} removed, a rerun {rerun} once space is freed"
    return disk_full_error(final, oserror, needed, then)


def saved_bytes(root: str | Path) -> int | None:
    """The size of the newest complete checkpoint under ``root``: about what the next
    one needs; None when there is none."""
    newest = latest_complete_checkpoint(root)
    if newest is None:
        return None
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())


def _on_rank0_then_everywhere(write: Callable[[], None], path: Path, what: str) -> None:
    """Run ``write`` on rank 0 and raise its error on every rank: no rank may be left
    waiting in the next collective for a rank 0 whose write failed (a full disk)."""
    error = None
    if dist.get_rank() == 0:
        try:
            with disk_full_reported(path):
                write()
        except UserError as err:
            error = err
        except OSError as err:
            error = CheckpointError(f"cannot {what} {path}: {err.strerror or err}")
    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise shared[0]


# What megatron's coordinator failed to write of the checkpoint being saved (below).
_metadata_write_failures: list[OSError] = []


@contextlib.contextmanager
def metadata_write_failures_kept() -> Iterator[None]:
    """While a checkpoint is saved or finalised: keep, not raise, an ``OSError`` from the
    two files megatron's coordinator (rank 0) writes alone between two collectives:
    ``.metadata`` (torch's ``finish``) and ``metadata.json`` (``save_config``). Raised
    there, it would leave every other rank waiting in the next collective; kept, the
    commit that follows in the block raises it on every rank (``_commit``)."""

    def kept(write):
        @functools.wraps(write)
        def write_or_keep(*args, **kwargs):
            try:
                return write(*args, **kwargs)
            except OSError as err:
                _metadata_write_failures.append(err)

        return write_or_keep

    patched = [(filesystem_async.FileSystemWriterAsync, "finish"), (serialization, "save_config")]
    originals = [getattr(owner, name) for owner, name in patched]
    _metadata_write_failures.clear()
    for (owner, name), original in zip(patched, originals, strict=True):
        setattr(owner, name, kept(original))
    try:
        yield
    finally:
        for (owner, name), original in zip(patched, originals, strict=True):
            setattr(owner, name, original)
        _metadata_write_failures.clear()


def _save(sharded_state_dict: dict, directory: str | Path, strategy=None) -> None:
    """``dist_checkpointing.save``, synchronous, without a helper process. A write that
    fails raises on every rank (megatron broadcasts the failure): a one-line error."""
    directory = Path(directory)
    with _writer_errors() as logged:
        try:
            with _write_results_into(queue.Queue()):
                dist_checkpointing.save(
                    sharded_state_dict, str(directory), strategy, async_strategy=ASYNC_STRATEGY
                )
        except (Exception, CheckpointException) as err:
            # torch's CheckpointException derives from BaseException.
            final = directory.with_name(directory.name.removesuffix(".partial"))
            raise write_failure(final, directory, err, logged) from err


def _start_save(
    sharded_state_dict: dict, directory: str | Path, strategy, results_queue
) -> AsyncRequest:
    """Plan an asynchronous ``dist_checkpointing.save``: the returned request writes this
    rank's shards when scheduled and finalises (metadata) once every rank has."""
    with _write_results_into(results_queue):
        return dist_checkpointing.save(
            sharded_state_dict,
            str(directory),
            strategy,
            async_sharded_save=True,
            async_strategy=ASYNC_STRATEGY,
        )


def save_model_weights(
    model: Sequence[torch.nn.Module],
    directory: str | Path,
    config_yaml: str | None = None,
    strategy=None,
) -> None:
    """Write this rank's shards of every chunk (weights only); all ranks must call it.
    ``config_yaml``: the run config whose hash the provenance records, where there is one.
    ``strategy``: megatron's writer (``import-hf`` streams a meta model's weights)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    sharded = model_sharded_state_dict(model)
    sharded[architecture.ARCHITECTURE] = architecture.model_architecture(model)
    sharded[provenance.PROVENANCE] = provenance.provenance_record(model, config_yaml)
    _save(sharded, directory, strategy)


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


def _load(
    template: dict, directory: str | Path, strategy=None, may_differ=lambda key: False
) -> dict:
    """``dist_checkpointing.load`` after a shape check, strict: a key of the template not
    in the checkpoint, or of the checkpoint not in any rank's template, is an error unless
    ``may_differ(key)``. Any failure names the checkpoint."""
    try:
        check_shapes_match(template, directory)
        # RETURN_ALL: megatron compares the keys of every rank's template with the
        # checkpoint's (its default, ASSUME_OK_UNEXPECTED, ignores checkpoint tensors that
        # nothing asks for) and leaves what to do to us.
        loaded, unread, absent = dist_checkpointing.load(
            template, str(directory), strategy, strict=StrictHandling.RETURN_ALL
        )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        # torch's CheckpointException derives from BaseException.
        cause = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"could not load checkpoint {directory}: {cause}") from err
    _refuse_mismatch(directory, unread, absent, may_differ)
    return loaded


def _refuse_mismatch(directory, unread: set[str], absent: set[str], may_differ) -> None:
    """Raise, on every rank, naming the first key the checkpoint lacks (``absent``: this
    rank's own) or holds without a place in the model (``unread``: the same on all ranks).
    One gather of the (usually empty) lists, so that no rank goes on alone."""
    local = sorted(key for key in absent if not may_differ(key))
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        local = sorted({key for keys in gathered for key in keys})
    unread = sorted(key for key in unread if not may_differ(key))
    problems = [
        _named(keys, what)
        for keys, what in (
            (local, "that this model has and the checkpoint lacks"),
            (unread, "that the checkpoint holds and this model has no place for"),
        )
        if keys
    ]
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {directory} does not fit this model: "
            + "; ".join(problems)
            + " (another architecture or model setting than the run that wrote it)"
        )


def _named(keys: list[str], what: str) -> str:
    more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
    return f"'{keys[0]}'{more} {what}"


def _extra_state_may_differ(common: dict, model) -> bool:
    """Whether Transformer Engine's ``_extra_state`` may be absent on one side: when the
    backend changed, or the checkpoint predates the record of its backend."""
    saved = provenance.saved_provenance(common) or {}
    return saved.get("backend") != provenance.model_backend(model)


def _key_filter(extra_state_may_differ: bool, also=()):
    return lambda key: key in also or (extra_state_may_differ and key.endswith(EXTRA_STATE))


def _load_chunks(
    model: Sequence[torch.nn.Module], loaded: dict, directory, extra_state_may_differ: bool
) -> None:
    """Copy the loaded state into the chunks: strict, but for ``_extra_state`` when it may
    differ (``_load`` has already refused any other difference)."""
    for i, chunk in enumerate(model):
        result = unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        left = [
            key
            for key in [*result.missing_keys, *result.unexpected_keys]
            if not (extra_state_may_differ and key.endswith(EXTRA_STATE))
        ]
        if left:
            raise CheckpointMismatchError(
                f"checkpoint {directory} does not fit this model: '{left[0]}' does not match "
                f"(model chunk {i}; {len(left)} key(s) in all)"
            )


def load_model_weights(model: Sequence[torch.nn.Module], directory: str | Path) -> None:
    """Load weights saved at any parallel layout, and by GPT into the hybrid model
    (``architecture_checkpoint.py``), into this rank's chunks (strict)."""
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise CheckpointError(f"{directory} is not a megatron distributed checkpoint")
    try:
        common = dist_checkpointing.load_common_state_dict(str(directory))
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"could not load checkpoint {directory}: {err}") from err
    template = model_sharded_state_dict(model)
    _translate_architecture(template, model, directory, common)
    extra_state = _extra_state_may_differ(common, model)
    model_only = _key_filter(extra_state)
    loaded = _load(
        template, directory, may_differ=lambda key: _training_only(key) or model_only(key)
    )
    _load_chunks(model, loaded, directory, extra_state)


def _training_only(key: str) -> bool:
    """A tensor of a training checkpoint that is not the model's (optimizer state, RNG):
    a weights-only load reads a training checkpoint's model and leaves these."""
    return key == "rng_state" or key.startswith("optimizer.")


def _translate_architecture(template: dict, model, path: str | Path, common: dict) -> None:
    """Refuse a checkpoint of another architecture or hybrid pattern that cannot load into
    ``model``; point the template of a hybrid model at a GPT checkpoint's keys."""
    saved = architecture.saved_architecture(common)
    current = architecture.model_architecture(model)
    problem = architecture.architecture_mismatch(saved, current)
    if problem:
        raise ArchitectureMismatchError(f"checkpoint {path}: {problem}")
    if architecture.needs_gpt_translation(saved, current):
        parts = [f"model{i}" for i in range(len(model))] + ["optimizer"]
        per_layer = architecture.has_per_layer_keys(path)
        architecture.retarget_to_gpt_checkpoint(template, current["sublayers"], per_layer, parts)


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


@dataclass
class TrainingState:
    """What a checkpoint restores besides weights and optimizer."""

    iteration: int = 0
    consumed_samples: int = 0


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


# megatron-core 0.19's distributed optimizer on torch's Adam (no Apex or Transformer
# Engine, as on the CPU) cannot load its own checkpoints; the two functions below are
# the smallest changes that let it, each a no-op where megatron uses a fused Adam.


def _distributed_parts(optimizer) -> list[DistributedOptimizer]:
    """The distributed optimizers of ``optimizer``: itself, or each part of a chained one
    (with experts, dense and expert parameters have one each)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if isinstance(part, DistributedOptimizer)]


def _allocate_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state before a checkpoint is loaded.

    ``DistributedOptimizer.state_dict``, which building the loading template calls
    first, reads the step count from torch Adam's per-parameter state, which exists only
    after a first step, and asserts that there is one. megatron's own
    ``_init_optimizer_states_with_dummy_values`` (its FSDP loading path) allocates the
    state with a zero-gradient step; the checkpoint then overwrites the state, the step
    count and the weights.
    """
    for part in _distributed_parts(optimizer):
        if part.optimizer is not None and not part.optimizer.state:
            part._init_optimizer_states_with_dummy_values()


def _load_optimizer_state(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict``, keeping torch Adam's step count out of the copy of
    the parameter states, and giving each parameter its own step count.

    ``DistributedOptimizer.load_state_dict`` sets every parameter's ``step`` to one and
    the same tensor from the checkpoint, then copies each parameter's state tensors from
    the checkpoint's (``_set_main_param_and_optimizer_states``) by the keys of its own
    state, ``step`` among them, which the checkpoint files under no parameter: a
    ``KeyError``. And torch's Adam increments each parameter's ``step`` in place, so a
    shared one would count every parameter's update and put the bias correction of all
    later steps off.
    """
    parts = _distributed_parts(optimizer)
    for part in parts:
        part._set_main_param_and_optimizer_states = functools.partial(
            _set_states_but_step, part, type(part)._set_main_param_and_optimizer_states
        )
    try:
        optimizer.load_state_dict(state_dict)
    finally:
        for part in parts:
            del part._set_main_param_and_optimizer_states


def _set_states_but_step(part, set_states, model_param, tensors: dict) -> None:
    group_index, group_order = part.model_param_group_index_map[model_param]
    main_param = part.optimizer.param_groups[group_index]["params"][group_order]
    state = part.optimizer.state[main_param]
    step = state.pop("step") if "step" in state and "step" not in tensors else None
    try:
        set_states(part, model_param, tensors)
    finally:
        if step is not None:
            state["step"] = step.clone()


def _parts_of(state) -> list:
    """The per-part states of a (chained) optimizer state: ``{0: ..., 1: ...}`` or one."""
    if isinstance(state, dict) and 0 in state:
        return [state[i] for i in sorted(k for k in state if isinstance(k, int))]
    return [state]


def _regroupable(saved_parts: list, optimizer) -> bool:
    """Whether a state of other parts can be regrouped into ``optimizer``: every part on
    both sides a distributed optimizer, saved ``fully_reshardable`` (no ``chained_``
    prefix, tensors under the parameters' model keys)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return len(_distributed_parts(optimizer)) == len(parts) and all(
        isinstance(part, dict)
        and part.get("param_state_sharding_type") == "fully_reshardable"
        and isinstance(part.get("optimizer"), dict)
        for part in saved_parts
    )


def _check_optimizer_parts(path: Path, saved, optimizer) -> None:
    """Refuse a checkpoint whose optimizer state is split into another number of parts,
    unless it can be regrouped (:func:`_regroup_optimizer_state`), naming the layouts it
    does load at.

    megatron-core 0.19 gives expert parameters an optimizer of their own exactly when
    their gradients are reduced over the expert groups (``use_expert_pgs``: EP > 1, or
    expert TP other than TP), and a ``ChainedOptimizer`` loads only a state of as many
    parts (``Expected 2 entries``, deep in megatron otherwise). The distributed
    optimizer's parts are saved ``fully_reshardable`` (model space, one tensor per
    parameter, no ``chained_`` prefix), so their tensors load at any part count and only
    the non-tensor state (each part's param groups, step) is regrouped. Any other
    optimizer's state loads only into as many parts. Weights alone load at any layout
    (``load_model_weights``)."""
    saved_list = _parts_of(saved)
    saved_parts = len(saved_list)
    parts = len(getattr(optimizer, "chained_optimizers", [optimizer]))
    if saved_parts != parts and not _regroupable(saved_list, optimizer):
        expert_parallel = (
            "model.expert_model_parallel_size > 1 or model.expert_tensor_parallel_size other "
            "than model.tensor_model_parallel_size"
        )
        written = (
            f"with expert parallelism ({expert_parallel})"
            if saved_parts > parts
            else f"without expert parallelism (neither {expert_parallel})"
        )
        raise CheckpointError(
            f"checkpoint {path}: its optimizer state has {saved_parts} part(s), this run's "
            f"optimizer {parts}: megatron-core keeps the experts' optimizer state apart only "
            "with expert parallelism, and loads a state only into as many parts (only the "
            "distributed optimizer's, model.optim.name=distributed_fused_adam on both runs, "
            f"is regrouped). It was written {written}: resume so (any TP, PP, DP, EP and "
            f"expert TP that also {'has' if saved_parts > parts else 'lacks'} it load, "
            "resharded)"
        )


def _group_identity(group: dict) -> tuple:
    """What megatron's ``DistributedOptimizer.load_state_dict`` pairs a saved param group
    with a current one by (``param_group_identifier_keys``, ``pre_`` aliases included),
    less ``is_expert_parallel``, which is the part a group is in, not its settings."""
    return tuple(
        group.get(key, group.get(f"pre_{key}"))
        for key in param_group_identifier_keys
        if key != "is_expert_parallel"
    )


def _regroup_optimizer_state(path: Path, loaded, saved, optimizer):
    """A loaded optimizer state of other parts than ``optimizer``'s, as one of its parts.

    ``loaded``: what ``dist_checkpointing.load`` returned under ``optimizer``: the
    checkpoint's non-tensor state (its parts) merged with the tensors of this run's
    template (its parts, each parameter's main weight and Adam moments read by model
    key). ``saved``: the checkpoint's non-tensor optimizer state. Each part of this run
    gets its own tensors and, for each of its param groups, the saved group of the same
    settings (preferably from a part of the same kind: expert or not), marked as this
    part's; the groups carry the step (every part steps together, megatron's
    ``_synchronize_steps``) and the hyperparameters."""
    saved_parts = _parts_of(saved)
    current = getattr(optimizer, "chained_optimizers", [optimizer])
    saved_groups = [
        group for part in saved_parts for group in part["optimizer"].get("param_groups", [])
    ]
    regrouped = {}
    for i, part in enumerate(current):
        tensors = (loaded if len(current) == 1 else loaded[i])["param_state"]
        groups = []
        for group in part.optimizer.param_groups:
            expert = group.get("is_expert_parallel")
            same = [g for g in saved_groups if _group_identity(g) == _group_identity(group)]
            if not same:
                raise CheckpointError(
                    f"checkpoint {path}: no optimizer param group of the checkpoint has the "
                    f"settings of this run's {_group_identity(group)} (another optimizer "
                    "setting than the run that wrote it)"
                )
            match = next((g for g in same if g.get("is_expert_parallel") == expert), same[0])
            groups.append({**match, "is_expert_parallel": expert})
        state = {
            **saved_parts[0],
            "optimizer": {**saved_parts[0]["optimizer"], "param_groups": groups},
            "param_state": tensors,
        }
        regrouped[i] = state
    return regrouped[0] if len(current) == 1 else regrouped


def checkpoint_path(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _prepare_partial(root: str | Path, iteration: int) -> tuple[Path, Path]:
    """The committed and the in-progress directory of a save, the latter made empty."""
    final = checkpoint_path(root, iteration)
    partial = final.with_name(final.name + ".partial")

    def make_empty() -> None:
        shutil.rmtree(partial, ignore_errors=True)  # left by a killed save of this step
        partial.mkdir(parents=True)

    _on_rank0_then_everywhere(make_empty, partial, "create")
    return final, partial


def _commit(partial: Path, final: Path, state: TrainingState, config_yaml: str) -> None:
    """Make a fully written checkpoint count: called on every rank once every rank's
    shards are on disk; rank 0 writes the marker and renames. A failure (a full disk)
    raises on every rank and leaves nothing that counts."""

    def mark_and_rename() -> None:
        try:
            if _metadata_write_failures:  # megatron's metadata (``metadata_write_failures_kept``)
                raise _metadata_write_failures[0]
            (partial / RUN_CONFIG).write_text(config_yaml)
            marker = {
                "iteration": state.iteration,
                "consumed_samples": state.consumed_samples,
                CHECKPOINT_ID: new_checkpoint_id(),
            }
            (partial / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        except OSError as err:
            raise write_failure(final, partial, err) from err
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)

    _on_rank0_then_everywhere(mark_and_rename, partial, "commit")


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
    final, partial = _prepare_partial(root, state.iteration)
    sharded = _state_dict(model, optimizer, scheduler, state, True, config_yaml=config_yaml)
    with metadata_write_failures_kept():
        _save(sharded, partial, strategy)
        dist.barrier()
        _commit(partial, final, state, config_yaml)
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
    final, partial = _prepare_partial(root, state.iteration)
    # A copy: the request outlives this step, the trainer's state does not.
    saved = TrainingState(state.iteration, state.consumed_samples)
    sharded = _state_dict(model, optimizer, scheduler, saved, True, config_yaml=config_yaml)
    request = _start_save(sharded, partial, strategy, results_queue)
    request.add_finalize_fn(lambda: _commit(partial, final, saved, config_yaml))
    return final, request


def save_weights_only_checkpoint(
    model: Sequence[torch.nn.Module],
    directory: str | Path,
    config_yaml: str,
    state: TrainingState | None = None,
    strategy=None,
) -> Path:
    """A complete checkpoint of the weights alone (``import-hf`` writes these), from a
    single process: training resumes from it with a fresh optimizer and schedule, at
    ``state`` (iteration 0 by default). ``strategy``: as for :func:`save_model_weights`."""
    directory, state = Path(directory), state or TrainingState()
    save_model_weights(model, directory, config_yaml, strategy)
    (directory / RUN_CONFIG).write_text(config_yaml)
    marker = {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        WEIGHTS_ONLY: True,
        CHECKPOINT_ID: new_checkpoint_id(),
    }
    (directory / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
    return directory


# What megatron's torch_dist format reads before any shard: its own record of the
# format (metadata.json) and torch's index of the shards (.metadata).
DIST_CHECKPOINT_FILES = ("metadata.json", ".metadata")


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a checkpoint that can be loaded, in a few words; None if it is."""
    if not path.is_dir():
        return "does not exist" if not path.exists() else "is a file, not a directory"
    if not (path / COMPLETE_MARKER).is_file():
        return f"has no {COMPLETE_MARKER}: its save never finished"
    if CHECKPOINT_DIR_RE.match(path.name) is None:
        return "is not an iter_NNNNNNN directory"
    missing = [name for name in DIST_CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        return f"is damaged: {' and '.join(missing)} missing"
    return None


def is_complete(path: Path) -> bool:
    return checkpoint_problem(path) is None


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The committed checkpoints under ``root`` (with ``complete.json``), newest first;
    partial ones never appear.

    A committed checkpoint that was damaged afterwards (a file deleted) is listed too:
    passing over it would resume from an older one without a word, and the run's next
    save of that step would delete it. Loading it names what it lacks.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    candidates = sorted(
        (p for p in root.iterdir() if p.is_dir() and CHECKPOINT_DIR_RE.match(p.name)),
        key=lambda p: int(CHECKPOINT_DIR_RE.match(p.name).group(1)),
        reverse=True,
    )
    return [p for p in candidates if (p / COMPLETE_MARKER).is_file()]


def latest_complete_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``; partial ones are never chosen."""
    found = complete_checkpoints(root)
    return found[0] if found else None


def load_checkpoint(path: str | Path, model, optimizer, scheduler, strategy=None) -> TrainingState:
    """Restore model, optimizer, scheduler, RNG (same layout only) and data position.

    A weights-only checkpoint (``WEIGHTS_ONLY`` in its marker) restores the weights and
    the data position and leaves optimizer, scheduler and RNG as they are. ``strategy``:
    megatron's reader (:func:`load_strategy`); the default reads everything each rank
    needs itself.
    """
    path = Path(path)
    if problem := checkpoint_problem(path):
        raise CheckpointError(f"{path} is not a complete checkpoint: it {problem}")
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
    same_layout = common.get("parallel_layout") == layout_record()
    _check_optimizer_parts(path, common.get("optimizer"), optimizer)
    _allocate_distributed_optimizer_state(optimizer)
    template = _state_dict(
        model, optimizer, scheduler, TrainingState(), with_rng=same_layout, is_loading=True
    )
    _translate_architecture(template, model, path, common)
    extra_state = _extra_state_may_differ(common, model)
    # At another layout the checkpoint's RNG states are left unread.
    unread_rng = () if same_layout else ("rng_state",)
    loaded = _load(template, path, strategy, _key_filter(extra_state, unread_rng))
    _load_chunks(model, loaded, path, extra_state)
    optimizer_state = loaded["optimizer"]
    saved_optimizer = common.get("optimizer")
    if len(_parts_of(saved_optimizer)) != len(getattr(optimizer, "chained_optimizers", [0])):
        optimizer_state = _regroup_optimizer_state(
            path, optimizer_state, saved_optimizer, optimizer
        )
    _load_optimizer_state(optimizer, optimizer_state)
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return TrainingState(iteration=loaded["iteration"], consumed_samples=loaded["consumed_samples"])
