"""Hugging Face export / import of mixture-of-experts models: logit parity of
MixtralForCausalLM and Qwen2MoeForCausalLM with megatron's MoE layers (LNS folded),
round trips, the registry's choice, and refusal of what the stock classes cannot compute."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT, perturb_norm_weights
from hf_parity import (
    HF_TINY,
    MIXTRAL,
    QWEN2_MOE,
    VOCAB,
    assert_architecture_round_trips,
    assert_parity,
    export_then_import,
    import_refuses_edited_config,
    reexported_tensors,
    run_config,
    safetensors_tensors,
    save_checkpoint,
    silent,
)

from megatron_lns.config import load_config
from megatron_lns.config.moe_layers import moe_layer_pattern
from megatron_lns.config.schema import ModelConfig
from megatron_lns.config.settings import HF_CONVERTER, HF_REFUSE, declared_settings
from megatron_lns.convert import ConversionError, export_hf, import_hf
from megatron_lns.convert.architectures import (
    ARCHITECTURES,
    Architecture,
    architecture_for_hf_config,
    architecture_for_model_config,
)
from megatron_lns.convert.architectures.mixtral import Mixtral
from megatron_lns.convert.architectures.moe import ROUTING_BALANCERS
from megatron_lns.convert.hf_fields import FieldReads
from megatron_lns.convert.hf_settings import refused_moe_defaults
from megatron_lns.data.tokenizer import ByteTokenizer
from megatron_lns.model.language_model import build_model
from megatron_lns.training.build import model_config
from megatron_lns.training.checkpoint import load_model_weights


def save_run(root: Path, cfg) -> Path:
    """A checkpoint of ``cfg`` with random weights and perturbed norms, as training saves it."""
    chunks = build_model(model_config(cfg, VOCAB))
    for chunk in chunks:
        perturb_norm_weights(chunk)
    return save_checkpoint(chunks, root, cfg)


PARITY_CASES = {
    # Softmax over the top-k logits (megatron's default) = Mixtral's renormalised top-k.
    "mixtral-lns-top2": (MIXTRAL, "MixtralForCausalLM"),
    "mixtral-lns-top3-tied": (
        dict(MIXTRAL, moe_router_topk=3, share_embeddings_and_output_weights=True),
        "MixtralForCausalLM",
    ),
    "mixtral-preln-kv-channels": (dict(MIXTRAL, norm_scaling="none", kv_channels=24), "Mixtral"),
    # A dense first layer (Qwen2-MoE's mlp_only_layers) and a gated shared expert.
    "qwen2moe-lns-dense-first": (dict(QWEN2_MOE, moe_layer_freq=[0, 1, 1, 1]), "Qwen2Moe"),
    # Softmax over all experts, top-k kept as they are = Qwen2-MoE without norm_topk_prob
    # (megatron's only top-1 routing).
    "qwen2moe-lns-top1-every-other": (
        dict(QWEN2_MOE, moe_router_topk=1, moe_router_pre_softmax=True, moe_layer_freq=2),
        "Qwen2Moe",
    ),
    # No shared expert (tiny_cpu_moe's layout): a Qwen2-MoE whose shared expert is zero wide.
    "qwen2moe-unshared-dense-first": (dict(MIXTRAL, moe_layer_freq=[0, 1, 1, 1]), "Qwen2Moe"),
    "qwen2moe-unshared-pre-softmax-every-other": (
        dict(MIXTRAL, moe_router_pre_softmax=True, moe_layer_freq=[1, 0, 1, 0]),
        "Qwen2Moe",
    ),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_moe_export_matches_megatron_logits(seeded, tmp_path, case):
    model, expected = PARITY_CASES[case]
    cfg = run_config(**model)
    checkpoint = save_run(tmp_path / "run", cfg)
    out = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"][0].startswith(expected)
    if expected == "Qwen2Moe":
        assert config["norm_topk_prob"] == (not cfg.model.moe_router_pre_softmax)
        pattern = moe_layer_pattern(cfg.model.moe_layer_freq, 4)
        assert config["mlp_only_layers"] == [i for i, moe in enumerate(pattern) if not moe]
        assert config["decoder_sparse_step"] == 1
        assert config["intermediate_size"] == cfg.model.ffn_hidden_size
        shared = cfg.model.moe_shared_expert_intermediate_size or 0
        assert config["shared_expert_intermediate_size"] == shared
    assert_parity(checkpoint, cfg, out)


def test_moe_export_without_the_factor_fails_parity(seeded, tmp_path, monkeypatch):
    """Negative control: the parity check is sensitive to a missing LNS fold."""
    cfg = run_config(**QWEN2_MOE)
    checkpoint = save_run(tmp_path / "run", cfg)
    monkeypatch.setattr(Architecture, "norm_scale", lambda self, layer_number: 1.0)
    out = export_hf(checkpoint, tmp_path / "hf", progress=silent)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_parity(checkpoint, cfg, out)


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_the_other_topk_normalisation_fails_parity(seeded, tmp_path, pre_softmax):
    """Negative control for routing: Qwen2-MoE's norm_topk_prob must be the opposite of
    megatron's moe_router_pre_softmax, which is why Mixtral (always renormalising)
    refuses pre-softmax routing."""
    cfg = run_config(**QWEN2_MOE, moe_router_pre_softmax=pre_softmax)
    checkpoint = save_run(tmp_path / "run", cfg)
    out = export_hf(checkpoint, tmp_path / "hf", progress=silent)
    config = json.loads((out / "config.json").read_text())
    config["norm_topk_prob"] = pre_softmax
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_parity(checkpoint, cfg, out)


def test_moe_export_folds_the_factor_into_the_moe_pre_norm(seeded, tmp_path):
    from megatron_lns.model.layer import baked_state_dict

    cfg = run_config(**QWEN2_MOE, moe_layer_freq=[0, 1, 1, 1])
    checkpoint = save_run(tmp_path / "run", cfg)
    exported = safetensors_tensors(export_hf(checkpoint, tmp_path / "hf", progress=silent))
    model = build_model(model_config(cfg, VOCAB))
    load_model_weights(model, checkpoint)
    baked = baked_state_dict(model[0])
    raw = model[0].state_dict()
    for i in range(1, 4):  # MoE layers; 1/sqrt(l) != 1 from block 2 on
        name = f"decoder.layers.{i}.pre_mlp_layernorm.weight"
        hf = exported[f"model.layers.{i}.post_attention_layernorm.weight"]
        assert torch.equal(hf, baked[name]) and not torch.equal(hf, raw[name])


def test_export_reads_one_layer_at_a_time(seeded, tmp_path, monkeypatch):
    """Layer-bounded memory: each read of the checkpoint touches at most one layer."""
    from megatron_lns.convert.checkpoint_reader import CheckpointReader

    save_run(tmp_path / "run", run_config(**QWEN2_MOE))
    reads: list[set[str]] = []
    original = CheckpointReader.read

    def read(self, requests):
        reads.append({key.split(".")[2] for key in requests if key.startswith("decoder.layers.")})
        return original(self, requests)

    monkeypatch.setattr(CheckpointReader, "read", read)
    export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    assert [layers for layers in reads if layers] == [{"0"}, {"1"}, {"2"}, {"3"}]


@pytest.mark.parametrize(
    "model",
    [
        MIXTRAL,
        dict(QWEN2_MOE, moe_layer_freq=[0, 1, 1, 1], moe_router_pre_softmax=True),
        dict(MIXTRAL, moe_layer_freq=[0, 1, 1, 1]),
    ],
    ids=["mixtral", "qwen2moe-dense-first-pre-softmax", "qwen2moe-unshared-dense-first"],
)
def test_moe_export_import_export_is_bitwise_identical(seeded, tmp_path, model):
    cfg = run_config(**model)
    save_run(tmp_path / "run", cfg)
    first, imported = export_then_import(tmp_path / "run", tmp_path)
    m = imported.model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (4, 2, 48)
    assert m.moe_router_pre_softmax == cfg.model.moe_router_pre_softmax
    assert m.moe_shared_expert_intermediate_size == cfg.model.moe_shared_expert_intermediate_size
    assert m.moe_shared_expert_gate == cfg.model.moe_shared_expert_gate
    assert moe_layer_pattern(m.moe_layer_freq, 4) == moe_layer_pattern(cfg.model.moe_layer_freq, 4)
    second = export_hf(tmp_path / "imported", tmp_path / "hf2", progress=silent)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def _tiny_hf_mixtral(path: Path) -> Path:
    """Three layers of MIXTRAL's experts: 4 of 48 channels, 2 routed to."""
    from transformers import MixtralConfig, MixtralForCausalLM

    experts = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    config = MixtralConfig(**HF_TINY, **experts, num_hidden_layers=3, rope_theta=50000.0)
    return _save_hf(MixtralForCausalLM(config), path)


