"""The LNS paper's baseline variants: each against an independent plain-PyTorch reference,
their init rules, their refusals, and (slow, real ranks) TP=2 / SP / PP=2 equivalence with
checkpoints saved at one layout and loaded at another."""

import math

import pytest
import torch
from helpers import (
    fixed_microbatches,
    forward_backward_at,
    logged_losses,
    run_distributed,
    tiny_config,
)
from reference_llama import ReferenceLlama, reference_sizes

from megatron_lns.model.language_model import build_model
from megatron_lns.model.specs import get_lns_layer_spec
from megatron_lns.model.variants import (
    VariantSettings,
    deepnorm_alpha,
    deepnorm_beta,
    num_post_norm_layers,
)
from megatron_lns.runtime import ParallelLayout

# (layer_variant, norm_scaling): every variant, LNS on the pre-norm ones it combines with.
CASES = [
    ("pre_ln", "lns"),
    ("post_ln", "none"),
    ("deepnorm", "none"),
    ("mix_ln", "none"),
    ("layerscale", "none"),
    ("layerscale", "lns"),
    ("skipinit", "none"),
    ("skipinit", "lns"),
    ("peri_ln", "none"),
    ("gpas", "none"),
    ("gpas", "lns"),
]


def _perturb_norms_and_gains(model: torch.nn.Module, seed: int = 1) -> None:
    """Norms start at 1, SkipInit gates and GPAS's alpha at 0: move them so every path
    carries gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or "_bda." in name or ".gpas." in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))


@pytest.mark.parametrize(("variant", "norm_scaling"), CASES)
def test_logits_and_gradients_match_independent_reference(seeded, variant, norm_scaling):
    cfg = tiny_config(
        num_layers=6,
        layer_variant=variant,
        norm_scaling=norm_scaling,
        variant_options={"mix_ln_post_fraction": 0.5},
    )
    model = build_model(cfg)[0].double()
    _perturb_norms_and_gains(model)
    reference = ReferenceLlama(
        **reference_sizes(cfg),
        lns=norm_scaling == "lns",
        variant=variant,
        mix_ln_post_layers=3,
    ).double()
    reference.load_megatron_state_dict(model.state_dict())
    assert set(dict(model.named_parameters())) == set(reference.p)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
    positions = torch.arange(cfg.seq_length).unsqueeze(0).expand(2, -1)
    logits = model(tokens, positions, None)
    expected = reference(tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)

    targets = torch.randint(0, cfg.vocab_size, tokens.shape, generator=gen)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    torch.nn.functional.cross_entropy(expected.flatten(0, 1), targets.flatten()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad, reference.p[name].grad, rtol=1e-8, atol=1e-10, msg=name
        )


def test_new_parameters_start_as_the_papers_define_them(seeded):
    layerscale = build_model(
        tiny_config(layer_variant="layerscale", variant_options={"layerscale_init": 1e-4})
    )[0]
    skipinit = build_model(tiny_config(layer_variant="skipinit", norm_scaling="none"))[0]
    for layer in layerscale.decoder.layers:
        for bda in (layer.self_attn_bda, layer.mlp_bda):
            assert torch.equal(bda.layerscale, torch.full((64,), 1e-4))
    for layer in skipinit.decoder.layers:
        for bda in (layer.self_attn_bda, layer.mlp_bda):
            assert torch.equal(bda.gate, torch.zeros(1))
    # A SkipInit model starts as the identity on the residual stream: the output is the
    # final norm of the embeddings, whatever the blocks' weights.
    tokens = torch.randint(0, 128, (1, 16))
    positions = torch.arange(16).unsqueeze(0)
    hidden = skipinit.decoder(skipinit.embedding(tokens, positions), None)
    embedded = skipinit.embedding(tokens, positions)
    torch.testing.assert_close(hidden, skipinit.decoder.final_layernorm(embedded))


def test_gpas_scales_the_value_and_preserves_the_gradient_in_closed_form(seeded):
    """x = x' - SiLU(a) sg(x'): value (1 - SiLU(a)) x', dL/dx' = dL/dx, and
    dL/da = -SiLU'(a) <x', dL/dx> with SiLU'(a) = s(a) (1 + a (1 - s(a))), s the sigmoid."""
    gate = (
        build_model(tiny_config(layer_variant="gpas", norm_scaling="none"))[0]
        .decoder.layers[0]
        .gpas
    )
    a = 0.7
    with torch.no_grad():
        gate.alpha.fill_(a)
    gen = torch.Generator().manual_seed(3)
    stream = torch.randn(5, 2, 64, generator=gen, requires_grad=True)
    upstream = torch.randn(5, 2, 64, generator=gen)
    out = gate(stream)
    sigmoid = 1.0 / (1.0 + math.exp(-a))
    silu, silu_grad = a * sigmoid, sigmoid * (1.0 + a * (1.0 - sigmoid))
    torch.testing.assert_close(out, (1.0 - silu) * stream)
    (out * upstream).sum().backward()
    torch.testing.assert_close(stream.grad, upstream)
    expected = -silu_grad * (stream.detach() * upstream).sum()
    torch.testing.assert_close(gate.alpha.grad, expected.reshape(1))


