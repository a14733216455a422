"""Each key is declared once (config/settings.py), and what is derived from it holds."""

import dataclasses

import pytest
from helpers import DEMO_CONFIG
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lns.config import load_config
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.settings import (
    DDP_TARGETS,
    MODEL_TARGETS,
    OPTIMIZER_TARGETS,
    declared_settings,
    setting,
    target_values,
)
from megatron_lns.model.language_model import GPTModelConfig
from megatron_lns.training.build import model_config, optim_settings
from megatron_lns.training.optim import OptimSettings

DECLARED = list(declared_settings(ExperimentConfig))
MEGATRON_CLASSES = {
    "TransformerConfig": TransformerConfig,
    "OptimizerConfig": OptimizerConfig,
    "DistributedDataParallelConfig": DistributedDataParallelConfig,
}


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_a_declared_megatron_target_is_a_real_field():
    """A misspelt target would silently not reach megatron-core."""
    wrong = [
        f"{item.key} -> {item.setting.target}"
        for item in DECLARED
        if item.setting.target_class in MEGATRON_CLASSES
        and item.setting.target_field
        not in _field_names(MEGATRON_CLASSES[item.setting.target_class])
    ]
    assert not wrong


def _receiving_fields(target_class: str) -> set[str] | None:
    """The fields a pass-through to ``target_class`` can land on (None: not routed)."""
    if target_class in MODEL_TARGETS:
        passed_on = (
            _field_names(TransformerConfig) if target_class == "TransformerConfig" else set()
        )
        return _field_names(GPTModelConfig) | passed_on
    if target_class in OPTIMIZER_TARGETS:
        return _field_names(OptimSettings) | _field_names(OptimizerConfig)
    if target_class in DDP_TARGETS:
        return _field_names(DistributedDataParallelConfig)
    return None


def test_a_pass_through_reaches_a_field_of_its_component():
    """Without a translation, the value must land on a field of the same name."""
    lost = []
    for item in DECLARED:
        s = item.setting
        if s.translate is not None or s.policy == "machine" or s.target is None:
            continue
        fields = _receiving_fields(s.target_class)
        if fields is not None and s.target_field not in fields:
            lost.append(f"{item.key} -> {s.target}")
    assert not lost


def test_every_key_is_declared_with_a_meaning():
    assert len(DECLARED) == len({item.key for item in DECLARED})
    assert all(item.setting.doc.strip() for item in DECLARED)


@dataclasses.dataclass
class _Section:
    # A pass-through key megatron-lns never mentions elsewhere: one declaration.
    moe_router_topk: int = setting(
        2, target="TransformerConfig.moe_router_topk", group="x", doc="experts per token"
    )
    adam_beta1: float = setting(
        0.8, target="OptimizerConfig.adam_beta1", group="x", doc="first moment decay"
    )
    loss_scale: float | None = setting(
        None, target="OptimizerConfig.loss_scale", group="x", doc="static loss scale"
    )
    analysis_only: int = setting(
        1, target="TransformerConfig.cpu_offloading_num_layers", training_only=True, group="x",
        doc="reaches megatron-core in training runs only",
    )  # fmt: skip


def test_a_declared_pass_through_is_all_a_new_setting_needs():
    cfg = _Section()
    assert target_values(cfg, MODEL_TARGETS, training=True) == {
        "moe_router_topk": 2,
        "cpu_offloading_num_layers": 1,
    }
    assert target_values(cfg, MODEL_TARGETS, training=False) == {"moe_router_topk": 2}
    assert target_values(cfg, OPTIMIZER_TARGETS, training=True) == {
        "adam_beta1": 0.8,
        "loss_scale": None,
    }


def test_a_transformer_config_field_our_model_config_lacks_is_passed_on():
    cfg = load_config(DEMO_CONFIG, ["model.hidden_dropout=0.125"])
    gpt = model_config(cfg, 256)
    assert gpt.hidden_dropout == 0.125 and "hidden_dropout" not in gpt.extra_transformer_config
    # What the demo passes on (the MoE router's settings, unused by a dense model) is
    # megatron-core's own default, so passing it on changes nothing.
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    assert gpt.extra_transformer_config
    assert all(defaults[name] == value for name, value in gpt.extra_transformer_config.items())
    gpt = dataclasses.replace(gpt, extra_transformer_config={"moe_router_topk": 3})
    assert gpt.transformer_config().moe_router_topk == 3


def test_optimizer_fields_our_settings_lack_are_passed_on():
    settings = dataclasses.replace(
        optim_settings(load_config(DEMO_CONFIG)), extra_optimizer_config={"loss_scale": 8.0}
    )
    assert settings.megatron_config().loss_scale == 8.0


def test_qk_layernorm_is_a_declared_pass_through():
    cfg = load_config(DEMO_CONFIG, ["model.qk_layernorm=true"])
    gpt = model_config(cfg, 256)
    assert gpt.qk_layernorm and gpt.transformer_config().qk_layernorm


@dataclasses.dataclass
class _DocumentedSection:
    hidden_dropout: float = setting(0.1, target="TransformerConfig")
    """dropout after attention and MLP,
    before the residual add"""

    lr: float = setting(1e-3, target="OptimizerConfig.lr", doc="given, not read from the source")


@dataclasses.dataclass
class _UndocumentedSection:
    seq_length: int = setting(8)


def test_a_declaration_is_completed_by_its_field_name_and_docstring():
    hidden_dropout, lr = declared_settings(_DocumentedSection)
    assert hidden_dropout.setting.target == "TransformerConfig.hidden_dropout"
    assert hidden_dropout.setting.doc == "dropout after attention and MLP, before the residual add"
    assert (lr.setting.target, lr.setting.doc) == (
        "OptimizerConfig.lr",
        "given, not read from the source",
    )
    assert target_values(_DocumentedSection(), MODEL_TARGETS, training=True) == {
        "hidden_dropout": 0.1
    }


def test_a_key_without_a_doc_is_named():
    with pytest.raises(ValueError, match=r"_UndocumentedSection\.seq_length has no docstring"):
        list(declared_settings(_UndocumentedSection))
