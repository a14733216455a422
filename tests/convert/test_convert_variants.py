"""Hugging Face export of the paper's baseline variants: LayerScale and SkipInit runs leave
as stock models with their branch gains folded into ``o_proj`` / ``down_proj`` (logit parity
with megatron and with the independent plain-PyTorch reference, and a negative control
without the fold); Post-LN, DeepNorm and Mix-LN are refused, each with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import (
    QWEN2_MOE,
    TOLERANCE,
    VOCAB,
    assert_parity,
    hf_logits,
    run_config,
    safetensors_tensors,
    sample_tokens,
    save_checkpoint,
    silent,
)
from reference_llama import ReferenceLlama

from megatron_lns.config.choices import LAYER_VARIANTS
from megatron_lns.convert import ConversionError, export_hf, import_hf
from megatron_lns.convert.architectures import Architecture, architecture_for_model_config
from megatron_lns.convert.architectures.refusals import UNEXPORTABLE_VARIANTS
from megatron_lns.convert.mapping import BRANCH_GAINS
from megatron_lns.model.language_model import build_model
from megatron_lns.training.build import model_config
from megatron_lns.training.checkpoint import load_model_weights


def perturb_norms_and_gains(model: torch.nn.Module, seed: int = 1) -> None:
    """Norms start at 1, LayerScale at 1e-3 and SkipInit at 0: give every norm, bias and
    gain values far from those (gains of both signs around 1), so a fold left out or
    applied to the wrong rows or branch shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("_bda.layerscale", "_bda.gate")):
                param.copy_(1.0 + 0.7 * torch.randn(param.shape, generator=gen))


def save_run(root: Path, cfg) -> Path:
    """A checkpoint of ``cfg`` with perturbed norms and gains, as training saves it."""
    chunks = build_model(model_config(cfg, VOCAB))
    for chunk in chunks:
        perturb_norms_and_gains(chunk)
    return save_checkpoint(chunks, root, cfg)


def reference_logits(checkpoint: Path, cfg, tokens: torch.Tensor) -> torch.Tensor:
    """The plain-PyTorch reference (tests/reference_llama.py), which multiplies each
    branch output by its gain explicitly, on the checkpoint's raw weights."""
    m = cfg.model
    model = build_model(model_config(cfg, VOCAB))
    load_model_weights(model, checkpoint)
    reference = ReferenceLlama(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        vocab_size=model[0].state_dict()["embedding.word_embeddings.weight"].shape[0],
        lns=m.norm_scaling == "lns",
        eps=m.layernorm_epsilon,
        variant=m.layer_variant,
    )
    reference.load_megatron_state_dict(model[0].state_dict())
    with torch.no_grad():
        return reference(tokens)[..., :VOCAB]


# case -> (model settings, the Hugging Face class, whether the reference computes it).
GAIN_CASES = {
    "layerscale-preln": (dict(layer_variant="layerscale", norm_scaling="none"), "Llama", True),
    "layerscale-lns": (dict(layer_variant="layerscale"), "Llama", True),
    "skipinit-lns": (dict(layer_variant="skipinit"), "Llama", True),
    # The gain multiplies the bias too: g * (W x + b).
    "layerscale-lns-bias": (dict(layer_variant="layerscale", bias=True), "Llama", False),
    "skipinit-preln-bias-tied": (
        dict(
            layer_variant="skipinit",
            norm_scaling="none",
            bias=True,
            share_embeddings_and_output_weights=True,
        ),
        "Llama",
        False,
    ),
    # OLMo-style parameter-free LayerNorm -> StableLM.
    "layerscale-olmo-lns": (
        dict(layer_variant="layerscale", normalization="layernorm", norm_affine=False),
        "StableLm",
        False,
    ),
    # An MoE MLP branch: the gain folds into every expert's and the shared expert's fc2.
    "layerscale-qwen2moe-lns": (
        dict(QWEN2_MOE, moe_layer_freq=[0, 1, 1, 1], layer_variant="layerscale"),
        "Qwen2Moe",
        False,
    ),
}


@pytest.mark.parametrize("case", list(GAIN_CASES))
def test_branch_gains_fold_into_a_stock_model_with_logit_parity(seeded, tmp_path, case):
    model, expected, has_reference = GAIN_CASES[case]
    cfg = run_config(**model)
    checkpoint = save_run(tmp_path / "run", cfg)
    out = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [f"{expected}ForCausalLM"]
    assert_parity(checkpoint, cfg, out)
    if has_reference:
        tokens = sample_tokens()
        torch.testing.assert_close(
            hf_logits(out, tokens), reference_logits(checkpoint, cfg, tokens), **TOLERANCE
        )


