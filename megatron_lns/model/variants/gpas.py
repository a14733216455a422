"""GPAS, gradient-preserving activation scaling (Chen et al., NeurIPS 2025), on Pre-LN.

After each sublayer's residual add the residual stream ``x'`` is scaled down in the
forward pass while its gradient passes unscaled::

    x = x' - SiLU(alpha_l) * stopgrad(x')

so the forward value is ``(1 - SiLU(alpha_l)) x'``, the gradient reaching ``x'`` is the
gradient of ``x`` unchanged, and ``alpha_l`` learns from
``dL/dalpha_l = -SiLU'(alpha_l) <stopgrad(x'), dL/dx>``. ``alpha_l`` is one learnable
scalar per layer, shared by the layer's attention and MLP adds and initialised to 0
(SiLU(0) = 0: the model starts as plain Pre-LN), as in the authors' code
(github.com/dandingsky/GPAS, ``GPASBlock`` in ``peft_pretraining/modeling_llama.py``).

New parameter: ``gpas.alpha`` of shape ``(1,)`` per layer, replicated across tensor
parallelism (marked ``sequence_parallel`` so megatron all-reduces its gradient when each
rank holds its own tokens).

With LNS (``norm_scaling: lns``) both apply and do different things: LNS scales each
branch's *input* (the pre-norm output) by ``1/sqrt(l)``, GPAS scales the *residual stream*
after each add; the authors' ``lns_gpas`` is this combination.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_lns.model.variants.residual import BiasDropoutAddSlot
from megatron_lns.model.variants.settings import VariantSettings


class GPASGate(torch.nn.Module):
    """A layer's learnable ``alpha``, and the scaling it applies to the residual stream."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        self.alpha.sequence_parallel = config.sequence_parallel

    def forward(self, stream: Tensor) -> Tensor:
        return stream - F.silu(self.alpha).to(stream.dtype) * stream.detach()


class GPASResidual(BiasDropoutAddSlot):
    """megatron's bias-dropout-add followed by the layer's GPAS scaling:
    ``gpas(residual + dropout(branch + bias))``.

    Holds the layer's :class:`GPASGate` without registering it: both sublayers share one
    ``alpha``, which the layer owns (``gpas.alpha``) and checkpoints once.
    """

    def __init__(self, gate: GPASGate) -> None:
        super().__init__()
        self._gate = (gate,)

    def join(self, branch: Tensor, residual: Tensor, prob: float, training: bool) -> Tensor:
        return self._gate[0](residual + F.dropout(branch, p=prob, training=training))


def build(layer: torch.nn.Module, settings: VariantSettings) -> None:
    """Scale ``layer``'s residual stream after both of its adds (a megatron TransformerLayer)."""
    layer.gpas = GPASGate(layer.config)
    layer.self_attn_bda = GPASResidual(layer.gpas)
    layer.mlp_bda = GPASResidual(layer.gpas)
