"""Model weights alone: saved for conversion and analysis, loaded from any checkpoint.

Sharded tensors carry global keys and offsets, so weights written at one TP/PP/VP layout
load at any other. Each virtual-pipeline chunk is stored under ``model{i}`` as Megatron-LM
does. A GPT checkpoint loads into the hybrid model, nothing else crosses
(``architecture_checkpoint.py``). A weights-only checkpoint (``import-hf`` writes them) is
complete: training starts from it with a fresh optimizer and schedule.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.model.language_model import unwrap
from megatron_lns.training import architecture_checkpoint as architecture
from megatron_lns.training import provenance
from megatron_lns.training.checkpoint_dirs import (
    COMPLETE_MARKER,
    WEIGHTS_ONLY,
    ArchitectureMismatchError,
    CheckpointError,
    CheckpointMismatchError,
    TrainingState,
)
from megatron_lns.training.checkpoint_io import (
    EXTRA_STATE,
    extra_state_may_differ,
    key_filter,
    load_sharded,
    model_sharded_state_dict,
    read_common_state,
    save_sharded,
)
from megatron_lns.training.rewind import CHECKPOINT_ID, new_checkpoint_id


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
    save_sharded(sharded, directory, strategy)


def load_chunks(
    model: Sequence[torch.nn.Module], loaded: dict, directory, extra_state_may_differ: bool
) -> None:
    """Copy the loaded state into the chunks: strict, but for ``_extra_state`` when it may
    differ (``load_sharded`` has already refused any other difference)."""
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


def load_model_weights(
    model: Sequence[torch.nn.Module], directory: str | Path, common: dict | None = None
) -> None:
    """Load weights saved at any parallel layout, and by GPT into the hybrid model
    (``architecture_checkpoint.py``), into this rank's chunks (strict). ``common``: the
    checkpoint's common state where the caller has read it already (a resume has)."""
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise CheckpointError(f"{directory} is not a megatron distributed checkpoint")
    if common is None:
        common = read_common_state(directory)
    template = model_sharded_state_dict(model)
    translate_architecture(template, model, directory, common)
    extra_state = extra_state_may_differ(common, model)
    model_only = key_filter(extra_state)
    loaded = load_sharded(
        template, directory, may_differ=lambda key: _training_only(key) or model_only(key)
    )
    load_chunks(model, loaded, directory, extra_state)


def _training_only(key: str) -> bool:
    """A tensor of a training checkpoint that is not the model's (optimizer state, RNG):
    a weights-only load reads a training checkpoint's model and leaves these."""
    return key == "rng_state" or key.startswith("optimizer.")


def translate_architecture(template: dict, model, path: str | Path, common: dict) -> None:
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