@pytest.mark.parametrize("variant", ["layerscale", "skipinit"])
def test_export_without_the_gain_fold_fails_parity(seeded, tmp_path, monkeypatch, variant):
    """Negative control: the parity check is sensitive to a missing gain fold (the gains
    are ~1 +- 0.7, so the unfolded logits are far outside the tolerance)."""
    cfg = run_config(layer_variant=variant)
    checkpoint = save_run(tmp_path / "run", cfg)
    monkeypatch.setattr(Architecture, "fold_branch_gains", lambda self, tensors, index: tensors)
    out = export_hf(checkpoint, tmp_path / "hf", progress=silent)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_parity(checkpoint, cfg, out)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_gain_fold_is_one_rounding_of_the_exact_product(seeded, tmp_path, precision):
    """Row i of o_proj / down_proj (and bias i) is g_i times megatron's, rounded once to
    the checkpoint's dtype; each branch takes its own gain."""
    cfg = run_config(precision, layer_variant="layerscale", bias=True)
    checkpoint = save_run(tmp_path / "run", cfg)
    exported = safetensors_tensors(export_hf(checkpoint, tmp_path / "hf", progress=silent))
    model = build_model(model_config(cfg, VOCAB))
    load_model_weights(model, checkpoint)
    raw = model[0].state_dict()
    dtype = torch.float32 if precision == "32" else torch.bfloat16
    for i in range(cfg.model.num_layers):
        for megatron, gain, hf in (
            ("self_attention.linear_proj", "self_attn_bda", "self_attn.o_proj"),
            ("mlp.linear_fc2", "mlp_bda", "mlp.down_proj"),
        ):
            g = raw[f"decoder.layers.{i}.{gain}.layerscale"].double()
            for suffix, per_row in (("weight", g[:, None]), ("bias", g)):
                weight = raw[f"decoder.layers.{i}.{megatron}.{suffix}"]
                assert weight.dtype == dtype
                folded = exported[f"model.layers.{i}.{hf}.{suffix}"]
                assert torch.equal(folded, (weight.double() * per_row).to(dtype))
                assert not torch.equal(folded, weight)


def test_gain_export_imports_as_plain_pre_ln_and_exports_back_identically(seeded, tmp_path):
    """The gains are in the weights now: import gives a Pre-LN (here LNS) run without
    gains, whose export is the first export bit for bit; asking import for the LayerScale
    variant is refused by name, since the stock model has no gains to load into it."""
    cfg = run_config(layer_variant="layerscale")
    save_run(tmp_path / "run", cfg)
    first = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    run_yaml = import_hf(first, tmp_path / "imported", lns=True, progress=silent)
    imported = (tmp_path / "imported" / "config.yaml").read_text()
    assert "layer_variant: pre_ln" in imported and "norm_scaling: lns" in imported
    second = export_hf(run_yaml.parent, tmp_path / "hf2", progress=silent)
    a, b = safetensors_tensors(first), safetensors_tensors(second)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    with pytest.raises(ConversionError, match=r"model.layer_variant=layerscale conflicts with"):
        import_hf(
            first,
            tmp_path / "as-layerscale",
            ["model.layer_variant=layerscale"],
            lns=True,
            progress=silent,
        )
    assert not (tmp_path / "as-layerscale").exists()


# variant -> what its message must say about why no stock architecture computes it.
REFUSED_VARIANTS = {
    "post_ln": r"Post-LN normalises after the residual add",
    "deepnorm": r"DeepNorm scales the residual by alpha = \(2N\)\^\(1/4\) before a norm after",
    "mix_ln": r"Mix-LN's first layers are Post-LN, with the norm after the residual add",
    "peri_ln": r"Peri-LN normalises each branch's output before the residual add",
    "gpas": r"GPAS scales the residual stream after each add by a learned 1 - SiLU\(alpha_l\)",
}


@pytest.mark.parametrize("variant", list(REFUSED_VARIANTS))
def test_post_norm_variants_are_refused_with_the_reason(seeded, tmp_path, variant):
    cfg = run_config(layer_variant=variant, norm_scaling="none")
    pattern = (
        rf"^model.layer_variant={variant} cannot be exported: {REFUSED_VARIANTS[variant]}.*"
        r"normalise only each branch's input \(Pre-LN\)$"
    )
    with pytest.raises(ConversionError, match=pattern) as refused:
        architecture_for_model_config(cfg.model)
    assert "\n" not in str(refused.value)


def test_every_layer_variant_exports_or_is_refused_with_a_reason():
    """A new layer_variant must be classified: exported as it is, folded, or refused."""
    classified = {"pre_ln", *BRANCH_GAINS, *UNEXPORTABLE_VARIANTS}
    assert set(LAYER_VARIANTS) == classified
    assert not set(BRANCH_GAINS) & set(UNEXPORTABLE_VARIANTS)
    assert set(REFUSED_VARIANTS) == set(UNEXPORTABLE_VARIANTS)
