"""Peri-LN (Kim et al., ICML 2025): a norm on the input *and* on the output of every
sublayer, before the residual add::

    h = h + Norm_out(f(Norm_in(h)))

for attention and MLP alike, with the usual final norm. ``Norm_in`` is megatron's pre-norm
(``input_layernorm`` / ``pre_mlp_layernorm``, unchanged); ``Norm_out`` is a
:class:`~megatron_lns.model.norms.LocalNorm` of ``config.normalization`` held by the
bias-dropout-add slot, so the residual stream itself is never normalised and its variance
grows by at most one normalised branch per sublayer. Gemma 2/3 and OLMo 2 normalise the
same way (OLMo 2 without ``Norm_in``).

New parameters: ``self_attn_bda.output_norm.weight`` / ``mlp_bda.output_norm.weight`` (and
``.bias`` with LayerNorm), replicated across tensor parallelism like every norm.

LNS is refused: it scales the pre-norm output by ``1/sqrt(l)`` so that deep branches add
less to the residual stream, and ``Norm_out`` re-normalises each branch before the add,
which undoes that scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_lns.model.norms import LocalNorm
from megatron_lns.model.variants.residual import BiasDropoutAddSlot
from megatron_lns.model.variants.settings import VariantSettings


class PeriNormResidual(BiasDropoutAddSlot):
    """megatron's bias-dropout-add with a norm on the branch before the add:
    ``residual + dropout(Norm_out(branch + bias))``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.output_norm = LocalNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def join(self, branch: Tensor, residual: Tensor, prob: float, training: bool) -> Tensor:
        branch = F.dropout(self.output_norm(branch), p=prob, training=training)
        return residual + branch


def build(layer: torch.nn.Module, settings: VariantSettings) -> None:
    """Give both sublayers of ``layer`` (a megatron TransformerLayer) their output norm."""
    layer.self_attn_bda = PeriNormResidual(layer.config)
    layer.mlp_bda = PeriNormResidual(layer.config)
