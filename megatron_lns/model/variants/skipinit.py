"""SkipInit (De & Smith, 2020), ``h = h + a f(LN(h))`` with a learnable scalar ``a``
starting at 0 (``*_bda.gate``): every block starts as the identity. Exports to the stock
Pre-LN classes with ``a`` folded into ``o_proj`` / ``down_proj``."""

from __future__ import annotations

import torch

from megatron_lns.model.variants.residual import ResidualBranch
from megatron_lns.model.variants.settings import VariantSettings


def build(layer: torch.nn.Module, settings: VariantSettings) -> None:
    for slot in ("self_attn_bda", "mlp_bda"):
        start = torch.zeros(1, dtype=layer.config.params_dtype)
        setattr(layer, slot, ResidualBranch(layer.config, gain=("gate", start)))
