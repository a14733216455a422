"""The hybrid-architecture keys (``model.architecture``, ``model.hybrid_layer_pattern``):
every bad pattern or combination refused through the real config loading and validation,
in one line naming the symbol and its position, before any process group exists."""

import re

import pytest
from helpers import DEMO_CONFIG, TINY_MODEL_OVERRIDES, config_error, validated_demo_config

from megatron_lns.cli import main
from megatron_lns.training.build import model_config

HYBRID = [*TINY_MODEL_OVERRIDES, "model.architecture=hybrid"]
EXPERTS = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=32"]
PIPELINE_2 = ["model.pipeline_model_parallel_size=2"]
FULL_RECOMPUTE = [
    "model.activations_checkpoint_granularity=full",
    "model.activations_checkpoint_method=block",
]


def _config(*overrides: str, devices: int = 1):
    return validated_demo_config(*HYBRID, f"trainer.devices={devices}", *overrides)


def _pattern(pattern: str) -> list[str]:
    """The pattern and the num_layers it needs (its sublayers), as overrides."""
    sublayers = len(pattern.replace("|", ""))
    return [f"model.hybrid_layer_pattern={pattern}", f"model.num_layers={sublayers}"]


@pytest.mark.parametrize(
    "overrides, devices, message",
    [
        # Symbols: each named with its 1-based position in the pattern.
        (_pattern("*X-"), 1, r"'\*X-': 'X' at position 2 is not a layer symbol"),
        (_pattern("*-M-"), 1, r"'M' at position 3 is a Mamba layer, whose kernels run only on"),
        (_pattern("*-G-"), 1, r"'G' at position 3 is a gated delta net layer"),
        (_pattern("D-D-"), 1, r"'D' at position 1 is a DeepSeek sparse attention layer"),
        (_pattern("*-+-"), 1, r"'\+' at position 3 is a multi-latent attention layer"),
        (_pattern("*-*-/*-"), 1, r"'/' at position 5 starts multi-token-prediction layers"),
        # Length against num_layers (which counts sublayers with a pattern).
        (
            ["model.hybrid_layer_pattern=*-*-*-"],
            1,
            r"has 6 sublayers but model\.num_layers is 4: .* set model\.num_layers=6$",
        ),
        # '|' segments against the pipeline layout.
        (_pattern("*-|*-"), 1, r"has 2 pipeline segments .* but the layout has 1 \("),
        (
            [*_pattern("*-|*-|*-"), *PIPELINE_2],
            2,
            r"has 3 pipeline segments .* the layout has 2 \(pipeline_model_parallel_size 2 x",
        ),
        (
            [*_pattern("*-*-*-*-"), *PIPELINE_2, "model.virtual_pipeline_model_parallel_size=2"],
            2,
            r"has no '\|' separators, which a virtual pipeline needs: give 4 segments",
        ),
        (
            [*_pattern("*-*-*"), *PIPELINE_2],
            2,
            r"has 5 sublayers, not divisible by pipeline_model_parallel_size 2; split it",
        ),
        ([*_pattern("*-||*-"), *PIPELINE_2], 2, r"'\|' at position 3 leaves an empty pipeline"),
        ([*_pattern("*-*-|"), *PIPELINE_2], 2, r"'\|' at position 5 leaves an empty pipeline"),
        # Experts and the pattern's E sublayers.
        (_pattern("*E*-"), 1, r"'E' at position 2 is an MoE sublayer, which needs model\.num_moe"),
        (
            [*_pattern("*-*-"), *EXPERTS],
            1,
            r"model\.num_moe_experts=4 but model\.hybrid_layer_pattern='\*-\*-' has no 'E'",
        ),
        (
            [*_pattern("*E*E"), *EXPERTS, "model.moe_layer_freq=2"],
            1,
            r"model\.moe_layer_freq=2 is not read when model\.hybrid_layer_pattern is set",
        ),
        # Settings built for the GPT architecture only.
        (
            ["model.architecture=gpt", *_pattern("*-*-")],
            1,
            r"model\.hybrid_layer_pattern is read by the hybrid architecture only: set model\.",
        ),
        (
            ["model.layer_variant=layerscale"],
            1,
            r"model\.layer_variant=layerscale is built for model\.architecture=gpt only",
        ),
        (
            ["model.output_layer_init=depth_scaled"],
            1,
            r"model\.output_layer_init=depth_scaled is built for model\.architecture=gpt only",
        ),
        (
            ["model.cpu_offloading=true", "model.transformer_engine=true"],
            1,
            r"model\.cpu_offloading=true is built for model\.architecture=gpt only: .*HybridStack",
        ),
        # megatron-core's deprecated ratios (NeMo's Mamba configs) instead of a pattern.
        (
            ["+model.hybrid_mlp_ratio=0.5"],
            1,
            r"model\.hybrid_mlp_ratio=0\.5 is not supported \(deprecated .*; give model\.hybrid_",
        ),
        # Full recomputation counts the sublayers of the longest '|' segment.
        (
            [
                *_pattern("*-*-|*-"),
                *PIPELINE_2,
                *FULL_RECOMPUTE,
                "model.activations_checkpoint_num_layers=5",
            ],
            2,
            r"activations_checkpoint_num_layers \(5\) exceeds the sublayers of the longest pipe",
        ),
    ],
)
def test_bad_hybrid_settings_are_one_line_errors(overrides, devices, message):
    assert re.search(message, config_error(*HYBRID, f"trainer.devices={devices}", *overrides))


