"""Model weights through megatron's ``dist_checkpointing`` (torch_dist format).

Sharded tensors carry global keys and offsets, so a checkpoint written at one
TP/PP/VP layout loads at any other. Each virtual-pipeline chunk is stored under
``model{i}`` as Megatron-LM does; the keys inside are global, so the chunk count
may differ between save and load.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from megatron.core import dist_checkpointing


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def model_sharded_state_dict(model: Sequence[torch.nn.Module]) -> dict:
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def save_model_weights(model: Sequence[torch.nn.Module], directory: str | Path) -> None:
    """Write this rank's shards of every chunk; all ranks must call it."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model_sharded_state_dict(model), str(directory))


def load_model_weights(model: Sequence[torch.nn.Module], directory: str | Path) -> None:
    """Load weights saved at any parallel layout into this rank's chunks (strict)."""
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise FileNotFoundError(f"{directory} is not a complete megatron distributed checkpoint")
    loaded = dist_checkpointing.load(model_sharded_state_dict(model), str(directory))
    for i, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
