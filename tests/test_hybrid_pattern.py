"""The hybrid layer pattern's arithmetic (megatron_lns/config/hybrid_pattern.py, no torch): the
paper's block index of each sublayer, the GPT twin's pattern, parameter names between the
two architectures, and the one-line errors of a bad pattern.

Expected values are written out by hand from the rule in the module's docstring (an
attention starts a block; MLP / MoE sublayers share the block of the last attention
before them; MLPs before any attention are block 1), not computed by the code under test.
"""

import pytest

from megatron_lns.config.hybrid_pattern import (
    HybridPatternError,
    block_numbers,
    gpt_equivalent_pattern,
    gpt_key_to_hybrid,
    hybrid_key_to_gpt,
    is_gpt_equivalent,
    num_blocks,
    pattern_errors,
)


@pytest.mark.parametrize(
    "pattern, blocks",
    [
        ("*-*-*-", (1, 1, 2, 2, 3, 3)),  # the GPT twin: block l is sublayers 2l-1, 2l
        ("*-|*-", (1, 1, 2, 2)),  # pipeline separators are not sublayers
        ("*E*-", (1, 1, 2, 2)),  # an MoE sublayer is an MLP
        ("--*-", (1, 1, 1, 1)),  # MLPs before the first attention: block 1
        ("**-", (1, 2, 2)),  # two attentions in a row: block 1 has no MLP
        ("*---", (1, 1, 1, 1)),  # several MLPs after one attention share its block
        ("-*--**E-", (1, 1, 1, 1, 2, 3, 3, 3)),
        ("-", (1,)),
        ("", ()),
    ],
)
def test_block_numbers(pattern, blocks):
    assert block_numbers(pattern) == blocks


@pytest.mark.parametrize(
    "pattern, blocks", [("-*--**E-", 3), ("*-|*-|*-", 3), ("--", 1), ("**", 2), ("", 0)]
)
def test_num_blocks_is_the_depth_in_blocks(pattern, blocks):
    assert num_blocks(pattern) == blocks


@pytest.mark.parametrize(
    "moe_layers, segments, pattern",
    [
        ([0, 0, 0, 0], 1, "*-*-*-*-"),
        ([0, 1, 0, 1], 1, "*-*E*-*E"),
        ([1, 1], 1, "*E*E"),
        ([0, 0, 0, 0], 2, "*-*-|*-*-"),
        ([0, 1, 0, 1], 4, "*-|*E|*-|*E"),
    ],
)
def test_gpt_equivalent_pattern(moe_layers, segments, pattern):
    assert gpt_equivalent_pattern(moe_layers, segments) == pattern
    assert is_gpt_equivalent(pattern)
    layers = len(moe_layers)
    assert block_numbers(pattern) == tuple(b for b in range(1, layers + 1) for _ in range(2))


@pytest.mark.parametrize("layers, segments", [(3, 2), (4, 3), (4, 0)])
def test_gpt_equivalent_pattern_refuses_an_uneven_split(layers, segments):
    with pytest.raises(HybridPatternError, match=f"{layers} layers do not split evenly"):
        gpt_equivalent_pattern([0] * layers, segments)


@pytest.mark.parametrize("pattern", ["*-", "*E", "*-*E*-", "*-|*E", "*E|*E|*-"])
def test_is_gpt_equivalent(pattern):
    assert is_gpt_equivalent(pattern)


@pytest.mark.parametrize(
    "pattern",
    ["", "|", "*", "-", "-*", "**--", "*-*", "*--*", "*-**", "*-EE", "*-*M"],
)
def test_is_not_gpt_equivalent(pattern):
    assert not is_gpt_equivalent(pattern)


# (GPT name, its name in the GPT twin): layer i's attention -> sublayer 2i, its MLP -> 2i+1.
KEYS = [
    ("decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.weight"),
    (
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
    ),
    ("decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.1.mlp.linear_fc2.weight"),
    (
        "decoder.layers.3.self_attention.linear_proj.weight",
        "decoder.layers.6.self_attention.linear_proj.weight",
    ),
    (
        "decoder.layers.3.self_attention.q_layernorm.weight",
        "decoder.layers.6.self_attention.q_layernorm.weight",
    ),
    (
        "decoder.layers.3.self_attention.core_attention._extra_state",
        "decoder.layers.6.self_attention.core_attention._extra_state",
    ),
    ("decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.7.mlp.linear_fc1.weight"),
    # the Transformer Engine backend's fused norms
    (
        "decoder.layers.12.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.24.self_attention.linear_qkv.layer_norm_weight",
    ),
    (
        "decoder.layers.12.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.25.mlp.linear_fc1.layer_norm_weight",
    ),
    # MoE: router and experts move with the MLP, expert numbers stay
    ("decoder.layers.1.mlp.router.weight", "decoder.layers.3.mlp.router.weight"),
    (
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight",
    ),
    (
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight",
        "decoder.layers.3.mlp.shared_experts.linear_fc2.weight",
    ),
    ("decoder.final_layernorm.weight", "decoder.final_norm.weight"),
    ("decoder.final_layernorm.bias", "decoder.final_norm.bias"),
    # outside the decoder: unchanged
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("output_layer.weight", "output_layer.weight"),
    # under a wrapper's prefix (DDP's module.)
    (
        "module.decoder.layers.2.self_attention.linear_qkv.weight",
        "module.decoder.layers.4.self_attention.linear_qkv.weight",
    ),
    (
        "module.decoder.layers.2.mlp.linear_fc1.weight",
        "module.decoder.layers.5.mlp.linear_fc1.weight",
    ),
]


