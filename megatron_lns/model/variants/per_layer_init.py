"""A per-layer init of the residual output projections (``linear_proj``, ``linear_fc2``):
an output init registered with ``per_layer=True`` in ``config/output_inits.py`` (the
depth-scaled init, ``N(0, std / sqrt(2 l))``) gives each layer its own std from the layer's
global number ``l``. The model-wide inits (``normal``, ``scaled``) are megatron's
``output_layer_init_method`` and need no layer of ours (``GPTModelConfig.transformer_config``).
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_rank, init_method_normal

from megatron_lns.config.output_inits import OutputInitInfo
from megatron_lns.config.output_inits import depth_scaled_std as depth_scaled_std


def with_per_layer_output_init(
    config: TransformerConfig, layer_number: int, kwargs: dict[str, Any], init: OutputInitInfo
) -> tuple[TransformerConfig, int]:
    """A per-layer copy of ``config`` whose output projections start at ``init``'s std for
    global layer l, and l.

    The global ``l`` is computed with megatron's own offset function, with the arguments
    megatron's TransformerLayer will use; the layer checks the two agree after construction.
    """
    pg_collection = kwargs.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()
    offset = get_transformer_layer_offset(
        config, kwargs.get("vp_stage"), get_pg_rank(pg_collection.pp)
    )
    layer_config = copy.copy(config)
    global_number = layer_number + offset
    std = init.std(config.init_method_std, config.num_layers, global_number)
    layer_config.output_layer_init_method = init_method_normal(std)
    return layer_config, global_number
