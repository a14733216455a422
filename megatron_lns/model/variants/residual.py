"""``ResidualBranch``: megatron's bias-dropout-add slot with a residual scale, a learnable
branch gain and a post-norm, each optional, shared by the variants that change only how a
sublayer's output joins the residual stream (Post-LN, DeepNorm, Mix-LN, LayerScale,
SkipInit)::

    out = norm(alpha * residual + gain * dropout(branch + bias))

``norm`` is present only in post-norm layers (whose pre-norms become identities),
``alpha`` is the DeepNorm residual scale (1 otherwise) and ``gain`` a learnable
per-channel vector (LayerScale) or scalar (SkipInit). megatron's forward runs untouched
around it.

Parameter names (all replicated across tensor parallelism, checkpointed per layer through
megatron's default sharded state dict, like a norm's): ``self_attn_bda.norm.weight`` /
``mlp_bda.norm.weight`` (post-norm layers, the norm moved from ``input_layernorm`` /
``pre_mlp_layernorm``), ``*_bda.layerscale``, ``*_bda.gate``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


class BiasDropoutAddSlot(torch.nn.Module):
    """A module in megatron's bias-dropout-add slot, called the way megatron calls its
    ``bda`` functions: ``module(training, fused)`` returns the function
    ``(branch_with_bias, residual, dropout_prob) -> output``. A subclass says in
    :meth:`join` how the branch (its bias added) joins the residual stream."""

    def forward(self, training: bool, fused: bool = False):
        return partial(self._add, training)

    def _add(
        self,
        training: bool,
        branch_with_bias: tuple[Tensor, Tensor | None],
        residual: Tensor,
        prob: float,
    ) -> Tensor:
        branch, bias = branch_with_bias
        if bias is not None:
            branch = branch + bias
        return self.join(branch, residual, prob, training)

    def join(self, branch: Tensor, residual: Tensor, prob: float, training: bool) -> Tensor:
        raise NotImplementedError


class ResidualBranch(BiasDropoutAddSlot):
    """megatron's bias-dropout-add with a residual scale, a learnable branch gain and a
    post-norm, each optional: ``norm(alpha * residual + gain * dropout(branch + bias))``.

    The gain is the variant's: its module names the parameter (``layerscale``, ``gate``:
    the checkpoint key under the slot, as the variant's registration lists it in
    ``branch_gains``) and gives its initial value (per channel or one scalar)."""

    def __init__(
        self,
        config: TransformerConfig,
        residual_scale: float = 1.0,
        gain: tuple[str, Tensor] | None = None,
        norm: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.residual_scale = residual_scale
        self.norm = norm
        self.gain_name: str | None = None
        if gain is not None:
            self.gain_name, initial = gain
            param = torch.nn.Parameter(initial.to(config.params_dtype))
            # Under sequence parallelism each TP rank sees its own tokens: megatron
            # all-reduces the gradients of parameters marked so.
            param.sequence_parallel = config.sequence_parallel
            self.register_parameter(self.gain_name, param)

    def join(self, branch: Tensor, residual: Tensor, prob: float, training: bool) -> Tensor:
        branch = F.dropout(branch, p=prob, training=training)
        if self.gain_name is not None:
            branch = branch * getattr(self, self.gain_name).to(branch.dtype)
        if self.residual_scale != 1.0:
            residual = residual * self.residual_scale
        out = residual + branch
        return self.norm(out) if self.norm is not None else out

    def extra_repr(self) -> str:
        return f"residual_scale={self.residual_scale:.6g}"


def normalise_after_add(layer: torch.nn.Module, residual_scale: float = 1.0) -> None:
    """Make ``layer`` a post-norm layer: its two pre-norms move after the residual adds,
    ``LN(alpha * h + f(h))``, and the layer says so (``layer.post_norm``)."""
    attn_norm, mlp_norm = layer.input_layernorm, layer.pre_mlp_layernorm
    if isinstance(attn_norm, IdentityOp) or isinstance(mlp_norm, IdentityOp):
        raise ValueError(
            f"layer_variant={layer.variant.layer_variant!r} needs separate norm modules "
            "(the local backend); fused norm + linear cannot move after the residual"
        )
    layer.input_layernorm = IdentityOp()
    layer.pre_mlp_layernorm = IdentityOp()
    layer.self_attn_bda = ResidualBranch(layer.config, residual_scale, norm=attn_norm)
    layer.mlp_bda = ResidualBranch(layer.config, residual_scale, norm=mlp_norm)
    layer.post_norm = True
