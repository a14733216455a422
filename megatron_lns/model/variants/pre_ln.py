"""Pre-LN, ``h = h + f(LN(h))``: megatron's own layer. The layer variant that changes
nothing (with ``output_layer_init: depth_scaled`` the layer is still built through
:class:`~megatron_lns.model.variants.layer.VariantTransformerLayer` for its init)."""

from __future__ import annotations

import torch

from megatron_lns.model.variants.settings import VariantSettings


def build(layer: torch.nn.Module, settings: VariantSettings) -> None:
    """Nothing to change: megatron's residual add and pre-norms are Pre-LN."""
