"""megatron-lns's mixture-of-experts layers against an independent plain-PyTorch reference
(tests/reference_moe.py): logits, every gradient, the load-balancing and z losses; the
router's input scaled by 1/sqrt(l); the Transformer Engine layout (CPU stand-ins); the
paper's variants on MoE layers; LNS baked into a Pre-LN MoE model.

Everything runs in fp64 on one CPU rank with megatron's allgather dispatcher. Tolerances:
logits rtol=atol=1e-9 and gradients rtol=1e-8/atol=1e-10, as for the dense model
(tests/test_model.py; measured differences are ~1e-15). megatron computes router scores in
fp32 whatever the model dtype, and so does the reference, so those match to fp64 rounding
too. Loss values come from megatron's metrics tracker, which stores them in fp32: compared
at rtol=1e-6 (fp32 has 24 bits, 6e-8). The TE stand-in normalises in fp32 like TE's
kernel, so the TE-layout tests use tests/test_fused_norm.py's fp32 bounds.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import perturb_norm_weights, tiny_config, token_inputs
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from reference_llama import reference_sizes
from reference_moe import ReferenceMoELlama
from te_standin import StandInTESpecProvider

import megatron_lns.model.specs
import megatron_lns.model.te
from megatron_lns.model.language_model import build_model
from megatron_lns.model.layer import LNSTransformerLayer, bake_norm_scaling, baked_state_dict
from megatron_lns.model.norms import local_norm_builder
from megatron_lns.model.specs import local_to_fused_state_dict
from megatron_lns.model.variants import deepnorm_alpha, deepnorm_beta, feed_forward_networks

LOGITS = dict(rtol=1e-9, atol=1e-9)
GRADS = dict(rtol=1e-8, atol=1e-10)
TRACKED_LOSS = dict(rtol=1e-6, atol=0.0)
# The TE stand-in normalises in fp32, as TE's kernel does (tests/test_fused_norm.py's bounds).
STANDIN_LOGITS = dict(rtol=1e-5, atol=1e-5)
STANDIN_GRADS = dict(rtol=1e-4, atol=1e-6)
AUX_LOSS_COEFF, Z_LOSS_COEFF = 0.1, 0.01


def moe_config(
    norm_scaling="lns",
    topk=2,
    score_function="softmax",
    shared="none",
    moe_layer_freq=(0, 1, 1, 1),
    pre_softmax=None,
    topk_scaling_factor=None,
    **overrides,
):
    """A 4-layer, 4-expert model; ``shared`` is "none", "plain" or "gated"."""
    if pre_softmax is None:
        pre_softmax = score_function == "softmax" and topk == 1  # megatron requires it
    freq = list(moe_layer_freq) if isinstance(moe_layer_freq, tuple) else moe_layer_freq
    return tiny_config(
        norm_scaling=norm_scaling,
        num_moe_experts=4,
        moe_router_topk=topk,
        moe_layer_freq=freq,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=None if shared == "none" else 32,
        extra_transformer_config=dict(
            moe_token_dispatcher_type="allgather",
            moe_router_score_function=score_function,
            moe_router_pre_softmax=pre_softmax,
            moe_router_topk_scaling_factor=topk_scaling_factor,
            moe_shared_expert_gate=shared == "gated",
            moe_aux_loss_coeff=AUX_LOSS_COEFF,
            moe_z_loss_coeff=Z_LOSS_COEFF,
        ),
        **overrides,
    )


def reference_for(cfg, mix_ln_post_layers=0):
    extra = cfg.extra_transformer_config
    return ReferenceMoELlama(
        **reference_sizes(cfg),
        lns=cfg.norm_scaling == "lns",
        variant=cfg.layer_variant,
        mix_ln_post_layers=mix_ln_post_layers,
        num_experts=cfg.num_moe_experts,
        moe_layer_freq=cfg.moe_layer_freq,
        topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        shared_expert_size=cfg.moe_shared_expert_intermediate_size,
        shared_expert_gate=extra["moe_shared_expert_gate"],
        score_function=extra["moe_router_score_function"],
        pre_softmax=extra["moe_router_pre_softmax"],
        topk_scaling_factor=extra["moe_router_topk_scaling_factor"],
        aux_loss_coeff=extra["moe_aux_loss_coeff"],
        z_loss_coeff=extra["moe_z_loss_coeff"],
    ).double()


@pytest.fixture()
def aux_loss_scale_one():
    """megatron's aux-loss gradient scale is process-global (the trainer sets it to
    1/micro-batches): 1 here, so its gradient is that of ``loss + aux_loss``."""
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    get_moe_metrics_tracker().clear()
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = saved
    get_moe_metrics_tracker().clear()


def perturb_norms_and_gains(model, seed=1):
    """Norms start at 1, SkipInit gates at 0: move them so every path carries gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name or "_bda." in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tracked_losses(name, num_layers):
    """Per-layer values megatron's router recorded (0 for dense layers), without coefficient."""
    metric = get_moe_metrics_tracker().metrics.get(name)
    return metric.values.clone() if metric is not None else torch.zeros(num_layers)


