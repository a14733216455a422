"""What a layer needs to know about its variant, built from the model config."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from megatron_lns.config.choices import (
    PRE_NORM_VARIANTS,
    LayerVariant,
    OutputLayerInit,
    lns_combines_with,
)
from megatron_lns.config.layer_variants import REGISTRY, variant_info, variant_options
from megatron_lns.config.norm_scalings import UNSCALED
from megatron_lns.config.output_inits import output_init_info
from megatron_lns.model.scaling import NormScaling


@dataclass(frozen=True)
class VariantSettings:
    """The layer variant (``model.layer_variant``), the settings of variants' own
    (``options``, by key name: the keys each registration declares; a key the variant does
    not declare is ignored, one it does and that is not given takes its declared default),
    and the output init (``model.output_layer_init`` resolved: a per-layer init is built by
    the variant layer)."""

    layer_variant: LayerVariant = "pre_ln"
    options: dict[str, Any] = field(default_factory=dict)
    output_init: OutputLayerInit = "normal"

    def check(self, norm_scaling: NormScaling) -> None:
        """Refuse unknown variants, combinations that have no meaning and bad settings, by
        name (the variant's keys by their declared rules, then its module's ``check``)."""
        info = variant_info(self.layer_variant)
        if not lns_combines_with(norm_scaling, self.layer_variant):
            raise ValueError(
                f"norm_scaling={norm_scaling!r} scales pre-norm outputs, and layer_variant="
                f"{self.layer_variant!r} {info.lns_refusal}; use norm_scaling="
                f"{' or '.join(repr(n) for n in UNSCALED)} or one of {PRE_NORM_VARIANTS}"
            )
        self.resolved_options()
        output_init_info(self.output_init)
        check = getattr(self.module(), "check", None)  # a rule no declaration can say
        if check is not None:
            check(self)

    def resolved_options(self) -> dict[str, Any]:
        """This variant's own settings, given or by their declared defaults."""
        return variant_options(self.layer_variant, self.options)

    def option(self, name: str) -> Any:
        """One of this variant's own settings (a key its registration declares)."""
        return self.resolved_options()[name]

    @property
    def needs_variant_layer(self) -> bool:
        """False for plain Pre-LN (with or without LNS) with a model-wide output init:
        megatron's residual add is kept."""
        return variant_info(self.layer_variant).changes_layer or (
            output_init_info(self.output_init).per_layer
        )

    def module(self) -> ModuleType:
        """The module under ``megatron_lns.model.variants`` that builds this variant."""
        return variant_module(self.layer_variant)


def variant_module(name: str) -> ModuleType:
    """The module that builds the registered variant ``name``."""
    return importlib.import_module(f"megatron_lns.model.variants.{variant_info(name).module}")


def variant_modules() -> list[ModuleType]:
    """Every registered variant's module, once each, in registration order."""
    return [
        importlib.import_module(f"megatron_lns.model.variants.{m}")
        for m in dict.fromkeys(info.module for info in REGISTRY.values())
    ]


PLAIN_PRE_LN = VariantSettings()
