"""Depth-scaled init (``output_layer_init: depth_scaled``): the output projections of layer
``l`` (``linear_proj``, ``linear_fc2``) start at ``N(0, std / sqrt(2 l))``, with ``l`` the
layer's global number. The other two inits are megatron's own and need no layer of ours:
``normal`` (``N(0, std)``, the LNS paper's advice) and ``scaled`` (``std / sqrt(2 L)``)."""

from __future__ import annotations

import copy
import math
from typing import Any

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_rank, init_method_normal


def depth_scaled_std(std: float, layer_number: int) -> float:
    """Depth-scaled init of layer ``l``'s output projections: ``std / sqrt(2 l)``."""
    return std / math.sqrt(2.0 * layer_number)


def with_depth_scaled_output_init(
    config: TransformerConfig, layer_number: int, kwargs: dict[str, Any]
) -> tuple[TransformerConfig, int]:
    """A per-layer copy of ``config`` whose output projections start at std/sqrt(2 l), and l.

    The global ``l`` is computed with megatron's own offset function, with the arguments
    megatron's TransformerLayer will use; the layer checks the two agree after construction.
    """
    pg_collection = kwargs.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()
    offset = get_transformer_layer_offset(
        config, kwargs.get("vp_stage"), get_pg_rank(pg_collection.pp)
    )
    layer_config = copy.copy(config)
    global_number = layer_number + offset
    std = depth_scaled_std(config.init_method_std, global_number)
    layer_config.output_layer_init_method = init_method_normal(std)
    return layer_config, global_number
