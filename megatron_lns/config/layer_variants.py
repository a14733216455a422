"""The layer variants (``model.layer_variant``), registered once with what the config layer,
``compare`` and Hugging Face export need to know about them, without importing torch.

Each entry names the variant, its ``compare`` label, whether LNS combines with it (and why
not where it does not), why no stock Hugging Face class computes it (``None``: it exports),
and the module under ``megatron_lns/model/variants/`` that builds its layers. A variant is
added by writing that module and one entry here; validation, ``compare``, export and the
model read everything else from the entry (docs/variants.md, "Adding a variant").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_lns.config.norm_scalings import norm_scaling_info
from megatron_lns.config.rules import Check, positive, probability
from megatron_lns.config.settings import HF_CONVERTER, VARIANT_TARGETS, declaration, setting


@dataclass(frozen=True)
class VariantKey:
    """A setting of one variant's own, declared in its registration: a ``model`` key (flat in
    the YAML, as every model key) that the ``lns`` section, validation, the key tables of
    docs/configuration.md and the model's :class:`VariantSettings` read from the registry."""

    name: str
    type: type
    field: dataclasses.Field  # settings.setting(...), target ``layer_variant.<name>``

    @property
    def default(self) -> Any:
        return self.field.default


def variant_key(
    name: str, type_: type, default: Any, check: Check, *, doc: str, **declared: Any
) -> VariantKey:
    """A variant's own key, declared as every key is (``settings.setting``), in the ``lns``
    table, going to the variant (``GPTModelConfig.variant_options``)."""
    target = f"{VARIANT_TARGETS[0]}.{name}"
    return VariantKey(
        name, type_, setting(default, check, target=target, group="lns", doc=doc, **declared)
    )


@dataclass(frozen=True)
class LayerVariantInfo:
    """One variant's facts for code that must not import its torch module."""

    name: str
    label: str  # ``compare``'s table and plots
    module: str  # megatron_lns.model.variants.<module> builds its layers
    layer: str  # what one layer computes, for the key's row in docs/configuration.md
    # Why LNS (which scales every pre-norm's output) cannot apply; None: it combines.
    lns_refusal: str | None = None
    # Why no stock Hugging Face class computes it (export adds that the stock classes
    # normalise only each branch's input); None: it exports.
    hf_refusal: str | None = None
    # A learnable gain on each branch's output (attention's, MLP's parameter names) that
    # export folds into o_proj / down_proj rows, and whether it is per channel (else scalar).
    branch_gains: tuple[str, str] | None = None
    per_channel_gain: bool = False
    # False only for megatron's own Pre-LN layer, which needs no layer class of ours.
    changes_layer: bool = True
    # Whether its layers differ in their parameters, so megatron must checkpoint each layer
    # under its own key rather than stacked along a layer axis.
    heterogeneous_layers: bool = False
    # Its own settings (``model.<name>`` keys), read by its module from VariantSettings.
    keys: tuple[VariantKey, ...] = ()

    @property
    def combines_with_lns(self) -> bool:
        return self.lns_refusal is None


_POST_NORM_REFUSAL = "has post-norm layers, where there is no pre-norm output to scale"