def test_gpas_and_peri_ln_parameters_start_as_the_papers_define_them(seeded):
    """GPAS: one alpha per layer at 0, so the model starts as Pre-LN; Peri-LN: an output
    norm per sublayer at gain 1, the pre-norms kept."""
    tokens = torch.randint(0, 128, (1, 16))
    positions = torch.arange(16).unsqueeze(0)
    torch.manual_seed(5)
    gpas = build_model(tiny_config(layer_variant="gpas", norm_scaling="lns"))[0]
    torch.manual_seed(5)
    pre_ln = build_model(tiny_config(layer_variant="pre_ln", norm_scaling="lns"))[0]
    for layer in gpas.decoder.layers:
        assert [name for name, _ in layer.named_parameters() if "gpas" in name] == ["gpas.alpha"]
        assert torch.equal(layer.gpas.alpha, torch.zeros(1))
    torch.testing.assert_close(
        gpas(tokens, positions, None), pre_ln(tokens, positions, None), rtol=0, atol=0
    )
    peri = build_model(tiny_config(layer_variant="peri_ln", norm_scaling="none"))[0]
    for layer in peri.decoder.layers:
        names = {name for name, _ in layer.named_parameters()}
        assert {"input_layernorm.weight", "pre_mlp_layernorm.weight"} <= names
        for bda in (layer.self_attn_bda, layer.mlp_bda):
            assert torch.equal(bda.output_norm.weight, torch.ones(64))


def test_lns_on_peri_ln_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"layer_variant='peri_ln' normalises every branch's"):
        tiny_config(layer_variant="peri_ln", norm_scaling="lns").variant_settings()


def test_every_registered_variant_has_a_module_that_builds_it():
    from megatron_lns.config.layer_variants import REGISTRY
    from megatron_lns.model.variants.settings import variant_module

    for name in REGISTRY:
        assert callable(variant_module(name).build), name


def test_compare_has_an_arm_for_each_variant_and_each_lns_combination():
    """``compare``'s arms come from the registry: every variant by its name, and
    ``lns_<name>`` only where LNS combines with it."""
    from megatron_lns.analysis.comparison import CompareError, parse_variants

    arms = {v.name: (v.label, v.model_settings) for v in parse_variants(["peri_ln", "lns_gpas"])}
    assert arms == {
        "peri_ln": ("Peri-LN", {"norm_scaling": "none", "layer_variant": "peri_ln"}),
        "lns_gpas": ("LNS + GPAS", {"norm_scaling": "lns", "layer_variant": "gpas"}),
    }
    with pytest.raises(CompareError, match="unknown variant 'lns_peri_ln'"):
        parse_variants(["lns_peri_ln"])


