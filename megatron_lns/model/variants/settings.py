"""What a layer needs to know about its variant, built from the model config."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from megatron_lns.config.choices import PRE_NORM_VARIANTS, LayerVariant, lns_combines_with
from megatron_lns.config.layer_variants import REGISTRY, variant_info
from megatron_lns.model.scaling import NormScaling


@dataclass(frozen=True)
class VariantSettings:
    """The layer variant and its settings (``model.layer_variant``, ...), and the init."""

    layer_variant: LayerVariant = "pre_ln"
    mix_ln_post_fraction: float = 0.25
    layerscale_init: float = 1e-3
    depth_scaled_init: bool = False

    def check(self, norm_scaling: NormScaling) -> None:
        """Refuse unknown variants, combinations that have no meaning and bad settings, by
        name (each variant module checks its own settings)."""
        info = variant_info(self.layer_variant)
        if not lns_combines_with(norm_scaling, self.layer_variant):
            raise ValueError(
                f"norm_scaling='lns' scales pre-norm outputs, and layer_variant="
                f"{self.layer_variant!r} {info.lns_refusal}; use norm_scaling='none' or one "
                f"of {PRE_NORM_VARIANTS}"
            )
        for module in variant_modules():
            check = getattr(module, "check", None)
            if check is not None:
                check(self)

    @property
    def needs_variant_layer(self) -> bool:
        """False for plain Pre-LN (with or without LNS): megatron's residual add is kept."""
        return variant_info(self.layer_variant).changes_layer or self.depth_scaled_init

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