def _tiny_hf_qwen2_moe(path: Path, shared: int = 80) -> Path:
    """Layers 1 and 3 MoE by decoder_sparse_step=2, layer 3 dense by mlp_only_layers."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **HF_TINY,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=shared,
        num_hidden_layers=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
        qkv_bias=False,
    )
    return _save_hf(Qwen2MoeForCausalLM(config), path)


def _save_hf(model: torch.nn.Module, path: Path) -> Path:
    """``model`` with random weights (the router too) and perturbed norms, saved by
    transformers with the byte tokenizer."""
    from megatron_lns.convert.hf_tokenizer import byte_tokenizer_fast

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    byte_tokenizer_fast().save_pretrained(path)
    return path


@pytest.mark.parametrize("make", [_tiny_hf_mixtral, _tiny_hf_qwen2_moe], ids=["mixtral", "qwen"])
def test_hf_moe_import_export_is_bitwise_identical(seeded, tmp_path, make):
    source = make(tmp_path / "source")
    cfg = load_config(import_hf(source, tmp_path / "imported", progress=silent))
    assert cfg.model.norm_scaling == "none" and cfg.model.num_moe_experts == 4
    if make is _tiny_hf_qwen2_moe:
        assert list(cfg.model.moe_layer_freq) == [0, 1, 0, 0]
        assert cfg.model.moe_router_pre_softmax and cfg.model.moe_shared_expert_gate
    checkpoint = tmp_path / "imported" / "checkpoints" / "iter_0000000"
    assert_parity(checkpoint, cfg, source)
    original, exported = reexported_tensors(tmp_path / "imported", source, tmp_path / "hf")
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_hf_qwen2_moe_with_a_zero_wide_shared_expert_imports_without_one(seeded, tmp_path):
    """shared_expert_intermediate_size 0 is a Qwen2-MoE without a shared expert: import
    gives the same logits, export writes it back zero wide with a zero gate (the gate of
    an empty expert multiplies zeros, whatever it holds)."""
    source = _tiny_hf_qwen2_moe(tmp_path / "source", shared=0)
    cfg = load_config(import_hf(source, tmp_path / "imported", progress=silent))
    m = cfg.model
    assert m.moe_shared_expert_intermediate_size is None and not m.moe_shared_expert_gate
    checkpoint = tmp_path / "imported" / "checkpoints" / "iter_0000000"
    assert_parity(checkpoint, cfg, source)
    original, exported = reexported_tensors(tmp_path / "imported", source, tmp_path / "hf")
    for name, tensor in original.items():
        if name.endswith("shared_expert_gate.weight"):
            tensor = torch.zeros_like(tensor)
        assert torch.equal(exported[name], tensor), name


# ----------------------------------------------------------------------------- the registry
def test_dense_models_never_export_as_moe_and_moe_models_pick_by_shared_expert():
    assert type(architecture_for_model_config(run_config().model)).hf_class == "LlamaForCausalLM"
    chosen = [
        ("MixtralForCausalLM", run_config(**MIXTRAL).model),
        ("Qwen2MoeForCausalLM", run_config(**QWEN2_MOE).model),
        # What Mixtral cannot hold goes to Qwen2-MoE, with a zero-wide shared expert.
        ("Qwen2MoeForCausalLM", run_config(**MIXTRAL, moe_layer_freq=[0, 1, 1, 1]).model),
        ("Qwen2MoeForCausalLM", run_config(**MIXTRAL, moe_router_pre_softmax=True).model),
    ]
    for hf_class, model in chosen:
        assert type(architecture_for_model_config(model)).hf_class == hf_class


def test_tiny_cpu_moe_exports_as_qwen2_moe():
    """The bundled MoE comparison (a dense first layer, no shared expert) has an export."""
    cfg = load_config(ROOT / "nemo_configs" / "tiny_cpu_moe.yaml")
    arch = architecture_for_model_config(cfg.model)
    assert type(arch).hf_class == "Qwen2MoeForCausalLM"
    config = arch.hf_config(VOCAB, torch.float32, None, 0)
    assert config.mlp_only_layers == [0] and config.shared_expert_intermediate_size == 0


@pytest.mark.parametrize(
    "arch", [a for a in ARCHITECTURES if a.moe], ids=lambda arch: arch.hf_class
)
def test_each_moe_architecture_reads_back_the_config_json_it_writes(tmp_path, arch):
    model = QWEN2_MOE | dict(moe_layer_freq=[0, 1, 1, 1]) if arch.hf_shared_expert else MIXTRAL
    assert_architecture_round_trips(arch, run_config(**model, rotary_base=50000).model, tmp_path)


# Training values config.json records, set away from transformers' defaults.
TRAINED_WITH = dict(attention_dropout=0.1, hidden_dropout=0.05, init_method_std=0.013)


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda arch: arch.hf_class)
@pytest.mark.parametrize("aux", [0.0, 0.02])
def test_every_exported_config_value_is_the_runs(tmp_path, arch, aux):
    """config.json's dropouts, initializer_range and MoE load-balancing weight are the
    run's, not transformers' defaults (router_aux_loss_coef was 0.001 for a run
    without the loss), and import makes them the imported run's defaults."""
    from transformers import AutoConfig

    moe = (QWEN2_MOE if arch.hf_shared_expert else MIXTRAL) if arch.moe else {}
    cfg = run_config(**moe, **TRAINED_WITH, normalization=arch.norm, moe_aux_loss_coeff=aux)
    exported = arch.from_model_config(cfg.model)
    exported.hf_config(VOCAB, torch.float32, None, ByteTokenizer().eod).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["attention_dropout"] == 0.1
    assert written["initializer_range"] == 0.013
    if arch.hf_hidden_dropout:
        assert written["hidden_dropout"] == 0.05
    if arch.moe:
        assert written["router_aux_loss_coef"] == aux
    imported = architecture_for_hf_config(AutoConfig.from_pretrained(tmp_path), lns=True)
    settings = imported.training_settings()
    assert settings["attention_dropout"] == 0.1 and settings["init_method_std"] == 0.013
    assert settings.get("hidden_dropout", 0.05) == 0.05
    assert settings.get("moe_aux_loss_coeff", aux) == aux


