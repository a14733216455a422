"""Writing and reading megatron's sharded checkpoints (``dist_checkpointing``, torch_dist).

A save writes into ``iter_N.partial`` and, once every rank has finished, rank 0 adds
``complete.json`` and renames the directory to ``iter_N`` (:func:`commit`): a killed job
can only leave a ``.partial`` directory behind, which resume never picks. An asynchronous
save (:func:`start_sharded_save`) commits the same way, from the finalisation step that
megatron runs once the background writes of every rank have finished
(``training/checkpoint_writer.py`` schedules it). A full disk, on any rank and in any
writer process, is one line naming the checkpoint (:func:`write_failure`).

Loading is strict (:func:`load_sharded`): a tensor this model has and the checkpoint
lacks, or one the checkpoint holds and this model has no place for, is an error naming it.
Only Transformer Engine's ``_extra_state`` entries (FP8 metadata) may differ, and only when
the backend changed (``te`` <-> ``local``) or the checkpoint does not say which backend
wrote it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import queue
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
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
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lns.base.disk import (
    DiskFullError,
    disk_full_error,
    disk_full_reported,
    free_bytes,
    is_disk_full,
)
from megatron_lns.base.errors import UserError, last_line
from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.model.language_model import unwrap
from megatron_lns.training import provenance
from megatron_lns.training.checkpoint_damage import read_failure, read_index
from megatron_lns.training.checkpoint_dirs import (
    COMPLETE_MARKER,
    DATA,
    CheckpointError,
    CheckpointMismatchError,
    TrainingState,
    checkpoint_path,
    latest_complete_checkpoint,
)
from megatron_lns.training.rewind import CHECKPOINT_ID, new_checkpoint_id

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
    return _spread(TorchDistSaveShardedStrategy(), FullyParallelSaveStrategyWrapper, parallel)


def load_strategy(
    parallel: bool = False,
) -> TorchDistLoadShardedStrategy | FullyParallelLoadStrategyWrapper:
    """megatron's torch_dist reader; ``parallel`` has each data-parallel rank read a
    part of the replicated shards and exchange them with the others
    (``model.dist_ckpt_parallel_load``, Megatron-LM's ``--ckpt-fully-parallel-load``)."""
    return _spread(TorchDistLoadShardedStrategy(), FullyParallelLoadStrategyWrapper, parallel)


def _spread(strategy, wrapper, parallel: bool):
    """``strategy``, or with ``parallel`` ``wrapper`` of it over the data-parallel ranks."""
    if not parallel:
        return strategy
    return wrapper(strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))


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
    if isinstance(err, (CheckpointError, DiskFullError)):  # already said (``commit``)
        return err
    oserror = _full_disk_in(err) or _logged_oserror(list(logged))
    if oserror is not None and not is_disk_full(oserror):
        err, oserror = oserror, None  # the writer's own reason, for the message
    free, needed = free_bytes(partial), saved_bytes(final.parent)
    if oserror is None and (free is None or free >= max(needed or 0, NEARLY_FULL_BYTES)):
        return CheckpointError(
            f"could not save checkpoint {final} (left as {partial.name}, which resume "
            f"ignores): {last_line(err)}"
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
    commit that follows in the block raises it on every rank (``commit``)."""

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


def save_sharded(sharded_state_dict: dict, directory: str | Path, strategy=None) -> None:
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


def start_sharded_save(
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


def read_common_state(directory: str | Path) -> dict:
    """megatron's common state of checkpoint ``directory`` (scheduler, parallel layout,
    architecture, provenance): what every load reads first. torch's index of the shards
    is read before it (``checkpoint_damage.read_index``): finding that unreadable, torch
    would log two tracebacks of its own before it raised. Any failure is one line."""
    read_index(directory)
    try:
        return dist_checkpointing.load_common_state_dict(str(directory))
    except (Exception, CheckpointException) as err:
        cause = read_failure(directory, err)
        raise CheckpointError(f"could not load checkpoint {directory}: {cause}") from err


def load_sharded(
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
        cause = read_failure(directory, err)
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


def extra_state_may_differ(common: dict, model) -> bool:
    """Whether Transformer Engine's ``_extra_state`` may be absent on one side: when the
    backend changed, or the checkpoint predates the record of its backend."""
    saved = provenance.saved_provenance(common) or {}
    return saved.get("backend") != provenance.model_backend(model)


def key_filter(extra_state_may_differ: bool, also=()):
    return lambda key: key in also or (extra_state_may_differ and key.endswith(EXTRA_STATE))


def prepare_partial(root: str | Path, iteration: int) -> tuple[Path, Path]:
    """The committed and the in-progress directory of a save, the latter made empty."""
    final = checkpoint_path(root, iteration)
    partial = final.with_name(final.name + ".partial")

    def make_empty() -> None:
        shutil.rmtree(partial, ignore_errors=True)  # left by a killed save of this step
        partial.mkdir(parents=True)

    _on_rank0_then_everywhere(make_empty, partial, "create")
    return final, partial


def commit(partial: Path, final: Path, state: TrainingState, config_yaml: str) -> None:
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
            if state.data:
                marker[DATA] = state.data
            (partial / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        except OSError as err:
            raise write_failure(final, partial, err) from err
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)

    _on_rank0_then_everywhere(mark_and_rename, partial, "commit")