@pytest.mark.parametrize("head_dim", [16, 24], ids=["hidden_over_heads", "kv_channels"])
def test_deepnorm_scales_value_output_and_ffn_init_by_beta_and_residual_by_alpha(seeded, head_dim):
    kv_channels = None if head_dim == 16 else head_dim
    state = torch.random.get_rng_state()
    post = build_model(
        tiny_config(layer_variant="post_ln", norm_scaling="none", kv_channels=kv_channels)
    )[0]
    torch.random.set_rng_state(state)
    deep = build_model(
        tiny_config(layer_variant="deepnorm", norm_scaling="none", kv_channels=kv_channels)
    )[0]
    beta = deepnorm_beta(4)
    assert beta == pytest.approx(32**-0.25)
    assert deepnorm_alpha(4) == pytest.approx(8**0.25)
    for post_layer, deep_layer in zip(post.decoder.layers, deep.decoder.layers, strict=True):
        assert deep_layer.self_attn_bda.residual_scale == pytest.approx(8**0.25)
        # linear_qkv rows per query group: [q, q | k | v] x head_dim (4 heads, 2 groups).
        p_qkv = post_layer.self_attention.linear_qkv.weight.view(2, 4, head_dim, 64)
        d_qkv = deep_layer.self_attention.linear_qkv.weight.view(2, 4, head_dim, 64)
        torch.testing.assert_close(d_qkv[:, :3], p_qkv[:, :3], rtol=0, atol=0)
        torch.testing.assert_close(d_qkv[:, 3], p_qkv[:, 3] * beta)
        for name in ("self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            deep_weight = deep_layer.get_submodule(name).weight
            post_weight = post_layer.get_submodule(name).weight
            torch.testing.assert_close(deep_weight, post_weight * beta, msg=name)


def test_depth_scaled_init_divides_layer_l_output_projections_by_sqrt_2l(seeded):
    state = torch.random.get_rng_state()
    normal = build_model(tiny_config(output_layer_init="normal"))[0]
    torch.random.set_rng_state(state)
    depth = build_model(tiny_config(output_layer_init="depth_scaled"))[0]
    for normal_layer, depth_layer in zip(normal.decoder.layers, depth.decoder.layers, strict=True):
        factor = 1 / math.sqrt(2 * depth_layer.layer_number)
        for name in ("self_attention.linear_proj", "mlp.linear_fc2"):
            torch.testing.assert_close(
                depth_layer.get_submodule(name).weight,
                normal_layer.get_submodule(name).weight * factor,
                msg=name,
            )
        torch.testing.assert_close(
            depth_layer.mlp.linear_fc1.weight, normal_layer.mlp.linear_fc1.weight, rtol=0, atol=0
        )


def test_mix_ln_puts_post_ln_in_the_first_fraction_of_layers(seeded):
    assert [num_post_norm_layers(8, f) for f in (0.0, 0.25, 0.3, 1.0)] == [0, 2, 2, 8]
    model = build_model(tiny_config(num_layers=8, layer_variant="mix_ln", norm_scaling="none"))[0]
    assert [layer.post_norm for layer in model.decoder.layers] == [True] * 2 + [False] * 6


@pytest.mark.parametrize("variant", ["post_ln", "deepnorm", "mix_ln"])
def test_lns_on_a_post_norm_variant_is_refused_by_name(variant):
    with pytest.raises(ValueError, match=f"layer_variant='{variant}'.*post-norm"):
        tiny_config(layer_variant=variant, norm_scaling="lns").variant_settings()


@pytest.mark.parametrize("variant", ["layerscale", "peri_ln", "gpas"])
def test_te_backend_refuses_variants_by_name(variant):
    with pytest.raises(ValueError, match=rf"layer_variant=.{variant}.*backend=.local. only"):
        get_lns_layer_spec("none", "te", variant=VariantSettings(layer_variant=variant))


def test_bad_variant_settings_are_refused():
    for settings, message in (
        (VariantSettings(layer_variant="sandwich"), "layer_variant must be one of"),
        (
            VariantSettings(layer_variant="mix_ln", options={"mix_ln_post_fraction": 1.5}),
            "mix_ln_post",
        ),
        (
            VariantSettings(layer_variant="layerscale", options={"layerscale_init": 0.0}),
            "layerscale_init",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            settings.check("none")


# --- multi-process: the same weights at TP=2 (+SP) and PP=2 give the same loss and gradients.

PARALLEL_CASES = [
    ("post_ln", "none"),
    ("deepnorm", "none"),
    ("mix_ln", "none"),
    ("layerscale", "lns"),
    ("skipinit", "none"),
    ("peri_ln", "none"),
    ("gpas", "lns"),
]


def _is_variant_parameter(name: str) -> bool:
    """A layer's parameter that a variant adds (gains, moved or output norms, GPAS's alpha)."""
    return "_bda." in name or name.endswith("gpas.alpha")


def _extra_parameters(model) -> dict[str, torch.Tensor]:
    """The variant's own parameters (post-norms, gains, ...) by global layer number."""
    found = {}
    for chunk in model:
        for layer in chunk.module.decoder.layers:
            for name, param in layer.named_parameters():
                if _is_variant_parameter(name):
                    found[f"{layer.layer_number}.{name}"] = param.detach().clone()
    return found


def parallel_variants_worker(tmp: str):
    from test_model_parallel import _full_grads, _grads_by_global_name

    from megatron_lns.training.checkpoint import save_model_weights

    out = {}
    for variant, norm_scaling in PARALLEL_CASES:
        cfg = tiny_config(
            layer_variant=variant,
            norm_scaling=norm_scaling,
            variant_options={"mix_ln_post_fraction": 0.5},
        )
        batches = fixed_microbatches(cfg.vocab_size, cfg.seq_length, num_microbatches=2)
        base_ckpt, tp2_ckpt = f"{tmp}/{variant}_tp1", f"{tmp}/{variant}_tp2"
        model, base_loss = forward_backward_at(cfg, ParallelLayout(), batches)
        # Move the gains off their init so the checkpoint carries values a fresh model lacks.
        with torch.no_grad():
            for name, param in model[0].module.named_parameters():
                if _is_variant_parameter(name):
                    param.add_(0.25)
        saved = _extra_parameters(model)
        save_model_weights(model, base_ckpt)
        model, base_loss = forward_backward_at(cfg, ParallelLayout(), batches, base_ckpt)
        results = {"saved": saved, "loaded": {"tp1": _extra_parameters(model)}}
        results["tp1"] = (base_loss, _full_grads(model, gated=True))
        results["pp1"] = (base_loss, _grads_by_global_name(model))
        for name, layout in {
            "tp2": ParallelLayout(tensor=2),
            "tp2_sp": ParallelLayout(tensor=2, sequence_parallel=True),
        }.items():
            model, loss = forward_backward_at(cfg, layout, batches, base_ckpt)
            results[name] = (loss, _full_grads(model, gated=True))
            results["loaded"][name] = _extra_parameters(model)
        save_model_weights(model, tp2_ckpt)
        _, results["tp2_ckpt_at_tp1"] = forward_backward_at(
            cfg, ParallelLayout(), batches, tp2_ckpt
        )
        for name, layout in {
            "pp2": ParallelLayout(pipeline=2),
            "pp2_vp2": ParallelLayout(pipeline=2, virtual_pipeline=2),
        }.items():
            model, loss = forward_backward_at(cfg, layout, batches, base_ckpt)
            results[name] = (loss, _grads_by_global_name(model))
            results["loaded"][name] = _extra_parameters(model)
            results[name + "_post_norm"] = {
                layer.layer_number: layer.post_norm
                for chunk in model
                for layer in chunk.module.decoder.layers
            }
        out[variant] = results
    return out


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("variants")
    return run_distributed(parallel_variants_worker, 2, tmp, str(tmp))


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("variant", [case[0] for case in PARALLEL_CASES])
def test_tensor_and_sequence_parallel_match_tp1(parallel_results, variant):
    base_loss, base_grads = parallel_results[0][variant]["tp1"]
    for rank_result in parallel_results:
        results = rank_result[variant]
        assert results["tp2_ckpt_at_tp1"] == pytest.approx(base_loss, rel=1e-6)
        for layout in ("tp2", "tp2_sp"):
            loss, grads = results[layout]
            assert loss == pytest.approx(base_loss, rel=1e-5), layout
            assert grads.keys() == base_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad, base_grads[name], rtol=1e-4, atol=1e-6, msg=f"{layout} {name}"
                )


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "pp2_vp2"])
@pytest.mark.parametrize("variant", [case[0] for case in PARALLEL_CASES])
def test_pipeline_parallel_matches_pp1(parallel_results, variant, layout):
    base_loss, base_grads = parallel_results[0][variant]["pp1"]
    merged, post_norm = {}, {}
    for rank_result in parallel_results:
        loss, grads = rank_result[variant][layout]
        assert loss == pytest.approx(base_loss, rel=1e-5)
        merged.update(grads)
        post_norm.update(rank_result[variant][layout + "_post_norm"])
    assert merged.keys() == base_grads.keys()
    for name, grad in merged.items():
        torch.testing.assert_close(grad, base_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # Mix-LN (fraction 0.5 of 4 layers) decides by the global layer number on every stage.
    post_layers = {"post_ln": 4, "deepnorm": 4, "mix_ln": 2}.get(variant, 0)
    assert post_norm == {number: number <= post_layers for number in range(1, 5)}


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("variant", [case[0] for case in PARALLEL_CASES])
def test_variant_parameters_reload_at_every_layout(parallel_results, variant):
    """The gains and moved norms were changed before saving: a load that skipped them
    would leave their init values (gate 0, LayerScale 1e-3, norm 1)."""
    saved = parallel_results[0][variant]["saved"]
    assert saved
    for layout in ("tp1", "tp2", "tp2_sp", "pp2", "pp2_vp2"):
        merged = {}
        for rank_result in parallel_results:
            merged.update(rank_result[variant]["loaded"][layout])
        assert merged.keys() == saved.keys(), layout
        for name, value in merged.items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=f"{layout} {name}")


