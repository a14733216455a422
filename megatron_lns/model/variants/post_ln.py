"""Post-LN (Vaswani et al., 2017), ``h = LN(h + f(h))`` in every layer: both norms move
from before the branch to after the residual add (``residual.normalise_after_add``)."""

from __future__ import annotations

import torch

from megatron_lns.model.variants.residual import normalise_after_add
from megatron_lns.model.variants.settings import VariantSettings


def build(layer: torch.nn.Module, settings: VariantSettings) -> None:
    normalise_after_add(layer)
