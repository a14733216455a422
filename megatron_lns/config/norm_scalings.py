"""The norm scaling rules (``model.norm_scaling``), registered once with their math, their
``compare`` arm, the output init they imply and what Hugging Face export does with them,
without importing torch.

A rule scales the output of both pre-norms of global block ``l`` by ``factor(l)``; the model
folds that factor into the norms' affine parameters at forward time (``model/scaling.py``,
``model/layer.py``) and export bakes it into the stored norm weights
(``convert/architectures/layout.py``), so a rule is its factor and nothing else. Code reads
the entry, never the rule's name (docs/variants.md, "Adding a variant").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


def lns_factor(layer_number: int) -> float:
    """LayerNorm Scaling's ``1/sqrt(l)`` for a global, 1-based block index ``l``."""
    if isinstance(layer_number, bool) or not isinstance(layer_number, int) or layer_number < 1:
        raise ValueError(f"layer_number must be a 1-based int, got {layer_number!r}")
    return 1.0 / math.sqrt(layer_number)


def no_factor(layer_number: int) -> float:
    """Plain Pre-LN: every pre-norm's output as it is."""
    return 1.0


@dataclass(frozen=True)
class NormScalingInfo:
    """One norm scaling rule's facts for the config layer, the model, ``compare`` and export."""

    name: str
    # The pre-norm output scale of global block l (1-based).
    factor: Callable[[int], float]
    # What the rule computes, for the key's row in docs/configuration.md.
    math: str
    # ``compare``'s label and arm name of the rule on the plain layer (and the prefix of the
    # rule on other variants: ``lns_<variant>``, "LNS + <label>"); None: the model without a
    # scaling rule, whose arms are named by their layer variant alone.
    label: str | None = None
    arm: str | None = None
    # What ``output_layer_init: null`` means with this rule (a registered output init).
    default_output_init: str = "scaled"

    @property
    def scales_pre_norms(self) -> bool:
        """Whether the rule changes any norm's output (so a variant without pre-norms, or
        one that undoes their scale, refuses it)."""
        return self.label is not None


REGISTRY: dict[str, NormScalingInfo] = {
    info.name: info
    for info in (
        NormScalingInfo(
            "lns",
            lns_factor,
            math="both pre-norms of block `l` scaled by `1/sqrt(l)`",
            label="LNS",
            arm="lns",
            default_output_init="normal",  # the LNS paper's advice
        ),
        NormScalingInfo(
            "none",
            no_factor,
            math="plain Pre-LN (same parameters and checkpoint keys)",
            default_output_init="scaled",  # megatron's default
        ),
    )
}

NORM_SCALINGS: tuple[str, ...] = tuple(REGISTRY)
# The rules that leave every norm as it is (what a variant that refuses a scale can take).
UNSCALED: tuple[str, ...] = tuple(n for n, info in REGISTRY.items() if not info.scales_pre_norms)


def imported_norm_scaling(lns: bool) -> str:
    """The rule whose factors imported Hugging Face weights carry: import-hf's ``--lns``
    says LNS's (the factor export folds into the pre-norm weights); without it none."""
    return REGISTRY["lns"].name if lns else UNSCALED[0]


def norm_scaling_info(name: str) -> NormScalingInfo:
    """The registered rule ``name``; an unknown name is refused with the known ones."""
    if name not in REGISTRY:
        raise ValueError(f"norm_scaling must be one of {NORM_SCALINGS}, got {name!r}")
    return REGISTRY[name]


def norm_output_scale(norm_scaling: str, layer_number: int) -> float:
    """The factor ``norm_scaling`` applies to the pre-norms of block ``layer_number``."""
    return norm_scaling_info(norm_scaling).factor(layer_number)
