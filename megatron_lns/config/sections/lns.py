"""``model``'s LayerNorm Scaling and layer-variant keys: where the norms sit and how each
sublayer is scaled and initialised.

The vocabularies and the key rows come from the registries (``config/norm_scalings.py``,
``config/output_inits.py``, ``config/layer_variants.py``), and so do the layer variants'
own keys (``mix_ln_post_fraction``, ``layerscale_init``): each is declared in its variant's
registration and becomes a field of :class:`LnsSettings` here, after the three shared keys,
so a variant with a setting of its own touches no file but its module and its entry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_lns.config.layer_variants import LNS_VARIANTS, VARIANT_KEYS, VariantKey
from megatron_lns.config.layer_variants import REGISTRY as LAYER_VARIANTS
from megatron_lns.config.norm_scalings import REGISTRY as NORM_SCALINGS
from megatron_lns.config.output_inits import REGISTRY as OUTPUT_INITS
from megatron_lns.config.rules import one_of
from megatron_lns.config.settings import HF_CONVERTER, listed_in, setting, to


def _rows(registry: dict, what: str) -> str:
    return ", ".join(f"`{name}`: {getattr(info, what)}" for name, info in registry.items())


# The key rows of docs/configuration.md, from the registries.
_VARIANT_LAYERS = (
    ", ".join(f"`{name}` ({info.layer})" for name, info in LAYER_VARIANTS.items())
    + f". `norm_scaling: lns` only with {', '.join(f'`{n}`' for n in LNS_VARIANTS)}; other "
    "than `pre_ln` needs `transformer_engine: false`"
)
_NULL_INIT = ", ".join(
    f"`{info.default_output_init}` with `{name}`" for name, info in NORM_SCALINGS.items()
)


@listed_in("lns")
@dataclass
class _SharedLnsSettings:
    """The keys every model has; the variants' own keys follow (:class:`LnsSettings`)."""

    norm_scaling: str = setting(
        "lns",
        one_of(NORM_SCALINGS),
        target="layer_spec",
        doc=f"registered in `config/norm_scalings.py`: {_rows(NORM_SCALINGS, 'math')}",
        hf=HF_CONVERTER,
    )
    output_layer_init: str | None = setting(
        None,
        one_of(OUTPUT_INITS),
        target="TransformerConfig.output_layer_init_method",
        translate=to("output_layer_init"),
        doc=(
            "(NeMo: `use_scaled_init_method`) init of the residual output projections "
            "(`linear_proj`, `linear_fc2`), registered in `config/output_inits.py`: "
            f"{_rows(OUTPUT_INITS, 'math')}; null = {_NULL_INIT}"
        ),
    )
    layer_variant: str = setting(
        "pre_ln",
        one_of(LAYER_VARIANTS),
        target="layer_spec",
        doc=(
            "registered in `config/layer_variants.py` ([variants.md](variants.md)): "
            + _VARIANT_LAYERS
        ),
        shapes=True,
        hf=HF_CONVERTER,
    )


def lns_settings_class(keys: tuple[VariantKey, ...]) -> type:
    """The ``lns`` section with the variants' own ``keys`` after the shared keys."""
    cls = dataclasses.make_dataclass(
        "LnsSettings",
        [(key.name, key.type, key.field) for key in keys],
        bases=(_SharedLnsSettings,),
    )
    cls.__module__ = __name__
    cls.__doc__ = "``model``'s LNS and layer-variant keys (the ``lns`` table)."
    return cls


# ``model``'s LNS and layer-variant keys (the ``lns`` table): the shared ones, then every
# registered variant's own.
LnsSettings = lns_settings_class(VARIANT_KEYS)