@pytest.mark.parametrize("gpt, hybrid", KEYS)
def test_gpt_and_hybrid_names_translate_both_ways(gpt, hybrid):
    assert gpt_key_to_hybrid(gpt) == hybrid
    assert hybrid_key_to_gpt(hybrid) == gpt


def test_a_name_that_only_contains_decoder_layers_is_not_renumbered():
    key = "encoder_decoder.layers.3.mlp.linear_fc1.weight"
    assert gpt_key_to_hybrid(key) == key
    assert hybrid_key_to_gpt(key) == key


def test_every_sublayer_of_the_twin_round_trips():
    """Names built for a 3-layer twin map to GPT names and back unchanged, and sublayers
    2i and 2i+1 both come from GPT layer i."""
    for sublayer in range(6):
        module = "self_attention.linear_qkv" if sublayer % 2 == 0 else "mlp.linear_fc1"
        hybrid = f"decoder.layers.{sublayer}.{module}.weight"
        gpt = hybrid_key_to_gpt(hybrid)
        assert gpt == f"decoder.layers.{sublayer // 2}.{module}.weight"
        assert gpt_key_to_hybrid(gpt) == hybrid


# -- pattern_errors: one sentence each, naming the symbol and its 1-based position ----------


@pytest.mark.parametrize(
    "pattern, num_layers, pipeline, virtual",
    [
        ("*-*-", 4, 1, None),
        ("*-*E*-*E", 8, 1, None),
        ("--*-", 4, 1, None),
        ("*-*-|*-*-", 8, 2, None),
        ("*-*-*-*-", 8, 2, None),  # no '|': megatron splits it evenly
        ("*-|*-|*-|*-", 8, 2, 2),
        ("*-*|-", 4, 2, None),  # segments need not be whole blocks
    ],
)
def test_a_good_pattern_has_no_errors(pattern, num_layers, pipeline, virtual):
    assert pattern_errors(pattern, num_layers, pipeline, virtual) == []


@pytest.mark.parametrize(
    "pattern, num_layers, expected",
    [
        ("*-M-", 4, ["'M' at position 3 is a Mamba layer"]),
        ("*-G-", 4, ["'G' at position 3 is a gated delta net layer"]),
        ("D-*-", 4, ["'D' at position 1 is a DeepSeek sparse attention layer"]),
        ("*-+-", 4, ["'+' at position 3 is a multi-latent attention layer"]),
        ("*-*-/*-", 4, ["'/' at position 5 starts multi-token-prediction layers"]),
        ("*-x-", 4, ["'x' at position 3 is not a layer symbol"]),
        ("*-|*M", 4, ["'M' at position 5"]),  # positions count the '|'
        ("M-*x", 4, ["'M' at position 1", "'x' at position 4"]),  # every bad symbol
    ],
)
def test_a_bad_symbol_is_named_with_its_position(pattern, num_layers, expected):
    errors = pattern_errors(pattern, num_layers)
    assert len(errors) == len(expected)
    for error, start in zip(errors, expected, strict=True):
        assert error.startswith(start), error


def test_a_refused_symbol_says_what_megatron_lns_builds():
    (error,) = pattern_errors("*-M-", 4)
    assert "CUDA" in error and "* (attention), - (MLP), E (mixture-of-experts MLP)" in error


def test_the_length_must_match_num_layers_counted_in_sublayers():
    (error,) = pattern_errors("*-*-", 2)
    assert error.startswith("has 4 sublayers but model.num_layers is 2")
    assert error.endswith("set model.num_layers=4")
    (error,) = pattern_errors("*-|*-", 6, pipeline=2)  # the '|' are not sublayers
    assert "has 4 sublayers but model.num_layers is 6" in error


@pytest.mark.parametrize(
    "pattern, num_layers, pipeline, virtual, expected",
    [
        ("*-|*-|*-", 6, 2, None, "has 3 pipeline segments ('|'-separated) but the layout has 2"),
        ("*-|*-", 4, 2, 2, "has 2 pipeline segments ('|'-separated) but the layout has 4"),
        ("*-|*-", 4, 1, None, "has 2 pipeline segments ('|'-separated) but the layout has 1"),
        ("*-*-", 4, 2, 2, "has no '|' separators, which a virtual pipeline needs: give 4"),
        ("*-*", 3, 2, None, "has 3 sublayers, not divisible by pipeline_model_parallel_size 2"),
    ],
)
def test_the_segments_must_match_the_pipeline_layout(
    pattern, num_layers, pipeline, virtual, expected
):
    (error,) = pattern_errors(pattern, num_layers, pipeline, virtual)
    assert error.startswith(expected), error


@pytest.mark.parametrize(
    "pattern, positions",
    [("|*-*-", [1]), ("*-*-|", [5]), ("*-||*-", [3]), ("|*-||*-", [1, 4])],
)
def test_an_empty_segment_names_its_separator(pattern, positions):
    """The '|' before the empty segment (for an empty first segment, the one after it)."""
    errors = [
        e for e in pattern_errors(pattern, 4, pipeline=len(pattern.split("|"))) if "empty" in e
    ]
    assert errors == [f"'|' at position {p} leaves an empty pipeline segment" for p in positions]


def test_an_empty_pattern():
    assert pattern_errors("", 0) == ["is empty"]


@pytest.mark.parametrize(
    "args",
    [("*-M-", 4), ("*-*-", 2), ("*-|*-|*-", 6, 2), ("*-*-", 4, 2, 2), ("|*-", 2, 2), ("x", 1)],
)
def test_every_error_is_one_line(args):
    errors = pattern_errors(*args)
    assert errors and all("\n" not in e for e in errors)
