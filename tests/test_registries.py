"""The three registries of the paper's comparison (norm scaling rules, layer variants,
output inits): what reads them gets a new entry without being edited, and nothing in the
package branches on a registered name."""

import math
import re
from pathlib import Path

import pytest
from megatron.core.utils import scaled_init_method_normal

from megatron_lns.analysis import comparison
from megatron_lns.config.layer_variants import (
    REGISTRY as LAYER_VARIANTS,
)
from megatron_lns.config.layer_variants import (
    VARIANT_KEYS,
    variant_key,
    variant_options,
)
from megatron_lns.config.norm_scalings import REGISTRY as NORM_SCALINGS
from megatron_lns.config.norm_scalings import NormScalingInfo, lns_factor, norm_output_scale
from megatron_lns.config.output_inits import REGISTRY as OUTPUT_INITS
from megatron_lns.config.output_inits import depth_scaled_std, resolved_output_init
from megatron_lns.config.rules import positive
from megatron_lns.config.schema import ModelConfig
from megatron_lns.config.sections.lns import lns_settings_class
from megatron_lns.config.settings import VARIANT_TARGETS, declared_settings, target_values
from megatron_lns.config.settings import value_errors as declared_value_errors
from megatron_lns.training.build import model_config

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_lns"
# The modules that hold the entries, the only places their names are spelt as values.
REGISTRY_MODULES = {"norm_scalings.py", "layer_variants.py", "output_inits.py"}


def test_no_module_branches_on_a_registered_name():
    """``x == "lns"``, ``init in ("normal", "depth_scaled")``, ...: a comparison of a
    norm scaling, layer variant or output init setting with one of the registered names
    outside the registries (the issue's rule: nothing outside a rule's module and entry
    branches on its name)."""
    names = set(NORM_SCALINGS) | set(LAYER_VARIANTS) | set(OUTPUT_INITS)
    quoted = "|".join(re.escape(n) for n in sorted(names))
    setting_names = r"norm_scaling|output_layer_init|output_init|layer_variant|variant|init"
    branch = re.compile(
        rf"({setting_names})\w*(\(\))?\s*(==|!=|not in|in)\s*[\(\[{{]?[^#\n]*[\"']({quoted})[\"']"
        rf"|[\"']({quoted})[\"']\s*(==|!=)\s*\w*({setting_names})"
        rf"|[\"']({quoted})[\"']\s+if\s+[^#\n]*({setting_names}|lns)"
    )
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name not in REGISTRY_MODULES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_registered_inits_are_megatrons_and_the_papers():
    std, blocks = 0.02, 12
    scaled = OUTPUT_INITS["scaled"].std(std, blocks, None)
    assert scaled == scaled_init_method_normal(std, blocks).keywords["std"]
    assert OUTPUT_INITS["normal"].std(std, blocks, None) == std
    assert OUTPUT_INITS["depth_scaled"].std(std, blocks, 5) == depth_scaled_std(std, 5)
    assert depth_scaled_std(std, 5) == std / math.sqrt(10)
    # output_layer_init: null is the rule's default: the paper's with LNS, megatron's without
    assert resolved_output_init(None, "lns").name == "normal"
    assert resolved_output_init(None, "none").name == "scaled"
    assert resolved_output_init("depth_scaled", "none").per_layer


def test_the_registered_factors():
    assert [norm_output_scale("lns", layer) for layer in (1, 4)] == [1.0, 0.5]
    assert norm_output_scale("lns", 7) == lns_factor(7)
    assert norm_output_scale("none", 7) == 1.0
    with pytest.raises(ValueError, match="norm_scaling must be one of"):
        norm_output_scale("sandwich", 1)


def test_compare_arms_and_suffixes_come_from_the_registries(monkeypatch):
    assert comparison.VARIANTS["lns"] == (
        "LNS",
        {"norm_scaling": "lns", "layer_variant": "pre_ln"},
    )
    assert comparison.VARIANTS["lns_gpas"][0] == "LNS + GPAS"
    assert "lns_post_ln" not in comparison.VARIANTS  # LNS refuses post-norm layers
    assert comparison.INIT_SUFFIXES["depth_scaled_init"] == ("depth-scaled init", "depth_scaled")
    # A new rule is arms without an edit to comparison.py.
    half = NormScalingInfo("half", lambda layer: 0.5, math="half", label="Half", arm="half")
    monkeypatch.setitem(NORM_SCALINGS, "half", half)
    arms = comparison._arms()
    assert arms["half"] == ("Half", {"norm_scaling": "half", "layer_variant": "pre_ln"})
    assert arms["half_layerscale"][0] == "Half + LayerScale"
    assert "half_deepnorm" not in arms


def test_a_variant_key_is_a_model_key_from_its_registration():
    """The registered keys are ``model`` keys of the ``lns`` table whose values reach the
    model's variant settings; their YAML keys are what they were."""
    declared = {item.key: item.setting for item in declared_settings(ModelConfig)}
    for key in VARIANT_KEYS:
        assert declared[key.name].group == "lns"
        assert declared[key.name].target == f"layer_variant.{key.name}"
    assert {k.name for k in VARIANT_KEYS} >= {"mix_ln_post_fraction", "layerscale_init"}
    assert declared["mix_ln_post_fraction"].shapes


def test_a_throwaway_variant_key_needs_no_shared_file():
    """A key declared only in a (throwaway) registration is a field of the section, with its
    rule, and goes to the variant's settings."""
    widget = variant_key("widget_gain", float, 0.5, positive, doc="a throwaway gain")
    section = lns_settings_class((widget,))
    fields = [item.key for item in declared_settings(section)]
    assert fields[-1] == "widget_gain" and fields[:3] == [
        "norm_scaling",
        "output_layer_init",
        "layer_variant",
    ]
    assert target_values(section(), VARIANT_TARGETS, training=False) == {"widget_gain": 0.5}
    problems = list(declared_value_errors(section(widget_gain=-1.0)))
    assert problems == ["widget_gain must be positive, got -1.0"]


def test_variant_options_are_the_variants_own_by_their_declared_rules():
    assert variant_options("mix_ln") == {"mix_ln_post_fraction": 0.25}
    given = {"mix_ln_post_fraction": 0.5, "layerscale_init": 0.1}
    assert variant_options("mix_ln", given) == {"mix_ln_post_fraction": 0.5}
    assert variant_options("pre_ln", given) == {}
    with pytest.raises(ValueError, match=r"mix_ln_post_fraction must be a probability in \[0, 1\)"):
        variant_options("mix_ln", {"mix_ln_post_fraction": 2.0})
    with pytest.raises(ValueError, match="wdiget: not a setting of any layer variant"):
        variant_options("mix_ln", {"wdiget": 1})


def test_the_yaml_keys_reach_the_layer(tmp_path):
    from helpers import tiny_run_config

    cfg = tiny_run_config(
        tmp_path, "model.layer_variant=mix_ln", "model.mix_ln_post_fraction=0.5",
        "model.norm_scaling=none",
    )  # fmt: skip
    model = model_config(cfg, 128)
    assert model.variant_options["mix_ln_post_fraction"] == 0.5
    assert model.variant_settings().option("mix_ln_post_fraction") == 0.5
