"""One description of the model: a setting that shapes parameters is declared once, and
resume, Hugging Face export and ``plan`` act on it from its declaration alone.

The throwaway setting ``widget`` is declared here, on subclasses of the schema's
dataclasses made at test time; no package module is edited for it. A second test resumes a
real MoE run with another shared-expert width, a key resume's old hand list missed.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_parity import run_config

from megatron_lns.config import to_yaml
from megatron_lns.config.schema import ExperimentConfig, ModelConfig
from megatron_lns.config.settings import HF_CONVERTER, HF_REFUSE, setting, shaping_keys
from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.convert.architectures import architecture_for_model_config
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.hf_export import hf_config_of
from megatron_lns.planning.shape import model_shape, parameter_counts
from megatron_lns.training.checkpoint import CheckpointError, CheckpointMismatchError
from megatron_lns.training.resume import named_by_config_keys

VOCAB = 256


def declared_with(**facts) -> type:
    """An ExperimentConfig whose model has one more setting, ``model.widget`` (an int,
    default 0), declared with ``facts``."""
    widget = setting(0, doc="a throwaway setting", group="architecture", **facts)
    model = dataclasses.make_dataclass(
        "WidgetModel", [("widget", int, widget)], bases=(ModelConfig,)
    )
    return dataclasses.make_dataclass(
        "WidgetExperiment",
        [("model", model, dataclasses.field(default_factory=model))],
        bases=(ExperimentConfig,),
    )


def with_widget(experiment: type, widget: int, **model) -> ExperimentConfig:
    """The tiny parity config (``hf_parity.run_config``) as an ``experiment``, with
    ``model.widget=widget``."""
    base = run_config(**model)
    fields = {f.name: getattr(base.model, f.name) for f in dataclasses.fields(ModelConfig)}
    model_cls = next(f.type for f in dataclasses.fields(experiment) if f.name == "model")
    sections = {f.name: getattr(base, f.name) for f in dataclasses.fields(ExperimentConfig)}
    return experiment(**(sections | {"model": model_cls(**fields, widget=widget)}))


def checkpoint_of(cfg: ExperimentConfig, root: Path) -> Path:
    """A checkpoint directory as resume finds one: the config it was written with."""
    path = root / "iter_0000003"
    path.mkdir(parents=True)
    (path / RUN_CONFIG).write_text(to_yaml(cfg))
    return path


SHAPES = dict(shapes=True, hf=HF_REFUSE, params=lambda m: m.widget * m.hidden_size)


def test_the_declaration_alone_makes_the_setting_a_shaping_key():
    assert "model.widget" in shaping_keys(declared_with(**SHAPES))
    assert "model.widget" not in shaping_keys(declared_with())
    assert "model.widget" not in shaping_keys(ExperimentConfig)


def test_a_resume_with_another_value_names_the_declared_key(tmp_path):
    experiment = declared_with(**SHAPES)
    path = checkpoint_of(with_widget(experiment, 1), tmp_path)
    mismatch = CheckpointError("'decoder.layers.0.widget' has shape (1, 64), expects (2, 64)")
    named = named_by_config_keys(mismatch, path, with_widget(experiment, 2))
    assert isinstance(named, CheckpointMismatchError)
    assert f"checkpoint {path} was written by another model (model.widget: 1 -> 2)" in str(named)


def test_a_resume_names_only_settings_declared_to_shape_parameters(tmp_path):
    experiment = declared_with()  # the same setting, declared without shapes
    path = checkpoint_of(with_widget(experiment, 1), tmp_path)
    mismatch = CheckpointError("'decoder.layers.0.widget' has shape (1, 64), expects (2, 64)")
    assert named_by_config_keys(mismatch, path, with_widget(experiment, 2)) is mismatch


def test_export_refuses_a_non_default_value_no_hugging_face_field_holds_by_name():
    experiment = declared_with(**SHAPES)
    architecture_for_model_config(with_widget(experiment, 0).model)  # the default exports
    with pytest.raises(ConversionError) as refused:
        architecture_for_model_config(with_widget(experiment, 3).model)
    assert str(refused.value) == (
        "model.widget=3 cannot be exported: no Hugging Face config.json field holds it "
        "(only the default, 0, exports)"
    )


def test_export_refuses_with_the_reason_the_declaration_gives():
    experiment = declared_with(**SHAPES, hf_refusal="no stock model has widgets")
    with pytest.raises(ConversionError) as refused:
        architecture_for_model_config(with_widget(experiment, 3).model)
    assert str(refused.value) == "model.widget=3 cannot be exported: no stock model has widgets"
    with pytest.raises(ValueError, match="hf_refusal says why export refuses"):
        setting(0, doc="a width", hf=HF_CONVERTER, hf_refusal="why")


def test_export_writes_a_setting_declared_with_a_config_json_field():
    # LlamaConfig's pretraining_tp (default 1) stands in for a field a new setting maps to.
    experiment = declared_with(shapes=True, hf="pretraining_tp")
    m = with_widget(experiment, 2).model
    arch = architecture_for_model_config(m)
    assert arch.hf_class == "LlamaForCausalLM"
    assert hf_config_of(m, arch, VOCAB, torch.float32, None, 1).pretraining_tp == 2
    default = with_widget(experiment, 0).model
    assert hf_config_of(default, arch, VOCAB, torch.float32, None, 1).pretraining_tp == 1


def test_export_refuses_a_setting_mapped_to_a_field_the_class_lacks_by_name():
    experiment = declared_with(shapes=True, hf="widget_width")
    m = with_widget(experiment, 2).model
    arch = architecture_for_model_config(m)
    with pytest.raises(ConversionError) as refused:
        hf_config_of(m, arch, VOCAB, torch.float32, None, 1)
    assert str(refused.value) == (
        "model.widget=2 cannot be exported: LlamaForCausalLM's config.json has no field "
        "widget_width"
    )


def test_plan_counts_the_parameters_the_declaration_says_each_layer_adds():
    experiment = declared_with(**SHAPES)
    without = with_widget(experiment, 0)
    counted = with_widget(experiment, 3)
    layers, hidden = counted.model.num_layers, counted.model.hidden_size
    before = parameter_counts(model_shape(without, VOCAB), 1)
    after = parameter_counts(model_shape(counted, VOCAB), 1)
    assert after.total - before.total == layers * 3 * hidden
    assert after.active - before.active == layers * 3 * hidden


def test_a_shaping_setting_must_say_its_hugging_face_role():
    with pytest.raises(ValueError, match="says its Hugging Face role"):
        setting(0, doc="a width", shapes=True)


def _fit(cfg) -> str | None:
    """Train ``cfg``; the one-line error of a refused run, else None."""
    from megatron_lns.base.errors import UserError
    from megatron_lns.training.trainer import Trainer

    try:
        Trainer(cfg).fit()
    except UserError as err:
        return str(err)
    return None


@pytest.mark.slow
@pytest.mark.usefixtures("private_corpus_cache")
def test_a_resume_with_another_shared_expert_width_names_the_key(tmp_path):
    """It failed as "'decoder.layers.0.mlp.shared_experts.linear_fc2.weight' has shape
    (128, 64), this model expects (128, 96)", not naming the setting."""
    from helpers import run_distributed, tiny_run_config

    moe = (
        "model.num_moe_experts=4",
        "model.moe_router_topk=2",
        "trainer.exit_interval=3",
    )
    shared = "model.moe_shared_expert_intermediate_size"
    first = tiny_run_config(tmp_path, *moe, f"{shared}=64")
    assert run_distributed(_fit, 1, tmp_path / "first", first) == [None]
    again = tiny_run_config(tmp_path, *moe, f"{shared}=96")
    refused = run_distributed(_fit, 1, tmp_path / "again", again)[0]
    assert refused == (
        f"checkpoint {tmp_path / 'lns' / 'checkpoints' / 'iter_0000003'} was written by "
        f"another model ({shared}: 64 -> 96): a run resumes with the model it trained; "
        "restore those values, or start a new run (another exp_manager.name)"
    )