# --- through the trainer: a checkpoint of each variant resumes bitwise.

RESUME_CASES = [
    ("post_ln", "none", "normal"),
    ("deepnorm", "none", "normal"),
    ("mix_ln", "none", "normal"),
    ("layerscale", "lns", "normal"),
    ("skipinit", "none", "normal"),
    ("pre_ln", "none", "depth_scaled"),
    ("peri_ln", "none", "normal"),
    ("gpas", "lns", "normal"),
]


def _straight_and_resumed(tmp: str) -> dict:
    from pathlib import Path

    from helpers import tiny_run_config

    from megatron_lns.training.trainer import Trainer

    curves = {}
    for variant, norm_scaling, init in RESUME_CASES:
        keys = [f"model.layer_variant={variant}", f"model.norm_scaling={norm_scaling}",
                f"model.output_layer_init={init}", "model.mix_ln_post_fraction=0.5"]  # fmt: skip
        straight, resumed = Path(tmp) / variant / "straight", Path(tmp) / variant / "resumed"
        Trainer(tiny_run_config(straight, *keys)).fit()
        first = Trainer(tiny_run_config(resumed, *keys, "trainer.exit_interval=3")).fit()
        second = Trainer(tiny_run_config(resumed, *keys)).fit()
        curves[variant] = {
            "resumed_from": second.resumed_from,
            "stopped_at": first.steps,
            "straight": logged_losses(straight / "lns"),
            "resumed": logged_losses(resumed / "lns"),
        }
    return curves


@pytest.mark.long
@pytest.mark.slow
def test_each_variant_resumes_bitwise_through_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_LNS_CACHE", str(tmp_path / "corpus_cache"))
    curves = run_distributed(_straight_and_resumed, 1, tmp_path, str(tmp_path))[0]
    for variant, run in curves.items():
        assert (run["stopped_at"], run["resumed_from"]) == (3, 3), variant
        assert [step for step, _ in run["straight"]] == list(range(1, 7)), variant
        assert run["resumed"] == run["straight"], variant
