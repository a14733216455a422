"""Every bundled config runs on either architecture: the paper configs and OLMo stay on
GPT by default (megatron-core 0.19 still ships GPTModel) and ``model.architecture=hybrid``
switches each to its hybrid twin, which validates at the config's own layout and builds
the same parameters under the twin's names."""

import pytest
from helpers import bundled_config_inputs

from megatron_lns.config import hybrid_pattern, load_config, validate
from megatron_lns.config.bundled import bundled_config_dir, bundled_config_names
from megatron_lns.training.build import build_weights_model, model_config, parallel_layout

VOCAB = 256
# Narrow enough to build every config on a CPU in a second; the depth, the MoE layout,
# the norms and the pipeline layout stay each config's own.
NARROW = ["model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4"]


def _inputs(name: str) -> list[str]:
    return bundled_config_inputs(bundled_config_dir() / f"{name}.yaml")


def _narrow(cfg) -> list[str]:
    m = cfg.model
    narrow = list(NARROW)
    if m.num_query_groups:
        narrow.append("model.num_query_groups=2")
    if m.kv_channels:
        narrow.append("model.kv_channels=16")
    if m.num_moe_experts:
        narrow.append("model.moe_ffn_hidden_size=32")
    if m.moe_shared_expert_intermediate_size:
        narrow.append("model.moe_shared_expert_intermediate_size=32")
    return narrow


def _parameters(model) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", bundled_config_names())
def test_each_bundled_config_switches_to_hybrid_with_one_override(name, megatron_world1):
    inputs = _inputs(name)
    default = load_config(bundled_config_dir() / f"{name}.yaml", inputs)
    explicit = default.model.hybrid_layer_pattern is not None
    assert default.model.architecture == ("hybrid" if explicit else "gpt")

    hybrid = load_config(
        bundled_config_dir() / f"{name}.yaml", [*inputs, "model.architecture=hybrid"]
    )
    validate(hybrid, check_files=False)
    full = model_config(hybrid, VOCAB)
    # At the config's own layout: one '|' segment per pipeline stage and virtual chunk.
    layout = parallel_layout(hybrid)
    stacked = full.hybrid_stack_pattern(layout)
    segments = stacked.split(hybrid_pattern.PIPE)
    if layout.pipeline > 1:
        assert len(segments) == layout.pipeline * (layout.virtual_pipeline or 1)

    overrides = [*inputs, *_narrow(hybrid)]
    narrow_hybrid = load_config(
        bundled_config_dir() / f"{name}.yaml", [*overrides, "model.architecture=hybrid"]
    )
    built = build_weights_model(narrow_hybrid, VOCAB)
    expected = model_config(narrow_hybrid, VOCAB).parameter_counts().total
    assert sum(p.numel() for p in built.parameters()) == expected
    if explicit:
        return

    assert hybrid_pattern.is_gpt_equivalent(stacked)
    assert len(hybrid_pattern.sublayers(stacked)) == 2 * full.num_layers
    gpt = build_weights_model(load_config(bundled_config_dir() / f"{name}.yaml", overrides), VOCAB)
    twin_names = {hybrid_pattern.gpt_key_to_hybrid(k): v for k, v in _parameters(gpt).items()}
    assert twin_names == _parameters(built)
