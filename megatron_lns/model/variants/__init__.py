"""The layer variants: each norm placement or residual rule is one module here and one
entry in ``megatron_lns/config/layer_variants.py`` (its name, ``compare`` label, LNS rule,
Hugging Face refusal and this package's module), selected by ``model.layer_variant``.

Each module is named by its entry (``LayerVariantInfo.module``), which also says what the
variant's layer computes (``layer``).

A variant module has ``build(layer, settings)``, which rebuilds what the variant changes in
a megatron layer after construction (:class:`VariantTransformerLayer`), and may have
``check(settings)`` for its own settings. ``residual.py`` holds the bias-dropout-add module
the residual variants share; ``per_layer_init.py`` builds a per-layer output init (the
depth-scaled init, registered in ``config/output_inits.py``). The norm scaling rules (LNS)
are registered in ``config/norm_scalings.py`` and applied by ``model/scaling.py`` and
``model/layer.py``. Definitions and sources: ``docs/variants.md``.
"""

from megatron_lns.model.variants.deepnorm import (
    deepnorm_alpha,
    deepnorm_beta,
    feed_forward_networks,
)
from megatron_lns.model.variants.mix_ln import num_post_norm_layers
from megatron_lns.model.variants.per_layer_init import depth_scaled_std
from megatron_lns.model.variants.residual import ResidualBranch
from megatron_lns.model.variants.settings import PLAIN_PRE_LN, VariantSettings
from megatron_lns.model.variants.variant_layer import VariantTransformerLayer

__all__ = [
    "PLAIN_PRE_LN",
    "ResidualBranch",
    "VariantSettings",
    "VariantTransformerLayer",
    "deepnorm_alpha",
    "deepnorm_beta",
    "depth_scaled_std",
    "feed_forward_networks",
    "num_post_norm_layers",
]