REGISTRY: dict[str, LayerVariantInfo] = {
    info.name: info
    for info in (
        LayerVariantInfo(
            "pre_ln",
            "Pre-LN",
            module="pre_ln",
            layer="`h + f(LN(h))`, megatron's own",
            changes_layer=False,
        ),
        LayerVariantInfo(
            "post_ln",
            "Post-LN",
            module="post_ln",
            layer="`LN(h + f(h))`",
            lns_refusal=_POST_NORM_REFUSAL,
            hf_refusal="Post-LN normalises after the residual add, LN(h + f(h))",
        ),
        LayerVariantInfo(
            "deepnorm",
            "DeepNorm",
            module="deepnorm",
            layer="`LN(alpha*h + f(h))`, DeepNet's alpha and beta from `num_layers`",
            lns_refusal=_POST_NORM_REFUSAL,
            hf_refusal=(
                "DeepNorm scales the residual by alpha = (2N)^(1/4) before a norm after the "
                "add, LN(alpha h + f(h))"
            ),
        ),
        LayerVariantInfo(
            "mix_ln",
            "Mix-LN",
            module="mix_ln",
            layer="Post-LN in the first `mix_ln_post_fraction` of layers, Pre-LN after",
            lns_refusal=_POST_NORM_REFUSAL,
            hf_refusal="Mix-LN's first layers are Post-LN, with the norm after the residual add",
            heterogeneous_layers=True,
            keys=(
                variant_key(
                    "mix_ln_post_fraction",
                    float,
                    0.25,
                    probability,
                    doc="Mix-LN: layers `l <= floor(fraction * num_layers)` are Post-LN; in [0, 1)",
                    shapes=True,
                    hf=HF_CONVERTER,
                ),
            ),
        ),
        LayerVariantInfo(
            "layerscale",
            "LayerScale",
            module="layerscale",
            layer="per-channel learnable branch scale",
            branch_gains=("self_attn_bda.layerscale", "mlp_bda.layerscale"),
            per_channel_gain=True,
            keys=(
                variant_key(
                    "layerscale_init",
                    float,
                    1e-3,
                    positive,
                    doc="LayerScale: initial value of every channel's branch scale; > 0",
                ),
            ),
        ),
        LayerVariantInfo(
            "skipinit",
            "SkipInit",
            module="skipinit",
            layer="scalar branch gate from 0",
            branch_gains=("self_attn_bda.gate", "mlp_bda.gate"),
        ),
        LayerVariantInfo(
            "peri_ln",
            "Peri-LN",
            module="peri_ln",
            layer="`h + LN(f(LN(h)))`",
            lns_refusal=(
                "normalises every branch's output before the residual add, which undoes a "
                "scale on the branch's input"
            ),
            hf_refusal=(
                "Peri-LN normalises each branch's output before the residual add, "
                "h + LN(f(LN(h))) (Gemma 2/3 do too, but also multiply the embeddings by "
                "sqrt(hidden_size))"
            ),
        ),
        LayerVariantInfo(
            "gpas",
            "GPAS",
            module="gpas",
            layer="`x - SiLU(alpha_l)*sg(x)` after each add",
            hf_refusal=(
                "GPAS scales the residual stream after each add by a learned 1 - SiLU(alpha_l)"
            ),
        ),
    )
}

LAYER_VARIANTS: tuple[str, ...] = tuple(REGISTRY)
# Every variant's own keys, in registration order (the ``lns`` section's last fields).
VARIANT_KEYS: tuple[VariantKey, ...] = tuple(k for info in REGISTRY.values() for k in info.keys)


def _keys_are_unique() -> None:
    names = [k.name for k in VARIANT_KEYS]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"variant keys registered twice: {', '.join(repeated)}")


_keys_are_unique()
# The variants LNS combines with: every layer keeps its pre-norms and their scale.
LNS_VARIANTS: tuple[str, ...] = tuple(n for n, info in REGISTRY.items() if info.combines_with_lns)


def variant_info(name: str) -> LayerVariantInfo:
    """The registered variant ``name``; an unknown name is refused with the known ones."""
    if name not in REGISTRY:
        raise ValueError(f"layer_variant must be one of {LAYER_VARIANTS}, got {name!r}")
    return REGISTRY[name]


def variant_options(layer_variant: str, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The own settings of ``layer_variant``: ``given`` (settings of any variant, by key
    name) for its keys, its declared defaults for the others. A name that is no variant's key
    is refused by name; so is a value its declared rule refuses."""
    given = dict(given or {})
    unknown = sorted(set(given) - {k.name for k in VARIANT_KEYS})
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: not a setting of any layer variant (they are "
            f"{', '.join(k.name for k in VARIANT_KEYS)})"
        )
    options = {}
    for key in variant_info(layer_variant).keys:
        value = given.get(key.name, key.default)
        message = declaration(key.field).check.error(key.name, value)
        if message:
            raise ValueError(message)
        options[key.name] = value
    return options


def lns_combines_with(norm_scaling: str, layer_variant: str) -> bool:
    """The scaling/variant rule: a norm scaling rule (LNS) scales the output of pre-norms,
    so it combines only with variants whose every layer has them and keeps their scale."""
    scales = norm_scaling_info(norm_scaling).scales_pre_norms
    return not scales or variant_info(layer_variant).combines_with_lns
