"""Which architecture wrote a checkpoint, and loading a GPT run's checkpoints into the
hybrid model (issue 20: GPT -> ``HybridModel`` migration).

Every checkpoint records the architecture that wrote it in its common state
(:data:`ARCHITECTURE`: ``{"name": "gpt"}`` or ``{"name": "hybrid", "sublayers": ...}``);
a checkpoint without the record was written before the hybrid model existed, by GPT.

A GPT checkpoint loads into a hybrid model whose pattern is the GPT model's twin
(``*-`` / ``*E`` per layer) without being rewritten on disk: the hybrid model's template
(its sharded state dict, and the optimizer's, which carries the same keys) is pointed at
the GPT keys before ``dist_checkpointing`` reads, so weights, optimizer moments and main
parameters all come from the GPT run, at any TP/PP layout. Sublayer ``j`` reads GPT layer
``j // 2``; ``decoder.final_norm.`` reads ``decoder.final_layernorm.``. GPT checkpoints
come in two layouts (megatron's ``TransformerBlock.sharded_state_dict``):

* homogeneous layers (a dense model) are stacked along a leading layer axis
  (``decoder.layers.mlp.linear_fc1.weight`` of shape ``[L, ...]``): megatron-core's own
  load-time translation (``dist_checkpointing.gpt_checkpoint_interop``) does this one;
* per-layer keys (``decoder.layers.{i}.``: MoE runs with ``moe_layer_freq`` as a list,
  Mix-LN), which megatron-core's translation does not read: :func:`_retarget_per_layer`,
  the same rewrite without the layer axis.

The reverse (a hybrid checkpoint into the GPT model) is refused, as megatron-core refuses
it: the hybrid model is GPT's successor, and a hybrid run resumes with
``model.architecture=hybrid``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
    GPTCompatLayerMaps,
    retarget_sharded_state_dict_to_gpt_checkpoint,
)
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.models.hybrid.hybrid_model import HybridModel

from megatron_lns.config import hybrid_pattern
from megatron_lns.model.language_model import unwrap

# The common-state entry that names the architecture which wrote a checkpoint.
ARCHITECTURE = "architecture"
GPT = {"name": "gpt"}

_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.")
# HybridModel files an empty ``output_layer._extra_state`` that GPT checkpoints omit
# (megatron-core's translation keeps it local too).
_GPT_OMITTED = "output_layer._extra_state"


def model_architecture(model: Sequence[torch.nn.Module]) -> dict:
    """The record for a checkpoint of ``model`` (this rank's chunks): the hybrid model's
    sublayers, pipeline separators left out (they belong to the layout, not the model)."""
    bare = unwrap(model[0])
    if isinstance(bare, HybridModel):
        return {"name": "hybrid", "sublayers": hybrid_pattern.sublayers(bare.hybrid_layer_pattern)}
    return dict(GPT)


def saved_architecture(common: dict) -> dict:
    """The architecture a checkpoint's common state records; GPT where it records none."""
    saved = common.get(ARCHITECTURE) if isinstance(common, dict) else None
    return saved if isinstance(saved, dict) and "name" in saved else dict(GPT)


def read_saved_architecture(path: str | Path) -> dict:
    return saved_architecture(dist_checkpointing.load_common_state_dict(str(path)))


def architecture_mismatch(saved: dict, current: dict) -> str | None:
    """Why a checkpoint of ``saved`` cannot load into ``current``; None when it can."""
    if saved["name"] == current["name"] == "hybrid":
        if saved.get("sublayers") != current["sublayers"]:
            held = (
                f"the hybrid pattern {saved['sublayers']!r}"
                if saved.get("sublayers") is not None
                else "a hybrid pattern it does not record"
            )
            return (
                f"it holds {held} (pipeline '|' aside), "
                f"this model {current['sublayers']!r}: resume with that "
                "model.hybrid_layer_pattern ('|' placed for the new pipeline layout)"
            )
        return None
    if saved["name"] == "hybrid":
        return (
            "it was written by the hybrid model: resume it with model.architecture=hybrid (GPT "
            "checkpoints load into the hybrid model, not the reverse, as in megatron-core)"
        )
    if current["name"] == "hybrid" and not hybrid_pattern.is_gpt_equivalent(current["sublayers"]):
        return (
            f"it was written by the GPT model, which loads only into the hybrid pattern that "
            f"is its twin (an attention and one MLP or MoE per layer), not "
            f"{current['sublayers']!r}: drop model.hybrid_layer_pattern"
        )
    return None


def needs_gpt_translation(saved: dict, current: dict) -> bool:
    return saved["name"] == "gpt" and current["name"] == "hybrid"


def has_per_layer_keys(path: str | Path) -> bool:
    """Whether a GPT checkpoint files its layers under ``decoder.layers.{i}.`` rather
    than stacked along a layer axis."""
    keys = dist_checkpointing.load_tensors_metadata(str(path))
    return any(_LAYER_KEY.search(key) for key in keys)


def retarget_to_gpt_checkpoint(
    template: dict, sublayers: str, per_layer: bool, parts: Sequence[str]
) -> None:
    """Point the ``parts`` of a loading template (``model{i}``, ``optimizer``) of the
    hybrid model with GPT-twin ``sublayers`` at a GPT checkpoint's keys, in place.

    The nesting of the template keeps the hybrid model's names, so the loaded state goes
    back into the hybrid model's modules and optimizer."""
    gpt_layer = {j: j // 2 for j in range(len(sublayers))}
    for part in parts:
        if part not in template:
            continue
        if per_layer:
            _retarget_per_layer(template[part], gpt_layer)
        else:
            maps = GPTCompatLayerMaps(
                attention_to_gpt={j: i for j, i in gpt_layer.items() if j % 2 == 0},
                mlp_to_gpt={j: i for j, i in gpt_layer.items() if j % 2 == 1},
                fresh_init=frozenset(),
                num_gpt_layers=len(sublayers) // 2,
            )
            retarget_sharded_state_dict_to_gpt_checkpoint(template[part], maps)


def _retarget_per_layer(sharded: dict, gpt_layer: dict[int, int]) -> None:
    """megatron-core's translation for a GPT checkpoint with per-layer keys: sublayer
    ``j``'s entries read ``decoder.layers.{gpt_layer[j]}.``, no layer axis added."""

    def retarget(entry):
        if not isinstance(entry, ShardedBase):
            return entry
        if entry.key.endswith(_GPT_OMITTED):
            return LocalNonpersistentObject(entry.data)
        match = _LAYER_KEY.search(entry.key)
        if match is not None:
            before, after = entry.key[: match.start()], entry.key[match.end() :]
            entry.key = f"{before}decoder.layers.{gpt_layer[int(match.group(1))]}.{after}"
        else:
            entry.key = entry.key.replace(
                hybrid_pattern.HYBRID_FINAL_NORM, hybrid_pattern.GPT_FINAL_NORM
            )
        return entry

    dict_list_map_inplace(retarget, sharded)