def test_no_load_balancing_loss_exports_a_zero_weight():
    cfg = run_config(**MIXTRAL, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.01)
    config = architecture_for_model_config(cfg.model).hf_config(VOCAB, torch.float32, None, 0)
    assert config.router_aux_loss_coef == 0.0


def _moe_settings(role=None) -> set[str]:
    """The MoE keys of the model section (its ``moe`` group), with the Hugging Face role
    ``role`` where one is given (None: every one)."""
    return {
        item.key
        for item in declared_settings(ModelConfig)
        if item.setting.group == "moe" and (role is None or item.setting.hf == role)
    }


def test_every_moe_setting_refused_by_its_declaration_is_refused_with_its_reason():
    """The MoE settings declared hf=HF_REFUSE (the routing no stock MoE class computes)
    each have a refusal case below, and an imported MoE model routes with their defaults."""
    refused = _moe_settings(HF_REFUSE)
    assert refused and refused <= {key for changes, _ in REFUSALS.values() for key in changes}
    assert {key for key in refused if declaration_of(key).hf_refusal} == refused
    imported = architecture_for_model_config(run_config(**MIXTRAL).model).model_settings()
    assert {key: imported[key] for key in refused} == refused_moe_defaults(ModelConfig)


def test_the_moe_converters_read_exactly_the_settings_declared_converter_mapped():
    """The MoE keys declared hf=HF_CONVERTER are the ones the export converters read to
    build the architecture. One without a declared role (dispatcher, grouped GEMM, router
    dtype, the z-loss, expert parallelism, ...) changes how the function is computed or
    trained, not the function: no converter reads it."""
    read: set[str] = set()
    for model in (MIXTRAL, QWEN2_MOE | dict(moe_layer_freq=[0, 1, 1, 1])):
        reads = FieldReads(run_config(**model).model)
        arch = next(a for a in ARCHITECTURES if a.moe and a.exports_model(reads))
        arch.from_model_config(reads)
        read |= reads.read
    assert _moe_settings(HF_CONVERTER) <= read
    unroled = {key for key in _moe_settings() if declaration_of(key).hf is None}
    assert not read & unroled, sorted(read & unroled)