def test_good_patterns_validate():
    """The rules above refuse only what they name: the same keys, right, pass."""
    _config(*_pattern("-*-E**-"), *EXPERTS)
    _config(*_pattern("*-*E|*-*E"), *EXPERTS, *PIPELINE_2, devices=2)
    _config(
        *_pattern("*-|*-|*-|*-"),
        *PIPELINE_2,
        "model.virtual_pipeline_model_parallel_size=2",
        devices=2,
    )
    # Uneven segments: 4 recomputed sublayers fit the first (longest) stage, though they
    # exceed num_layers / pipeline size (3), the bound without '|'.
    _config(
        *_pattern("*-*-|*-"),
        *PIPELINE_2,
        *FULL_RECOMPUTE,
        "model.activations_checkpoint_num_layers=4",
        devices=2,
    )
    # The GPT twin takes GPT's keys as they are (num_layers counts blocks).
    _config(*EXPERTS, "model.moe_layer_freq=2")
    _config("+model.hybrid_attention_ratio=0.0", "+model.hybrid_mlp_ratio=null")


def test_nemo_hybrid_override_pattern_sets_the_pattern():
    cfg = _config(*EXPERTS, "model.num_layers=4", "+model.hybrid_override_pattern=*E*-")
    assert cfg.model.hybrid_layer_pattern == "*E*-"
    assert model_config(cfg, 256).sublayer_pattern() == "*E*-"


def test_gpt_twin_recomputes_the_blocks_the_gpt_model_recomputes():
    """megatron-core counts recompute_num_layers in modules per stage: blocks in GPTModel,
    sublayers in HybridModel. The twin's count is doubled so that both recompute the same
    attention and MLP; with a pattern the key already counts sublayers."""
    recompute = [*FULL_RECOMPUTE, "model.activations_checkpoint_num_layers=2"]
    gpt = _config(*recompute, "model.architecture=gpt")
    twin = _config(*recompute)
    patterned = _config(*recompute, *_pattern("*-*-*-*-"))
    counts = [model_config(c, 256).transformer_config().recompute_num_layers for c in (gpt, twin)]
    assert counts == [2, 4]
    assert model_config(patterned, 256).transformer_config().recompute_num_layers == 2


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("*X", r"error: model\.hybrid_layer_pattern='\*X': 'X' at position 2 is not a layer"),
        ("*-M-", r"error: model\.hybrid_layer_pattern='\*-M-': 'M' at position 3 is a Mamba"),
        ("*-*-*-", r"error: model\.hybrid_layer_pattern='\*-\*-\*-': has 6 sublayers but"),
    ],
)
def test_cli_refuses_a_bad_pattern_in_one_line_and_makes_no_run_directory(
    pattern, message, tmp_path, capsys
):
    runs = tmp_path / "runs"
    code = main(
        [
            "train",
            str(DEMO_CONFIG),
            *HYBRID,
            f"model.hybrid_layer_pattern={pattern}",
            f"exp_manager.exp_dir={runs}",
        ]
    )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err
    assert len(errors) == 1
    assert re.match(message, errors[0]), errors
    assert not runs.exists()
