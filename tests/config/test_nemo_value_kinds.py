"""NeMo's keys are typed nowhere but in their rules: a value of another type is refused,
naming the key, before a rule reads it (no TypeError, no string read as a boolean)."""

import pytest
from helpers import config_error, validated_demo_config


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("+trainer.max_epochs=abc", "trainer.max_epochs must be an integer, got 'abc'"),
        ("+trainer.max_epochs=[1]", "trainer.max_epochs must be an integer, got [1]"),
        ("+trainer.max_epochs=true", "trainer.max_epochs must be an integer, got True"),
        (
            "+model.use_scaled_init_method='false'",
            "model.use_scaled_init_method must be true or false, got 'false'",
        ),
        ("+model.use_scaled_init_method=[]", "model.use_scaled_init_method must be true or false"),
        ("+model.fp8_e4m3='false'", "model.fp8_e4m3 must be true or false, got 'false'"),
        ("+model.mcore_gpt=1", "model.mcore_gpt must be true or false, got 1"),  # a Fixed rule
        ("+model.rotary_percentage=true", "model.rotary_percentage must be a number, got True"),
        ("+model.recompute_num_layers=abc", "model.recompute_num_layers must be an integer"),
        ("+defaults=[{1: null}]", "defaults=[{1: None}] is not supported (Hydra config groups"),
    ],
)
def test_a_nemo_key_of_the_wrong_type_is_refused_by_name(override, expected):
    assert config_error("~model.output_layer_init", override).startswith(expected)


def test_nemo_values_of_their_types_are_honoured():
    cfg = validated_demo_config(
        "~model.output_layer_init",
        "+model.use_scaled_init_method=false",
        "+model.rotary_percentage=1",  # an int is a number
        "+trainer.max_epochs=-1",
        "+defaults=[_self_]",
    )
    assert cfg.model.output_layer_init == "normal"