def declaration_of(key: str):
    return next(i.setting for i in declared_settings(ModelConfig) if i.key == key)


REFUSALS = {
    "score-function": (
        dict(moe_router_score_function="sigmoid"),
        r"model.moe_router_score_function=sigmoid cannot be exported",
    ),
    "expert-bias": (
        dict(moe_router_enable_expert_bias=True),
        r"model.moe_router_enable_expert_bias=True cannot be exported: .* no expert bias",
    ),
    "topk-scaling": (
        dict(moe_router_topk_scaling_factor=2.5),
        r"model.moe_router_topk_scaling_factor=2.5 cannot be exported",
    ),
    "capacity": (
        dict(moe_expert_capacity_factor=1.0),
        r"model.moe_expert_capacity_factor=1.0 cannot be exported: .* never drop tokens",
    ),
    "sinkhorn": (
        dict(moe_router_load_balancing_type="sinkhorn"),
        r"model.moe_router_load_balancing_type=sinkhorn cannot be exported",
    ),
    "bias": (dict(bias=True), r"model.bias=true cannot be exported with model.num_moe_experts"),
    "layernorm": (
        dict(normalization="layernorm"),
        r"model.normalization=layernorm cannot be exported: the supported mixture-of-experts "
        r"architectures \(Mixtral and Qwen2-MoE\) have rmsnorm",
    ),
    "qwen2moe-ungated": (
        dict(moe_shared_expert_intermediate_size=80, moe_shared_expert_gate=False),
        r"model.moe_shared_expert_gate=false cannot be exported: Qwen2-MoE's shared expert",
    ),
    "qwen2moe-kv-channels": (
        dict(moe_shared_expert_intermediate_size=80, moe_shared_expert_gate=True, kv_channels=24),
        r"model.kv_channels=24 cannot be exported as Qwen2-MoE",
    ),
}