def assert_matches_reference(model, reference, cfg):
    """Same logits, per-layer losses and gradients of ``cross_entropy + aux losses``."""
    tokens, positions, targets = token_inputs(cfg)
    get_moe_metrics_tracker().clear()
    logits = model(tokens, positions, None)
    expected = reference(tokens)
    torch.testing.assert_close(logits, expected, **LOGITS)

    for name, values in (
        ("load_balancing_loss", reference.load_balancing_losses),
        ("z_loss", reference.z_losses),
    ):
        want = torch.zeros(cfg.num_layers, dtype=torch.float64)
        for layer_number, value in values.items():
            want[layer_number - 1] = value.detach()
        assert (want != 0).sum() == sum(cfg.moe_layer_pattern()), name
        got = tracked_losses(name, cfg.num_layers).double()
        torch.testing.assert_close(got, want, **TRACKED_LOSS, msg=name)

    cross_entropy(logits, targets).backward()
    (cross_entropy(expected, targets) + reference.aux_loss).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference.p[name].grad, **GRADS, msg=name)


# The axes: shared expert (none / plain / with megatron's sigmoid gate) x top-1/2 x
# softmax/sigmoid router, with moe_layer_freq mixed or an int, LNS or Pre-LN, and megatron's
# pre-softmax and top-k scaling factor where they apply.
CASES = [
    # shared, topk, score, freq, norm_scaling, pre_softmax, scaling factor
    ("none", 2, "softmax", (0, 1, 1, 1), "lns", False, None),
    ("plain", 2, "softmax", 1, "lns", False, None),
    ("gated", 2, "softmax", 2, "none", True, 2.5),
    ("none", 1, "softmax", 1, "lns", True, None),
    ("plain", 1, "softmax", (0, 1, 1, 1), "none", True, None),
    ("gated", 1, "softmax", (0, 1, 1, 1), "lns", True, None),
    ("none", 2, "sigmoid", 2, "lns", False, 2.5),
    ("plain", 2, "sigmoid", (0, 1, 1, 1), "lns", False, None),
    ("gated", 2, "sigmoid", 1, "none", False, None),
    ("none", 1, "sigmoid", (0, 1, 1, 1), "lns", False, None),
    ("plain", 1, "sigmoid", 1, "lns", False, None),
    ("gated", 1, "sigmoid", 2, "lns", False, 2.5),
]


def _case_id(case):
    shared, topk, score, freq, scaling, pre, factor = case
    freq_id = "mixed" if isinstance(freq, tuple) else f"every{freq}"
    extra = ("-presoftmax" if pre and topk > 1 else "") + (f"-x{factor}" if factor else "")
    return f"{scaling}-{score}-top{topk}-shared_{shared}-{freq_id}{extra}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_moe_model_matches_independent_reference(seeded, aux_loss_scale_one, case):
    shared, topk, score, freq, norm_scaling, pre_softmax, factor = case
    cfg = moe_config(norm_scaling, topk, score, shared, freq, pre_softmax, factor)
    model = build_model(cfg)[0].double()
    perturb_norm_weights(model)
    reference = reference_for(cfg)
    assert set(dict(model.named_parameters())) == set(reference.p)
    reference.load_megatron_state_dict(model.state_dict())
    assert_matches_reference(model, reference, cfg)


