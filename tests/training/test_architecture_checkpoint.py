"""GPT checkpoints load into the hybrid model (megatron-core's translation for stacked
layers, ours for per-layer keys) and compute the same logits; everything else that does
not fit is refused in one line. In one process (``megatron_world1``); the trainer-level
tests (optimizer state, schedule, layouts) are in test_hybrid_checkpoint.py."""

import dataclasses

import pytest
import torch
from helpers import tiny_config

from megatron_lns.model.language_model import build_model
from megatron_lns.training import architecture_checkpoint as architecture
from megatron_lns.training.checkpoint import (
    CheckpointError,
    load_model_weights,
    save_model_weights,
)

# The per-layer layout: megatron files a model whose MoE layers are listed under
# per-layer keys (a dense first layer here).
MODELS = {
    "stacked": tiny_config(),
    "per_layer": tiny_config(num_moe_experts=4, moe_layer_freq=[0, 1, 1, 1], moe_router_topk=2),
}


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model.eval()(tokens, positions, None)


@pytest.mark.parametrize("layout", list(MODELS))
def test_a_gpt_checkpoint_loads_into_the_hybrid_twin(seeded, tmp_path, layout):
    gpt_config = MODELS[layout]
    gpt = build_model(gpt_config)
    save_model_weights(gpt, tmp_path)
    assert architecture.has_per_layer_keys(tmp_path) == (layout == "per_layer")
    assert architecture.read_saved_architecture(tmp_path) == {"name": "gpt"}
    torch.manual_seed(99)  # the hybrid model starts from other weights
    hybrid = build_model(dataclasses.replace(gpt_config, architecture="hybrid"))
    tokens = torch.randint(0, gpt_config.vocab_size, (2, gpt_config.seq_length))
    assert not torch.equal(_logits(hybrid[0], tokens), _logits(gpt[0], tokens))
    load_model_weights(hybrid, tmp_path)
    assert torch.equal(_logits(hybrid[0], tokens), _logits(gpt[0], tokens))


def test_a_hybrid_checkpoint_records_its_pattern_and_is_refused_elsewhere(seeded, tmp_path):
    hybrid_config = tiny_config(architecture="hybrid")
    save_model_weights(build_model(hybrid_config), tmp_path)
    saved = architecture.read_saved_architecture(tmp_path)
    assert saved == {"name": "hybrid", "sublayers": "*-*-*-*-"}
    with pytest.raises(CheckpointError, match=r"resume it with model\.architecture=hybrid"):
        load_model_weights(build_model(tiny_config()), tmp_path)
    other = tiny_config(architecture="hybrid", num_layers=7, hybrid_layer_pattern="*-*-*--")
    with pytest.raises(CheckpointError, match=r"holds the hybrid pattern '\*-\*-\*-\*-'"):
        load_model_weights(build_model(other), tmp_path)


def test_a_gpt_checkpoint_loads_only_into_its_twin():
    gpt = {"name": "gpt"}
    assert architecture.architecture_mismatch(gpt, gpt) is None
    assert architecture.architecture_mismatch(gpt, {"name": "hybrid", "sublayers": "*E*-"}) is None
    problem = architecture.architecture_mismatch(gpt, {"name": "hybrid", "sublayers": "*--*-"})
    assert "only into the hybrid pattern that is its twin" in problem
    # A checkpoint from before the record existed was written by GPT.
    assert architecture.saved_architecture({"iteration": 3}) == gpt
