"""``model``'s LayerNorm Scaling and layer-variant keys: where the norms sit and how each
sublayer is scaled and initialised."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lns.config.choices import (
    LAYER_VARIANTS,
    NORM_SCALING_CHOICES,
    OUTPUT_LAYER_INITS,
)
from megatron_lns.config.layer_variants import LNS_VARIANTS, REGISTRY
from megatron_lns.config.rules import (
    one_of,
    positive,
    probability,
)
from megatron_lns.config.settings import HF_CONVERTER, setting, to

# The layer_variant row of docs/configuration.md, from the registry.
_VARIANT_LAYERS = (
    ", ".join(f"`{name}` ({info.layer})" for name, info in REGISTRY.items())
    + f". `norm_scaling: lns` only with {', '.join(f'`{n}`' for n in LNS_VARIANTS)}; other "
    "than `pre_ln` needs `transformer_engine: false`"
)


@dataclass
class LnsSettings:
    """``model``'s LNS and layer-variant keys (the ``lns`` table)."""

    norm_scaling: str = setting(
        "lns",
        one_of(NORM_SCALING_CHOICES),
        target="layer_spec.norm_scaling",
        group="lns",
        doc=(
            "`lns`: both pre-norms of block `l` scaled by `1/sqrt(l)`; `none`: plain Pre-LN (same"
            " parameters and checkpoint keys)"
        ),
        hf=HF_CONVERTER,
    )
    output_layer_init: str | None = setting(
        None,
        one_of(OUTPUT_LAYER_INITS),
        target="TransformerConfig.output_layer_init_method",
        translate=to("output_layer_init"),
        group="lns",
        doc=(
            "(NeMo: `use_scaled_init_method`) init of the residual output projections "
            "(`linear_proj`, `linear_fc2`): `normal` = N(0, init_method_std) (the paper's advice "
            "with LNS), `scaled` = megatron's N(0, std/sqrt(2L)), `depth_scaled` = N(0, "
            "std/sqrt(2l)) in layer l (local backend); null = `normal` with LNS, `scaled` without"
        ),
    )
    layer_variant: str = setting(
        "pre_ln",
        one_of(LAYER_VARIANTS),
        target="layer_spec.layer_variant",
        group="lns",
        doc=(
            "registered in `config/layer_variants.py` ([variants.md](variants.md)): "
            + _VARIANT_LAYERS
        ),
        shapes=True,
        hf=HF_CONVERTER,
    )
    mix_ln_post_fraction: float = setting(
        0.25,
        probability,
        target="layer_spec.mix_ln_post_fraction",
        group="lns",
        doc="Mix-LN: layers `l <= floor(fraction * num_layers)` are Post-LN; in [0, 1]",
        shapes=True,
        hf=HF_CONVERTER,
    )
    layerscale_init: float = setting(
        1e-3,
        positive,
        target="layer_spec.layerscale_init",
        group="lns",
        doc="LayerScale: initial value of every channel's branch scale; > 0",
    )