def test_aux_and_z_losses_reach_the_router_gradient(seeded, aux_loss_scale_one):
    """Negative control for the gradient comparisons: the losses' share of the router
    gradient is far above their tolerance, so a dropped loss would fail them."""
    with_losses = build_model(moe_config())[0].double()
    without = moe_config()
    without.extra_transformer_config.update(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    plain = build_model(without)[0].double()
    plain.load_state_dict(with_losses.state_dict())
    tokens, positions, targets = token_inputs(moe_config())
    for model in (with_losses, plain):
        cross_entropy(model(tokens, positions, None), targets).backward()
    router = "decoder.layers.1.mlp.router.weight"
    grad = dict(with_losses.named_parameters())[router].grad
    grad_without = dict(plain.named_parameters())[router].grad
    assert (grad - grad_without).abs().max() > 1e4 * (
        GRADS["atol"] + GRADS["rtol"] * grad.abs().max()
    )


def test_lns_and_pre_ln_differ_on_the_same_moe_weights(seeded, aux_loss_scale_one):
    """Negative control: with LNS off the same weights give other logits and routing."""
    lns = build_model(moe_config(moe_layer_freq=1))[0].double()
    plain = build_model(moe_config("none", moe_layer_freq=1))[0].double()
    plain.load_state_dict(lns.state_dict())
    tokens, positions, _ = token_inputs(moe_config())
    get_moe_metrics_tracker().clear()
    lns_logits = lns(tokens, positions, None)
    lns_z = tracked_losses("z_loss", 4)
    get_moe_metrics_tracker().clear()
    plain_logits = plain(tokens, positions, None)
    plain_z = tracked_losses("z_loss", 4)
    assert not torch.allclose(lns_logits, plain_logits, rtol=1e-3, atol=1e-3)
    # Layer 1's factor is 1: its router sees the same input in both; deeper ones do not.
    torch.testing.assert_close(lns_z[0], plain_z[0])
    assert ((lns_z[1:] - plain_z[1:]).abs() > 1e-3).all()


def test_router_input_is_the_pre_mlp_norm_output_times_one_over_sqrt_l(seeded):
    model = build_model(moe_config(shared="gated", moe_layer_freq=1))[0].double()
    perturb_norm_weights(model)
    seen = {}
    for layer in model.decoder.layers:
        number = layer.layer_number
        layer.pre_mlp_layernorm.register_forward_pre_hook(
            lambda m, args, n=number: seen.__setitem__(("norm_in", n), args[0])
        )
        layer.mlp.router.register_forward_pre_hook(
            lambda m, args, n=number: seen.__setitem__(("router_in", n), args[0])
        )
        layer.mlp.shared_experts.register_forward_pre_hook(
            lambda m, args, n=number: seen.__setitem__(("shared_in", n), args[0])
        )
    tokens, positions, _ = token_inputs(moe_config())
    with torch.no_grad():
        model(tokens, positions, None)
        for layer in model.decoder.layers:
            number, norm = layer.layer_number, layer.pre_mlp_layernorm
            assert norm.output_scale == 1 / math.sqrt(number)
            norm.output_scale = 1.0
            unscaled = norm(seen["norm_in", number])
            norm.output_scale = 1 / math.sqrt(number)
            router_in = seen["router_in", number]
            # The factor is folded into gamma: equal to fp64 rounding (~1e-16), not bitwise.
            torch.testing.assert_close(
                router_in, unscaled / math.sqrt(number), rtol=1e-14, atol=0.0
            )
            assert seen["shared_in", number] is router_in  # experts see what the router sees
    assert [layer.layer_number for layer in model.decoder.layers] == [1, 2, 3, 4]


# -- the Transformer Engine backend on MoE layers (CPU stand-ins) --------------------------


@pytest.fixture()
def te_standins(monkeypatch):
    """megatron's TE layer spec built from CPU stand-ins (tests/te_standin.py): the attention
    norm fused into linear_qkv, the MoE pre-MLP norm whatever megatron-lns puts there (the
    stand-in TENorm fails if built), the final norm local (TE's TENorm needs CUDA)."""
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", StandInTESpecProvider)
    monkeypatch.setattr(megatron_lns.model.te, "require_te", lambda: None)
    monkeypatch.setattr(megatron_lns.model.specs, "te_final_norm_builder", local_norm_builder)


def test_te_backend_moe_layers_match_the_local_backend(seeded, aux_loss_scale_one, te_standins):
    cfg = moe_config(shared="gated")
    local = build_model(cfg)[0].double()
    te = build_model(moe_config(shared="gated", backend="te"))[0].double()
    perturb_norm_weights(local)
    te.load_state_dict(local_to_fused_state_dict(local.state_dict()), strict=True)
    for layer, is_moe in zip(te.decoder.layers, cfg.moe_layer_pattern(), strict=True):
        fused_qkv = layer.self_attention.linear_qkv
        assert layer.pre_norm_owners()[0] is fused_qkv
        assert fused_qkv.output_scale == 1 / math.sqrt(layer.layer_number)
        mlp_owner = layer.pre_norm_owners()[1]
        assert mlp_owner is (layer.pre_mlp_layernorm if is_moe else layer.mlp.linear_fc1)
        assert mlp_owner.output_scale == 1 / math.sqrt(layer.layer_number)
    tokens, positions, targets = token_inputs(cfg)
    te_logits, local_logits = te(tokens, positions, None), local(tokens, positions, None)
    torch.testing.assert_close(te_logits, local_logits, **STANDIN_LOGITS)
    cross_entropy(te_logits, targets).backward()
    cross_entropy(local_logits, targets).backward()
    local_grads = local_to_fused_state_dict({name: p.grad for name, p in local.named_parameters()})
    for name, param in te.named_parameters():
        torch.testing.assert_close(param.grad, local_grads[name], **STANDIN_GRADS, msg=name)


def test_baked_te_moe_model_is_a_pre_ln_model(seeded, te_standins):
    lns = build_model(moe_config(backend="te"))[0].double()
    plain = build_model(moe_config("none", backend="te"))[0].double()
    perturb_norm_weights(lns)
    plain.load_state_dict(baked_state_dict(lns))
    tokens, positions, _ = token_inputs(moe_config())
    with torch.no_grad():
        torch.testing.assert_close(
            plain(tokens, positions, None), lns(tokens, positions, None), **STANDIN_LOGITS
        )


# -- LNS baked into the norm weights --------------------------------------------------------


def test_baked_moe_model_is_a_pre_ln_model_with_the_same_logits(seeded):
    cfg = moe_config(shared="gated")
    lns = build_model(cfg)[0].double()
    plain = build_model(moe_config("none", shared="gated"))[0].double()
    perturb_norm_weights(lns)
    tokens, positions, _ = token_inputs(cfg)
    with torch.no_grad():
        expected = lns(tokens, positions, None)
        baked = baked_state_dict(lns)
        for layer in lns.decoder.layers:
            key = f"decoder.layers.{layer.layer_number - 1}.pre_mlp_layernorm.weight"
            torch.testing.assert_close(
                baked[key],
                lns.state_dict()[key] / math.sqrt(layer.layer_number),
                rtol=1e-15,
                atol=0,
            )
        plain.load_state_dict(baked)
        torch.testing.assert_close(plain(tokens, positions, None), expected, **LOGITS)
        bake_norm_scaling(lns)
        assert all(layer.norm_output_scale == 1.0 for layer in lns.decoder.layers)
        torch.testing.assert_close(lns(tokens, positions, None), expected, **LOGITS)


# -- the paper's variants on MoE layers ------------------------------------------------------

VARIANT_CASES = [
    ("post_ln", "none"),
    ("deepnorm", "none"),
    ("mix_ln", "none"),
    ("layerscale", "lns"),
    ("skipinit", "lns"),
    ("pre_ln", "lns"),
]


@pytest.mark.parametrize(("variant", "norm_scaling"), VARIANT_CASES)
def test_variants_on_moe_layers_match_independent_reference(
    seeded, aux_loss_scale_one, variant, norm_scaling
):
    """Layers 1-2 Post-LN under Mix-LN (fraction 0.5): a dense and an MoE one."""
    cfg = moe_config(
        norm_scaling,
        shared="gated",
        layer_variant=variant,
        variant_options={"mix_ln_post_fraction": 0.5},
        output_layer_init="depth_scaled" if variant == "pre_ln" else None,
    )
    model = build_model(cfg)[0].double()
    perturb_norms_and_gains(model)
    reference = reference_for(cfg, mix_ln_post_layers=2)
    assert set(dict(model.named_parameters())) == set(reference.p)
    reference.load_megatron_state_dict(model.state_dict())
    assert_matches_reference(model, reference, cfg)


def _moe_ffns(layer):
    names = [f"experts.local_experts.{e}" for e in range(4)] + ["shared_experts"]
    return [layer.mlp.get_submodule(name) for name in names]


def test_deepnorm_scales_every_expert_and_the_shared_expert_by_beta(seeded):
    state = torch.random.get_rng_state()
    post = build_model(moe_config("none", shared="gated", layer_variant="post_ln"))[0]
    torch.random.set_rng_state(state)
    deep = build_model(moe_config("none", shared="gated", layer_variant="deepnorm"))[0]
    beta = deepnorm_beta(4)
    for post_layer, deep_layer in zip(
        post.decoder.layers[1:], deep.decoder.layers[1:], strict=True
    ):
        assert deep_layer.mlp_bda.residual_scale == pytest.approx(deepnorm_alpha(4))
        for post_ffn, deep_ffn in zip(_moe_ffns(post_layer), _moe_ffns(deep_layer), strict=True):
            for name in ("linear_fc1", "linear_fc2"):
                torch.testing.assert_close(
                    deep_ffn.get_submodule(name).weight, post_ffn.get_submodule(name).weight * beta
                )
        # The router and the shared expert's gate mix the FFNs, as queries and keys mix
        # values: gain 1.
        for name in ("router.weight", "shared_experts.gate_weight"):
            torch.testing.assert_close(
                deep_layer.mlp.get_parameter(name),
                post_layer.mlp.get_parameter(name),
                rtol=0,
                atol=0,
            )


def test_deepnorm_refuses_experts_it_cannot_scale():
    """TE's grouped GEMM experts are no megatron MLP (variants are TE-refused before this)."""
    with pytest.raises(ValueError, match=r"layer_variant='deepnorm'.*Linear has no megatron MLP"):
        feed_forward_networks(torch.nn.Linear(2, 2))


def test_depth_scaled_init_divides_every_experts_fc2_by_sqrt_2l(seeded):
    state = torch.random.get_rng_state()
    normal = build_model(moe_config(shared="plain", output_layer_init="normal"))[0]
    torch.random.set_rng_state(state)
    depth = build_model(moe_config(shared="plain", output_layer_init="depth_scaled"))[0]
    for normal_layer, depth_layer in zip(
        normal.decoder.layers[1:], depth.decoder.layers[1:], strict=True
    ):
        factor = 1 / math.sqrt(2 * depth_layer.layer_number)
        for normal_ffn, depth_ffn in zip(
            _moe_ffns(normal_layer), _moe_ffns(depth_layer), strict=True
        ):
            torch.testing.assert_close(
                depth_ffn.linear_fc2.weight, normal_ffn.linear_fc2.weight * factor
            )
            torch.testing.assert_close(
                depth_ffn.linear_fc1.weight, normal_ffn.linear_fc1.weight, rtol=0, atol=0
            )
        torch.testing.assert_close(
            depth_layer.mlp.router.weight, normal_layer.mlp.router.weight, rtol=0, atol=0
        )


def test_every_moe_layer_is_an_lns_layer_with_its_global_factor(seeded):
    model = build_model(moe_config(moe_layer_freq=2, num_layers=6))[0]
    kinds = ["moe" if hasattr(layer.mlp, "router") else "dense" for layer in model.decoder.layers]
    assert kinds == ["moe", "dense"] * 3
    for layer in model.decoder.layers:
        assert isinstance(layer, LNSTransformerLayer)
        assert layer.pre_mlp_layernorm.output_scale == 1 / math.sqrt(layer.layer_number)
