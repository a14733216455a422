"""LayerScale (Touvron et al., 2021), ``h = h + diag(g) f(LN(h))`` with a learnable
per-channel ``g`` starting at ``layerscale_init`` (``*_bda.layerscale``). Exports to the
stock Pre-LN classes with ``g`` folded into ``o_proj`` / ``down_proj`` rows."""

from __future__ import annotations

import torch

from megatron_lns.model.variants.residual import ResidualBranch
from megatron_lns.model.variants.settings import VariantSettings


def build(layer: torch.nn.Module, settings: VariantSettings) -> None:
    for slot in ("self_attn_bda", "mlp_bda"):
        config = layer.config
        start = torch.full(
            (config.hidden_size,), settings.option("layerscale_init"), dtype=config.params_dtype
        )
        branch = ResidualBranch(config, gain=("layerscale", start))
        setattr(layer, slot, branch)
