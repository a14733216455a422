"""The layer variants: each norm placement or residual rule is one module here and one
entry in ``megatron_lns/config/layer_variants.py`` (its name, ``compare`` label, LNS rule,
Hugging Face refusal and this package's module), selected by ``model.layer_variant``.

================  ==========================================  ========================
variant           layer                                       module
================  ==========================================  ========================
``pre_ln``        ``h + f(LN(h))`` (megatron's own)           ``pre_ln.py``
``post_ln``       ``LN(h + f(h))``                            ``post_ln.py``
``deepnorm``      ``LN(alpha h + f(h))``, beta-scaled init    ``deepnorm.py``
``mix_ln``        Post-LN first, Pre-LN after                 ``mix_ln.py``
``layerscale``    ``h + diag(g) f(LN(h))``                    ``layerscale.py``
``skipinit``      ``h + a f(LN(h))``, ``a`` from 0            ``skipinit.py``
``peri_ln``       ``h + LN(f(LN(h)))``                        ``peri_ln.py``
``gpas``          ``x - SiLU(alpha) sg(x)`` after each add    ``gpas.py``
================  ==========================================  ========================

A variant module has ``build(layer, settings)``, which rebuilds what the variant changes in
a megatron layer after construction (:class:`VariantTransformerLayer`), and may have
``check(settings)`` for its own settings. ``residual.py`` holds the bias-dropout-add module
the residual variants share; ``depth_scaled_init.py`` the depth-scaled init. LNS itself is
``model/scaling.py`` and ``model/layer.py``. Definitions and sources: ``docs/variants.md``.
"""

from megatron_lns.model.variants.deepnorm import (
    deepnorm_alpha,
    deepnorm_beta,
    feed_forward_networks,
)
from megatron_lns.model.variants.depth_scaled_init import depth_scaled_std
from megatron_lns.model.variants.mix_ln import num_post_norm_layers
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