def _refused_in_one_line(refuse, changes: dict, message: str) -> None:
    """``refuse`` (export's choice of architecture, or one architecture) refuses the tiny
    Mixtral model with ``changes`` with an error of one line that starts with ``message``.
    The changes are set on the typed section directly: the run-config checks may refuse
    some of these combinations earlier, and export must refuse them on its own."""
    model = dataclasses.replace(run_config(**MIXTRAL).model, **changes)
    with pytest.raises(ConversionError, match="^" + message) as refused:
        refuse(model)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unexportable_moe_settings_are_refused_in_one_line_naming_the_key(case):
    _refused_in_one_line(architecture_for_model_config, *REFUSALS[case])


# What Mixtral itself refuses (export takes these models as Qwen2-MoE instead).
MIXTRAL_REFUSALS = {
    "pre-softmax": (
        dict(moe_router_pre_softmax=True),
        r"model.moe_router_pre_softmax=true cannot be exported: Mixtral divides",
    ),
    "dense-layers": (
        dict(moe_layer_freq=[0, 1, 1, 1]),
        r"model.moe_layer_freq=\[0, 1, 1, 1\] cannot be exported as Mixtral, which has experts",
    ),
    "shared-expert": (
        dict(moe_shared_expert_intermediate_size=80, moe_shared_expert_gate=True),
        r"model.moe_shared_expert_intermediate_size=80 cannot be exported as Mixtral",
    ),
}


