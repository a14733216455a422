"""The mixture-of-experts keys: declared once, reaching megatron-core, and every bad value
or combination refused in one line naming its key before any process group exists."""

import re

import pytest
from helpers import DEMO_CONFIG, TINY_MODEL_OVERRIDES, config_error, validated_demo_config

from megatron_lns.config import ConfigError, load_config, validate
from megatron_lns.config.fast_paths import MachineFacts
from megatron_lns.config.moe_layers import MoELayerFreqError, parse_moe_layer_freq
from megatron_lns.config.performance import resolved_fast_paths
from megatron_lns.training.build import model_config, parallel_layout

MOE = [
    *TINY_MODEL_OVERRIDES,
    "model.global_batch_size=24",
    "model.num_moe_experts=4",
    "model.moe_ffn_hidden_size=32",
]


def _config(*overrides: str, devices: int = 1):
    return validated_demo_config(*MOE, f"trainer.devices={devices}", *overrides)


def test_moe_keys_reach_megatron_transformer_config():
    """Each key is one declaration: its value arrives in megatron-core's TransformerConfig
    under megatron's name, with no code of ours between them but the list evaluation."""
    cfg = _config(
        "model.moe_layer_freq='[0]*1+[1]*3'",
        "model.moe_router_topk=1",
        "model.moe_router_pre_softmax=true",
        "model.moe_router_score_function=sigmoid",
        "model.moe_router_enable_expert_bias=true",
        "model.moe_router_bias_update_rate=0.01",
        "model.moe_aux_loss_coeff=0.01",
        "model.moe_z_loss_coeff=0.001",
        "model.moe_router_dtype=fp32",
        "model.moe_token_dispatcher_type=alltoall",
        "model.moe_shared_expert_intermediate_size=48",
        "model.moe_shared_expert_gate=true",
        "model.moe_expert_capacity_factor=1.5",
        "model.moe_token_drop_policy=position",
        "model.moe_pad_expert_input_to_capacity=true",
        "model.activations_checkpoint_granularity=selective",
        "model.recompute_modules=[core_attn,moe]",
    )
    fast = resolved_fast_paths(cfg, MachineFacts(cuda=False))
    tf = model_config(cfg, 256, fast).transformer_config()
    assert (tf.num_moe_experts, tf.moe_ffn_hidden_size, tf.moe_router_topk) == (4, 32, 1)
    assert tf.moe_layer_freq == [0, 1, 1, 1]
    assert tf.moe_router_score_function == "sigmoid" and tf.moe_router_enable_expert_bias
    assert tf.moe_router_bias_update_rate == 0.01
    assert (tf.moe_aux_loss_coeff, tf.moe_z_loss_coeff) == (0.01, 0.001)
    assert tf.moe_router_dtype == "fp32" and tf.moe_token_dispatcher_type == "alltoall"
    assert tf.moe_shared_expert_intermediate_size == 48 and tf.moe_shared_expert_gate
    assert tf.moe_expert_capacity_factor == 1.5 and tf.moe_token_drop_policy == "position"
    assert tf.moe_pad_expert_input_to_capacity
    assert tf.recompute_modules == ["core_attn", "moe"]
    # Off the machine's fast paths on CPU; a model built to convert weights gets neither.
    assert not tf.moe_grouped_gemm and not tf.moe_permute_fusion
    assert model_config(cfg, 256).transformer_config().moe_router_bias_update_rate == 0.001


def test_expert_parallel_sizes_reach_the_layout():
    cfg = _config(
        "model.expert_model_parallel_size=2",
        "model.expert_tensor_parallel_size=1",
        "model.tensor_model_parallel_size=2",
        devices=4,
    )
    layout = parallel_layout(cfg)
    assert (layout.tensor, layout.expert, layout.expert_tensor) == (2, 2, 1)
    assert layout.expert_data_parallel(4) == 2


def test_grouped_gemm_and_permute_fusion_follow_the_machine():
    cfg = _config("model.transformer_engine=true")
    gpu = resolved_fast_paths(cfg, MachineFacts(cuda=True, transformer_engine=True))
    assert gpu.moe_grouped_gemm and gpu.moe_permute_fusion
    assert not resolved_fast_paths(cfg, MachineFacts(cuda=False)).moe_grouped_gemm
    dense = load_config(DEMO_CONFIG, ["model.transformer_engine=true"])
    gpu_dense = resolved_fast_paths(dense, MachineFacts(cuda=True, transformer_engine=True))
    assert not gpu_dense.moe_grouped_gemm and not gpu_dense.moe_permute_fusion


