"""``LNSTransformerLayer``: megatron's TransformerLayer with LayerNorm Scaling.

megatron computes ``self.layer_number`` in ``TransformerLayer.__init__`` as the
layer's *global* 1-based index: the index inside its block plus the offset of its
pipeline stage and virtual-pipeline chunk (uneven first/last stages included). That
is exactly the ``l`` of LNS, so the layer reads it after ``super().__init__`` and
hands ``1/sqrt(l)`` to whichever modules own its two pre-norms:

* local backend: the separate ``input_layernorm`` / ``pre_mlp_layernorm`` modules
  (:class:`~megatron_lns.model.norms.LocalNorm`);
* Transformer Engine backend: the norms fused into ``linear_qkv`` / ``linear_fc1``
  (see ``megatron_lns.model.te``).

The forward pass is megatron's, untouched. The factor is derived from the layer
number at construction and handed to the norm owners as a plain float attribute:
never a buffer or parameter, never in a state dict, so meta-device init,
``to_empty``, ``load_state_dict`` and resharding cannot lose or corrupt it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import Tensor

from megatron_lns.config.norm_scalings import UNSCALED
from megatron_lns.model.scaling import (
    NormScaling,
    ScaledNorm,
    fold_scale_into_beta,
    fold_scale_into_gamma,
    norm_output_scale,
    require_affine,
)


def baked_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every layer's LNS factor multiplied into its norm weights.

    This is what exporters that read raw weights must be given (megatron's
    ``TRTLLMHelper``, modelopt, Hugging Face conversion): loaded into a plain Pre-LN
    model (``norm_scaling="none"``) it computes the same function. The plain
    ``state_dict()`` holds the unscaled parameters, as checkpoints must.
    """
    state = model.state_dict()
    names = {id(module): name for name, module in model.named_modules()}
    for module in model.modules():
        if not isinstance(module, LNSTransformerLayer) or module.norm_output_scale == 1.0:
            continue
        scale = module.norm_output_scale
        for owner in module.pre_norm_owners():
            require_affine(owner)
            prefix = names[id(owner)] + "." if names[id(owner)] else ""
            gamma_key, beta_key = (prefix + name for name in owner.norm_parameter_names)
            state[gamma_key] = fold_scale_into_gamma(
                state[gamma_key], scale, owner.zero_centered_gamma
            )
            if beta_key in state:
                state[beta_key] = fold_scale_into_beta(state[beta_key], scale)
    return state


def bake_norm_scaling(model: torch.nn.Module) -> torch.nn.Module:
    """Bake LNS into the norm weights of every layer of ``model`` (see the method)."""
    for module in model.modules():
        if isinstance(module, LNSTransformerLayer):
            module.bake_norm_scaling()
    return model


class LNSTransformerLayer(TransformerLayer):
    """A Pre-LN transformer layer whose pre-norm outputs are scaled by ``1/sqrt(l)``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        norm_scaling: NormScaling = "lns",
        block_numbers: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, submodules, layer_number, hidden_dropout, **kwargs)
        self.norm_scaling = norm_scaling
        # A hybrid stack's sublayer: megatron's layer_number counts sublayers, the paper's
        # depth counts blocks (hybrid_pattern.block_numbers).
        self.block_number = (
            block_numbers[self.layer_number - 1] if block_numbers else self.layer_number
        )
        scale = self.norm_output_scale
        for owner in self.pre_norm_owners():
            if not isinstance(owner, ScaledNorm):
                raise TypeError(
                    f"{type(owner).__name__} cannot apply a norm output scale; build the layer "
                    "with megatron_lns.model.specs.get_lns_layer_spec so its norms support LNS"
                )
            owner.output_scale = scale

    def get_qkv_layer_norm_weights(self) -> Tensor:
        """megatron's getter for the fused QKV norm weight, refused while LNS is unbaked.

        megatron's inference fused-communication path (``inference_fuse_tp_communication``)
        calls it once while building the block, keeps the tensor, and applies the norm
        in the previous layer's kernels instead of ``linear_qkv``'s forward. megatron's
        getter returns the parameter's own storage, so a checkpoint loaded later is seen;
        a factor folded in at construction would be a stale copy, and a forward-time
        factor is bypassed. So with a factor other than 1 this refuses (bake first); with
        factor 1 (layer 1, Pre-LN, or baked) it is megatron's getter.
        """
        self._refuse_unbaked_norm_weight_getter(self.self_attention, "linear_qkv")
        return super().get_qkv_layer_norm_weights()

    def get_mlp_layer_norm_weights(self) -> Tensor:
        """megatron's getter for the fused FC1 norm weight, refused while LNS is unbaked
        (see :meth:`get_qkv_layer_norm_weights`)."""
        self._refuse_unbaked_norm_weight_getter(self.mlp, "linear_fc1")
        return super().get_mlp_layer_norm_weights()

    def _refuse_unbaked_norm_weight_getter(self, parent: torch.nn.Module, name: str) -> None:
        if "layer_norm_weight" not in getattr(getattr(parent, name, None), "_parameters", {}):
            raise AttributeError(
                "this layer has no fused norm + linear; its norms are separate modules"
            )
        if self.norm_output_scale != 1.0:
            raise ValueError(
                f"layer {self.layer_number} applies the LNS factor 1/sqrt({self.block_number}) "
                f"in {name}'s forward, which megatron's inference fused-communication path "
                "(inference_fuse_tp_communication) bypasses with a norm weight kept from "
                "construction; build the inference model with norm_scaling='none' and load "
                "megatron_lns.model.layer.baked_state_dict(lns_model) into it"
            )

    def bake_norm_scaling(self) -> None:
        """Multiply the factor into the norm parameters for good and stop applying it.

        For exporters that read raw weights (modelopt / TRT-LLM, Hugging Face): afterwards
        the layer is an ordinary Pre-LN layer with the same function.
        """
        scale = self.norm_output_scale
        if scale == 1.0:
            return
        for owner in self.pre_norm_owners():
            owner.bake_output_scale()
        self.norm_scaling = UNSCALED[0]  # the factor is in the weights now

    @property
    def norm_output_scale(self) -> float:
        """``1/sqrt(l)`` of this layer's block ``l`` with LNS, 1.0 for plain Pre-LN."""
        return norm_output_scale(self.norm_scaling, self.block_number)

    def pre_norm_owners(self) -> list[ScaledNorm]:
        """The modules that apply this layer's attention and MLP pre-norms.

        A separate norm module when the spec has one, else the fused norm+linear that
        follows it (``linear_qkv`` / ``linear_fc1`` in the Transformer Engine spec).
        """
        owners = []
        for norm, fused in (
            (self.input_layernorm, getattr(self.self_attention, "linear_qkv", None)),
            (self.pre_mlp_layernorm, getattr(self.mlp, "linear_fc1", None)),
        ):
            owners.append(fused if isinstance(norm, IdentityOp) else norm)
        return [owner for owner in owners if owner is not None]
