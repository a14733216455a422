"""Mix-LN (Li et al., ICLR 2025): Post-LN in the first ``floor(fraction * N)`` layers,
Pre-LN after. The layer's *global* number decides, so the split is right under pipeline
and virtual pipeline parallelism; its layers differ in their parameters, so megatron
checkpoints each under its own key (``heterogeneous_layers`` in the registry)."""

from __future__ import annotations

import math

import torch

from megatron_lns.model.variants.residual import normalise_after_add
from megatron_lns.model.variants.settings import VariantSettings


def num_post_norm_layers(num_layers: int, post_fraction: float) -> int:
    """Mix-LN: the first ``floor(fraction * N)`` layers are Post-LN."""
    return math.floor(post_fraction * num_layers)


def build(layer: torch.nn.Module, settings: VariantSettings) -> None:
    fraction = settings.option("mix_ln_post_fraction")  # its key, in its registration
    post_layers = num_post_norm_layers(layer.config.num_layers, fraction)
    if layer.layer_number <= post_layers:
        normalise_after_add(layer)
