"""``LNSTransformerLayer``: megatron's TransformerLayer with LayerNorm Scaling.

megatron computes ``self.layer_number`` in ``TransformerLayer.__init__`` as the
layer's *global* 1-based index: the index inside its block plus the offset of its
pipeline stage and virtual-pipeline chunk (uneven first/last stages included). That
is exactly the ``l`` of LNS, so the layer reads it after ``super().__init__`` and
hands ``1/sqrt(l)`` to whichever modules own its two pre-norms:

* local backend: the separate ``input_layernorm`` / ``pre_mlp_layernorm`` modules
  (:class:`~megatron_lns.norms.LocalNorm`);
* Transformer Engine backend: the norms fused into ``linear_qkv`` / ``linear_fc1``
  (see ``megatron_lns.te``).

The forward pass is megatron's, untouched. The factor is recomputed from the layer
number whenever it is needed, so meta-device init, ``to_empty``, ``load_state_dict``
and resharding cannot lose or corrupt it.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_lns.scaling import NormScaling, norm_output_scale


class LNSTransformerLayer(TransformerLayer):
    """A Pre-LN transformer layer whose pre-norm outputs are scaled by ``1/sqrt(l)``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        norm_scaling: NormScaling = "lns",
        **kwargs: Any,
    ) -> None:
        super().__init__(config, submodules, layer_number, hidden_dropout, **kwargs)
        self.norm_scaling = norm_scaling
        scale = self.norm_output_scale
        for owner in self.pre_norm_owners():
            if not hasattr(owner, "output_scale"):
                raise TypeError(
                    f"{type(owner).__name__} cannot apply a norm output scale; build the layer "
                    "with megatron_lns.specs.get_lns_layer_spec so its norms support LNS"
                )
            owner.output_scale = scale

    @property
    def norm_output_scale(self) -> float:
        """``1/sqrt(self.layer_number)`` with LNS, 1.0 for plain Pre-LN."""
        return norm_output_scale(self.norm_scaling, self.layer_number)

    def pre_norm_owners(self) -> list[Any]:
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
