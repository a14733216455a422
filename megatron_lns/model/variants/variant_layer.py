"""``VariantTransformerLayer``: megatron's TransformerLayer (with LNS) built as a
registered layer variant says.

The layer is megatron's, its forward untouched; after construction the variant's module
(``config/layer_variants.py`` names it) rebuilds what it changes: the bias-dropout-add
slots (``self_attn_bda``, ``mlp_bda``), where the norms sit, the init of some weights.
The layer's global number (megatron's ``layer_number``) decides per-layer choices (Mix-LN's
split, a per-layer output init), so they are right under pipeline and virtual pipeline
parallelism.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_lns.config.output_inits import output_init_info
from megatron_lns.model.layer import LNSTransformerLayer
from megatron_lns.model.scaling import ScaledNorm
from megatron_lns.model.variants.per_layer_init import with_per_layer_output_init
from megatron_lns.model.variants.settings import PLAIN_PRE_LN, VariantSettings


class VariantTransformerLayer(LNSTransformerLayer):
    """megatron's TransformerLayer with one of the registered layer variants."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        variant: VariantSettings = PLAIN_PRE_LN,
        **kwargs: Any,
    ) -> None:
        """``kwargs``: :class:`LNSTransformerLayer`'s (``norm_scaling`` is "none" unless
        given) and megatron's."""
        kwargs.setdefault("norm_scaling", "none")
        variant.check(kwargs["norm_scaling"])
        self.variant = variant
        expected_number = None
        init = output_init_info(variant.output_init)
        if init.per_layer:
            config, expected_number = with_per_layer_output_init(config, layer_number, kwargs, init)
        if config.inference_fuse_tp_communication:
            raise ValueError(
                f"layer_variant={variant.layer_variant!r}: megatron's fused inference path "
                "(inference_fuse_tp_communication) adds the residual inside its kernels and "
                "would skip the variant's residual; build the model without it"
            )
        super().__init__(config, submodules, layer_number, **kwargs)
        if expected_number is not None and expected_number != self.layer_number:
            raise RuntimeError(
                f"output_layer_init={init.name} assumed global layer {expected_number}, "
                f"megatron numbered it {self.layer_number}"
            )
        self.post_norm = False  # set by a variant that moves the norms after the adds
        variant.module().build(self, variant)

    def pre_norm_owners(self) -> list[ScaledNorm]:
        """Post-norm layers have no pre-norm for LNS to scale."""
        if getattr(self, "post_norm", False):
            return []
        return super().pre_norm_owners()