@pytest.mark.parametrize(
    "overrides, devices, message",
    [
        (["model.num_moe_experts=0"], 1, r"^model\.num_moe_experts must be positive, got 0$"),
        (["model.moe_layer_freq=0"], 1, r"model\.moe_layer_freq must be an int N >= 1"),
        (["model.moe_layer_freq=[0,1,1]"], 1, r"model\.moe_layer_freq lists 3 layers but"),
        (["model.moe_layer_freq='__import__(\"os\")'"], 1, r"model\.moe_layer_freq must be"),
        (["model.moe_router_topk=5"], 1, r"model\.moe_router_topk \(5\) exceeds"),
        (["model.moe_router_score_function=relu"], 1, r"model\.moe_router_score_function="),
        (["model.expert_model_parallel_size=3"], 3, r"model\.num_moe_experts \(4\) is not"),
        (["model.expert_model_parallel_size=4"], 2, r"expert_model_parallel_size \(4\)"),
        (
            ["model.expert_tensor_parallel_size=2", "model.expert_model_parallel_size=2"],
            2,
            r"expert_tensor_parallel_size \(2\) x expert_model_parallel_size \(2\)",
        ),
        (["model.moe_ffn_hidden_size=33", "model.expert_tensor_parallel_size=2"], 2, "33"),
        (["model.moe_token_dispatcher_type=flex"], 1, r"dispatcher_type=flex is not supported"),
        (["model.moe_router_enable_expert_bias=true"], 1, r"needs model\.moe_router_score"),
        (["model.moe_router_load_balancing_type=sinkhorn"], 1, r"set model\.moe_router_topk=1"),
        (["model.moe_pad_expert_input_to_capacity=true"], 1, r"needs model\.moe_expert_capa"),
        (
            ["model.moe_router_topk=1"],
            1,
            r"topk=1 with a softmax router needs model\.moe_router_pre",
        ),
        (
            [
                "model.moe_router_load_balancing_type=sinkhorn",
                "model.moe_router_topk=1",
                "model.moe_aux_loss_coeff=0.01",
            ],
            1,
            r"set model\.moe_aux_loss_coeff=0",
        ),
        (["model.moe_shared_expert_overlap=true"], 1, r"needs a shared expert"),
        (
            [
                "model.moe_shared_expert_intermediate_size=32",
                "model.moe_shared_expert_overlap=true",
            ],
            1,
            r"needs model\.moe_token_dispatcher_type=alltoall",
        ),
        (["model.moe_shared_expert_gate=true"], 1, r"gate=true needs a shared expert"),
        (["model.recompute_modules=[moe]"], 1, r"needs model\.activations_checkpoint_gran"),
        (["model.recompute_modules=[mla_up_proj]"], 1, r"model\.recompute_modules must be"),
        (
            [
                "model.activations_checkpoint_granularity=selective",
                "model.recompute_modules=[moe_act]",
            ],
            1,
            r"moe_act needs the experts' grouped GEMM",
        ),
        (["model.bias=true", "model.tensor_model_parallel_size=2"], 2, r"model\.bias=true with"),
        (
            [
                "model.activations_checkpoint_granularity=selective",
                "model.recompute_modules=[layernorm]",
            ],
            1,
            r"layernorm needs model\.transformer_engine=true",
        ),
    ],
)
def test_bad_moe_settings_are_one_line_errors(overrides, devices, message):
    assert re.search(message, config_error(*MOE, f"trainer.devices={devices}", *overrides))


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("[1]*10000000000000000000000", "lists more than 100000 layers"),  # was OverflowError
        ("[1]*100000000000", "lists more than 100000 layers"),  # was MemoryError
        ("[1]*50000+[1]*50001", "lists more than 100000 layers"),
        ("[[1]*1000]*1000", "is not a list expression"),  # its message listed 10**6 entries
        ("+".join(["[1]"] * 3000), "too large or too deeply nested"),  # was RecursionError
    ],
)
def test_a_moe_layer_list_expression_too_large_to_build_is_refused(expression, why):
    with pytest.raises(MoELayerFreqError, match=why):
        parse_moe_layer_freq(expression)
    message = config_error(*MOE, f"model.moe_layer_freq='{expression}'")
    assert message.startswith("model.moe_layer_freq must be an int N >= 1")