@pytest.mark.parametrize("case", list(MIXTRAL_REFUSALS))
def test_mixtral_refuses_what_it_cannot_hold_in_one_line(case):
    _refused_in_one_line(Mixtral.from_model_config, *MIXTRAL_REFUSALS[case])


def test_a_topk_scaling_factor_of_one_is_no_scaling_and_exports():
    """null means a factor of 1 (its declaration's null_means): 1.0 exports like null."""
    model = dataclasses.replace(run_config(**MIXTRAL).model, moe_router_topk_scaling_factor=1.0)
    assert type(architecture_for_model_config(model)) is Mixtral


def test_sinkhorn_is_the_only_routing_balancer_refused():
    assert set(ROUTING_BALANCERS) == {"sinkhorn"}


@pytest.mark.parametrize(
    ("make", "key", "value", "message"),
    [
        (_tiny_hf_qwen2_moe, "qkv_bias", True, r"config.json: qkv_bias=True is not supported"),
        (_tiny_hf_mixtral, "sliding_window", 8, r"config.json: sliding_window=8 is not supported"),
        (_tiny_hf_qwen2_moe, "mlp_only_layers", [0, 1, 2, 3], r"config.json: no layer has experts"),
        (_tiny_hf_mixtral, "num_experts_per_tok", 1, r"config.json: num_experts_per_tok=1 with"),
    ],
    ids=["qwen-qkv-bias", "mixtral-sliding-window", "qwen-all-dense", "mixtral-top1"],
)
def test_unimportable_moe_configs_are_refused(seeded, tmp_path, make, key, value, message):
    source = make(tmp_path / "source")
    import_refuses_edited_config(source, {key: value}, message)


@pytest.mark.long
@pytest.mark.slow
def test_cli_trains_a_moe_run_and_exports_it_for_auto_model(seeded, tmp_path):
    """megatron-lns train (2 steps) -> export-hf -> AutoModelForCausalLM: the trained
    Qwen2-MoE (a dense first layer, a gated shared expert) gives the checkpoint's logits."""
    import subprocess
    import sys

    from helpers import DEMO_CONFIG, TINY_MODEL_OVERRIDES, fresh_launch_env

    from megatron_lns.config.sources import load_run_config

    env = fresh_launch_env(MEGATRON_LNS_CACHE=str(tmp_path / "cache"))
    cli = [sys.executable, "-m", "megatron_lns.cli"]
    moe = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64"]
    moe += ["model.moe_shared_expert_intermediate_size=64", "model.moe_shared_expert_gate=true"]
    moe += ["model.moe_layer_freq=[0,1,1,1]", "model.moe_aux_loss_coeff=0.01"]
    train = [*cli, "train", str(DEMO_CONFIG), *TINY_MODEL_OVERRIDES, *moe]
    train += [f"exp_manager.exp_dir={tmp_path}", "exp_manager.name=moe", "trainer.max_steps=2"]
    train += ["trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    train += ["model.optim.sched.warmup_steps=1"]
    subprocess.run(train, env=env, check=True, capture_output=True, text=True)
    run = tmp_path / "moe"
    export = [*cli, "export-hf", str(run), str(tmp_path / "hf")]
    done = subprocess.run(export, env=env, check=True, capture_output=True, text=True)
    assert "as Qwen2MoeForCausalLM" in done.stdout
    checkpoint = run / "checkpoints" / "iter_0000002"
    assert_parity(checkpoint, load_run_config(checkpoint), tmp_path / "hf")


def test_import_builds_sequential_experts_for_a_grouped_gemm_run(seeded):
    """import-hf fills the local backend's per-expert parameters; a run config asking for
    grouped GEMM (Transformer Engine) still gets them, its checkpoint keys are the same."""
    from megatron_lns.training.build import build_weights_model

    model = build_weights_model(run_config(**MIXTRAL, moe_grouped_gemm=True), VOCAB)
    names = dict(model.named_parameters())
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in names
