"""Hugging Face export / import of hybrid runs (``model.architecture: hybrid``): a
GPT-equivalent pattern exports exactly the model its GPT run exports, import writes a
checkpoint the hybrid model loads, and other patterns are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import perturb_norm_weights
from hf_parity import (
    QWEN2_MOE,
    SEQ,
    VOCAB,
    assert_parity,
    megatron_logits,
    run_config,
    safetensors_tensors,
    save_checkpoint,
    silent,
)

from megatron_lns.config.hybrid_pattern import gpt_key_to_hybrid
from megatron_lns.config.sources import load_run_config
from megatron_lns.convert import ConversionError, export_hf, import_hf
from megatron_lns.convert.architectures import architecture_for_model_config
from megatron_lns.model.language_model import build_model
from megatron_lns.training.build import model_config

CASES = {
    # The GPT twin (no pattern: num_layers counts blocks) of a dense Llama.
    "llama-twin": (dict(), dict(architecture="hybrid"), ["model.architecture=hybrid"]),
    # A pattern (num_layers counts sublayers) with a dense first block: Qwen2-MoE.
    "qwen2moe-pattern": (
        dict(QWEN2_MOE, moe_layer_freq=[0, 1, 1, 1]),
        dict(QWEN2_MOE, architecture="hybrid", num_layers=8, hybrid_layer_pattern="*-*E*E*E"),
        ["model.architecture=hybrid", "model.hybrid_layer_pattern='*-*E*E*E'"],
    ),
}


def save_run(root: Path, cfg, state: dict[str, torch.Tensor]) -> Path:
    """A checkpoint of ``cfg`` holding ``state``, as training saves it."""
    model = build_model(model_config(cfg, VOCAB))
    model[0].load_state_dict(state)
    return save_checkpoint(model, root, cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_run_exports_its_gpt_runs_model_and_imports_back(seeded, tmp_path, case):
    gpt_model, hybrid_model, import_overrides = CASES[case]
    gpt_cfg, hybrid_cfg = run_config(**gpt_model), run_config(**hybrid_model)
    gpt = build_model(model_config(gpt_cfg, VOCAB))[0]
    perturb_norm_weights(gpt)
    state = gpt.state_dict()
    save_run(tmp_path / "gpt", gpt_cfg, state)
    hybrid = {gpt_key_to_hybrid(key): tensor for key, tensor in state.items()}
    checkpoint = save_run(tmp_path / "hybrid", hybrid_cfg, hybrid)

    gpt_hf = export_hf(tmp_path / "gpt", tmp_path / "gpt_hf", progress=silent)
    hybrid_hf = export_hf(tmp_path / "hybrid", tmp_path / "hybrid_hf", progress=silent)
    assert (hybrid_hf / "config.json").read_text() == (gpt_hf / "config.json").read_text()
    expected, exported = safetensors_tensors(gpt_hf), safetensors_tensors(hybrid_hf)
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    assert_parity(checkpoint, hybrid_cfg, hybrid_hf)

    config = import_hf(
        hybrid_hf, tmp_path / "imported", overrides=import_overrides, lns=True, progress=silent
    )
    imported_cfg = load_run_config(config)
    assert imported_cfg.model.architecture == "hybrid"
    assert imported_cfg.model.hybrid_layer_pattern == hybrid_cfg.model.hybrid_layer_pattern
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        megatron_logits(config.parent / "checkpoints" / "iter_0000000", imported_cfg, tokens),
        megatron_logits(checkpoint, hybrid_cfg, tokens),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("pattern", ["*--*-", "**-", "-*-", "*-*"])
def test_export_refuses_a_pattern_no_stock_architecture_has(pattern):
    cfg = run_config(architecture="hybrid", num_layers=len(pattern), hybrid_layer_pattern=pattern)
    with pytest.raises(ConversionError, match="Hugging Face has no such architecture") as err:
        architecture_for_model_config(cfg.model)
    assert "\n" not in str(err.value) and repr(pattern) in str(err.value)


def test_import_refuses_a_pattern_other_than_the_models(seeded, tmp_path):
    cfg = run_config()
    gpt = build_model(model_config(cfg, VOCAB))[0]
    save_run(tmp_path / "gpt", cfg, gpt.state_dict())
    hf = export_hf(tmp_path / "gpt", tmp_path / "hf", progress=silent)
    overrides = ["model.architecture=hybrid", "model.hybrid_layer_pattern='*-*-*E*-'"]
    with pytest.raises(ConversionError, match=r"conflicts with .*config\.json"):
        import_hf(hf, tmp_path / "imported", overrides=overrides, lns=True, progress=silent)
    assert not (tmp_path / "imported").exists()