@pytest.mark.parametrize(
    "override",
    [
        "model.expert_model_parallel_size=2",
        "model.moe_ffn_hidden_size=32",
        "model.moe_shared_expert_intermediate_size=32",
        "model.moe_expert_capacity_factor=1.0",
    ],
)
def test_moe_keys_without_experts_are_refused(override):
    with pytest.raises(ConfigError, match=r"needs a mixture-of-experts model"):
        cfg = load_config(DEMO_CONFIG, [*TINY_MODEL_OVERRIDES, "trainer.devices=2", override])
        validate(cfg, check_files=False)


# A valid value other than the default for every MoE key (moe_only_keys).
NON_DEFAULT = {
    "moe_layer_freq": "2",
    "moe_ffn_hidden_size": "32",
    "moe_router_topk": "3",
    "moe_router_score_function": "sigmoid",
    "moe_router_pre_softmax": "true",
    "moe_router_topk_scaling_factor": "2.0",
    "moe_router_enable_expert_bias": "true",
    "moe_router_bias_update_rate": "0.01",
    "moe_router_dtype": "fp32",
    "moe_router_load_balancing_type": "none",
    "moe_aux_loss_coeff": "0.01",
    "moe_z_loss_coeff": "0.001",
    "moe_per_layer_logging": "true",
    "moe_token_dispatcher_type": "alltoall",
    "moe_grouped_gemm": "false",
    "moe_permute_fusion": "false",
    "moe_shared_expert_intermediate_size": "32",
    "moe_shared_expert_gate": "true",
    "moe_shared_expert_overlap": "true",
    "moe_expert_capacity_factor": "1.0",
    "moe_token_drop_policy": "position",
    "moe_pad_expert_input_to_capacity": "true",
    "expert_model_parallel_size": "2",
    "expert_tensor_parallel_size": "1",
}


def test_every_moe_key_has_a_non_default_value_to_refuse():
    from megatron_lns.config.moe_rules import moe_only_keys

    assert set(NON_DEFAULT) == set(moe_only_keys())


@pytest.mark.parametrize("key", list(NON_DEFAULT))
def test_every_moe_key_set_without_experts_is_refused_by_name(key):
    """A dense model (no num_moe_experts) with an MoE key set trains as if it were not
    set: refused, naming the key, as model.hybrid_layer_pattern is without hybrid."""
    overrides = [*TINY_MODEL_OVERRIDES, "trainer.devices=2", f"model.{key}={NON_DEFAULT[key]}"]
    cfg = load_config(DEMO_CONFIG, overrides)
    with pytest.raises(
        ConfigError, match=rf"^model\.{key}=.* has no effect: it needs a mixture"
    ) as info:
        validate(cfg, check_files=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("freq", ["[0,0,0,0]", "'[0]*4'"])
def test_a_layer_pattern_with_no_moe_layer_is_refused(freq):
    with pytest.raises(
        ConfigError,
        match=r"^model\.moe_layer_freq=.* places no MoE layer, so "
        r"model\.num_moe_experts=4 would build no expert",
    ):
        _config(f"model.moe_layer_freq={freq}")


def test_grouped_gemm_needs_transformer_engine_on_cuda():
    message = r"model\.moe_grouped_gemm=true needs model\.transformer_engine=true on CUDA"
    with pytest.raises(ConfigError, match=message):
        _config("model.moe_grouped_gemm=true")  # validate resolves for this (CPU) machine
    cfg = load_config(DEMO_CONFIG, [*MOE, "model.moe_grouped_gemm=true"])
    with pytest.raises(ConfigError, match=message):
        resolved_fast_paths(cfg, MachineFacts(cuda=True, transformer_engine=False))


@pytest.mark.parametrize(
    "key, value",
    [("moe_enable_deepep", "true"), ("moe_router_fusion", "true"), ("moe_latent_size", "64")],
)
def test_megatron_moe_settings_we_do_not_honour_are_refused_by_name(key, value):
    with pytest.raises(
        ConfigError,
        match=rf"model\.{key}={value.capitalize() if value == 'true' else value}.* is not supported",
    ):
        _config(f"+model.{key}={value}")
    _config(f"+model.{key}=" + {"true": "false", "64": "null"}[value])
