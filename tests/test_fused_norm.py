"""LNS folded into a fused norm + linear (the Transformer Engine path), on CPU.

Uses a faithful stand-in for TE's LayerNormLinear (tests/te_standin.py); the real TE
checks are the GPU-marked tests in tests/gpu/.
"""

import math
from functools import partial

import pytest
import torch
from helpers import checkpoint_keys, perturb_norm_weights, tiny_config
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from te_standin import StandInLayerNormColumnParallelLinear as StandIn

from megatron_lns.model.fused_norm import (
    FusedNormScaling,
    folded_norm_parameters,
    fused_norm_layer_spec,
    with_norm_scaling,
)
from megatron_lns.model.language_model import build_model
from megatron_lns.model.layer import bake_norm_scaling
from megatron_lns.model.norms import local_norm_builder
from megatron_lns.model.scaling import lns_factor
from megatron_lns.model.specs import local_to_fused_state_dict
from megatron_lns.runtime import ParallelLayout


def _fused_spec(norm_scaling="lns", norm_affine=True):
    submodules = get_gpt_layer_local_submodules()
    submodules.input_layernorm = IdentityOp
    submodules.pre_mlp_layernorm = IdentityOp
    submodules.self_attention.submodules.linear_qkv = StandIn
    linear_fc2 = submodules.mlp.keywords["submodules"].linear_fc2
    submodules.mlp = partial(
        MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=StandIn, linear_fc2=linear_fc2)
    )
    submodules.sharded_state_dict_keys_map = {}
    return fused_norm_layer_spec(submodules, norm_scaling, norm_affine)


def _fused_model(cfg, layout=ParallelLayout()):
    tf = cfg.transformer_config(layout)
    block = TransformerBlockSubmodules(
        layer_specs=[_fused_spec(cfg.norm_scaling, cfg.norm_affine)] * cfg.num_layers,
        layer_norm=local_norm_builder(cfg.norm_affine),
    )
    return GPTModel(
        config=tf,
        transformer_layer_spec=block,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        position_embedding_type="rope",
    )


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_fused_module_folding_matches_explicit_multiply(seeded, normalization, zero_centered):
    cfg = tiny_config(normalization=normalization, layernorm_zero_centered_gamma=zero_centered)
    tf = cfg.transformer_config()
    init = torch.nn.init.normal_
    plain = StandIn(
        64, 48, config=tf, init_method=init, gather_output=False, bias=False, skip_bias_add=False
    )
    scaled = with_norm_scaling(StandIn)(
        64, 48, config=tf, init_method=init, gather_output=False, bias=False, skip_bias_add=False
    )
    perturb_norm_weights(plain)
    scaled.load_state_dict(plain.state_dict())
    scaled.output_scale = 1 / math.sqrt(7)
    x = torch.randn(5, 2, 64, requires_grad=True)

    # Reference: explicit multiply after the norm, then the same GEMM.
    w = plain.layer_norm_weight
    gamma = w + 1 if zero_centered else w
    if normalization == "RMSNorm":
        normed = torch.nn.functional.rms_norm(x, (64,), gamma, tf.layernorm_epsilon)
    else:
        normed = torch.nn.functional.layer_norm(
            x, (64,), gamma, plain.layer_norm_bias, tf.layernorm_epsilon
        )
    expected, _ = ColumnParallelLinear.forward(plain, normed * scaled.output_scale)
    out, _ = scaled(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)

    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *scaled.parameters()], grad)
    want = torch.autograd.grad(expected, [x, *plain.parameters()], grad)
    for g, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-6)

    # The real parameters are untouched, still registered, still marked for SP.
    assert set(scaled.state_dict()) == set(plain.state_dict())
    assert isinstance(scaled.layer_norm_weight, torch.nn.Parameter)
    assert "layer_norm_weight" not in scaled.__dict__
    assert hasattr(scaled.layer_norm_weight, "sequence_parallel")


def test_shadow_is_removed_even_when_forward_fails(seeded):
    module = with_norm_scaling(StandIn)(
        64,
        48,
        config=tiny_config().transformer_config(),
        init_method=torch.nn.init.normal_,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
    )
    module.output_scale = 0.5
    with pytest.raises(RuntimeError):
        module(torch.randn(3, 2, 7))  # wrong hidden size
    assert "layer_norm_weight" not in module.__dict__
    with folded_norm_parameters(module, 0.5):
        torch.testing.assert_close(
            module.layer_norm_weight, module._parameters["layer_norm_weight"] * 0.5
        )
    assert module.layer_norm_weight is module._parameters["layer_norm_weight"]


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_fused_lns_model_equals_local_lns_model(seeded, normalization):
    cfg = tiny_config(num_layers=5, normalization=normalization)
    local = build_model(cfg)[0]
    perturb_norm_weights(local)
    fused = _fused_model(cfg)
    fused.load_state_dict(local_to_fused_state_dict(local.state_dict()))
    for layer in fused.decoder.layers:
        assert isinstance(layer.self_attention.linear_qkv, FusedNormScaling)
        assert layer.self_attention.linear_qkv.output_scale == 1 / math.sqrt(layer.layer_number)
        assert layer.mlp.linear_fc1.output_scale == 1 / math.sqrt(layer.layer_number)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    positions = torch.arange(cfg.seq_length).expand(2, -1)
    out_local, out_fused = local(tokens, positions, None), fused(tokens, positions, None)
    torch.testing.assert_close(out_fused, out_local, rtol=1e-5, atol=1e-5)
    out_local.square().mean().backward()
    out_fused.square().mean().backward()
    fused_grads = dict(fused.named_parameters())
    for name, param in local_to_fused_state_dict(dict(local.named_parameters())).items():
        torch.testing.assert_close(
            fused_grads[name].grad, param.grad, rtol=1e-4, atol=1e-6, msg=name
        )


def test_fused_and_local_checkpoint_keys_map_onto_each_other(seeded):
    cfg = tiny_config()
    assert checkpoint_keys(_fused_model(cfg)) == checkpoint_keys(build_model(cfg)[0])


def test_inference_norm_weight_getters_refuse_unbaked_lns_and_follow_the_parameter(seeded):
    """megatron keeps what these getters return (inference fused-communication path), so a
    folded copy would go stale when a checkpoint is loaded later: refused until baked."""
    fused = _fused_model(tiny_config(num_layers=4))
    perturb_norm_weights(fused)
    layer = fused.decoder.layers[3]
    with pytest.raises(ValueError, match=r"layer 4 .*baked_state_dict\(lns_model\)"):
        layer.get_qkv_layer_norm_weights()
    with pytest.raises(ValueError, match=r"inference_fuse_tp_communication"):
        layer.get_mlp_layer_norm_weights()

    bake_norm_scaling(fused)
    kept_qkv, kept_mlp = layer.get_qkv_layer_norm_weights(), layer.get_mlp_layer_norm_weights()
    new_state = {k: v + 1 if "layer_norm" in k else v for k, v in fused.state_dict().items()}
    fused.load_state_dict(new_state)  # e.g. a checkpoint loaded after construction
    torch.testing.assert_close(kept_qkv, layer.self_attention.linear_qkv.layer_norm_weight.data)
    torch.testing.assert_close(kept_mlp, layer.mlp.linear_fc1.layer_norm_weight.data)

    local_layer = build_model(tiny_config())[0].decoder.layers[0]
    with pytest.raises(AttributeError, match="no fused norm"):
        local_layer.get_qkv_layer_norm_weights()


@pytest.mark.parametrize("fused", [False, True])
def test_baking_makes_an_equivalent_plain_pre_ln_model(seeded, fused):
    cfg = tiny_config(num_layers=4, normalization="LayerNorm")
    model = _fused_model(cfg) if fused else build_model(cfg)[0]
    perturb_norm_weights(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    positions = torch.arange(cfg.seq_length).expand(2, -1)
    before = model(tokens, positions, None)
    bake_norm_scaling(model)
    assert all(layer.norm_output_scale == 1.0 for layer in model.decoder.layers)
    torch.testing.assert_close(model(tokens, positions, None), before, rtol=1e-5, atol=1e-5)


def test_non_affine_fused_norm_is_constant_and_out_of_checkpoints(seeded):
    cfg = tiny_config(normalization="LayerNorm", norm_affine=False)
    fused = _fused_model(cfg)
    local = build_model(cfg)[0]
    assert checkpoint_keys(fused) == checkpoint_keys(local)
    assert not any("layer_norm" in k for k in fused.state_dict())
    assert all("layer_norm" not in n for n, p in fused.named_parameters() if p.requires_grad)
    fused.load_state_dict(local.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    positions = torch.arange(cfg.seq_length).expand(2, -1)
    torch.testing.assert_close(
        fused(tokens, positions, None), local(tokens, positions, None), rtol=1e-5, atol=1e-5
    )


def test_op_fuser_mlp_is_refused():
    class TEFusedMLP:
        @classmethod
        def as_mlp_submodule(cls, **kwargs):
            raise AssertionError

    submodules = get_gpt_layer_local_submodules()
    submodules.input_layernorm = IdentityOp
    submodules.pre_mlp_layernorm = IdentityOp
    submodules.self_attention.submodules.linear_qkv = StandIn
    submodules.mlp = partial(
        TEFusedMLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=StandIn, linear_fc2=RowParallelLinear),
    )
    with pytest.raises(ValueError, match="op fuser"):
        fused_norm_layer_spec(submodules, "lns")


@pytest.mark.parametrize("fused", [False, True])
def test_baked_state_dict_loads_into_a_plain_pre_ln_model(seeded, fused):
    from megatron_lns.model.layer import baked_state_dict

    cfg = tiny_config(num_layers=4, normalization="LayerNorm", layernorm_zero_centered_gamma=True)
    plain_cfg = tiny_config(
        num_layers=4,
        normalization="LayerNorm",
        layernorm_zero_centered_gamma=True,
        norm_scaling="none",
    )
    lns = _fused_model(cfg) if fused else build_model(cfg)[0]
    perturb_norm_weights(lns)
    raw = {k: v.clone() for k, v in lns.state_dict().items() if isinstance(v, torch.Tensor)}
    plain = _fused_model(plain_cfg) if fused else build_model(plain_cfg)[0]
    plain.load_state_dict(baked_state_dict(lns))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    positions = torch.arange(cfg.seq_length).expand(2, -1)
    torch.testing.assert_close(
        plain(tokens, positions, None), lns(tokens, positions, None), rtol=1e-5, atol=1e-5
    )
    assert all(torch.equal(raw[k], lns.state_dict()[k]) for k in raw)  # model untouched


def test_parameter_free_norms_cannot_be_baked(seeded):
    from megatron_lns.model.layer import baked_state_dict

    with pytest.raises(ValueError, match="parameter-free norm"):
        baked_state_dict(build_model(tiny_config(norm_affine=False))[0])


@pytest.mark.parametrize("fused", [False, True])
def test_both_norm_owners_implement_the_scaled_norm_interface(seeded, fused):
    from megatron_lns.model.scaling import ScaledNorm

    cfg = tiny_config(normalization="LayerNorm", layernorm_zero_centered_gamma=True)
    model = _fused_model(cfg) if fused else build_model(cfg)[0]
    for layer in model.decoder.layers:
        for owner in layer.pre_norm_owners():
            assert isinstance(owner, ScaledNorm)
            assert owner.affine and owner.zero_centered_gamma
            gamma, beta = (getattr(owner, name) for name in owner.norm_parameter_names)
            assert isinstance(gamma, torch.nn.Parameter) and isinstance(beta, torch.nn.Parameter)


def _sign_pattern(hidden, dtype):
    """+-1 alternating: x_hat is +-1 for RMSNorm and LayerNorm, so the output is +-gamma."""
    return torch.tensor([1.0, -1.0] * (hidden // 2), dtype=dtype).view(1, 1, hidden)


@pytest.mark.parametrize("layer", [64, 100])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_deep_layer_bf16_effective_scale_is_as_precise_as_plain_gamma(seeded, zero_centered, layer):
    """Deep layers in bf16: the scale the kernel applies is s*(1+g) to bf16 rounding (2^-8).

    TE casts the weight to bf16 before adding 1, so a folded zero-centred weight
    s*g + (s-1) ~ -0.875 would carry an absolute error of up to 2^-9, i.e. 1.6% of s.
    """
    hidden, scale = 64, lns_factor(layer)
    cfg = tiny_config(
        hidden_size=hidden,
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=zero_centered,
        precision="bf16",
    )
    tf = cfg.transformer_config()
    module = with_norm_scaling(StandIn)(
        hidden,
        hidden,
        config=tf,
        init_method=torch.nn.init.zeros_,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
    )
    g = 0.02 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        module.weight.copy_(torch.eye(hidden))  # the GEMM passes the norm output through
        module.layer_norm_weight.copy_(g if zero_centered else 1 + g)
    module.output_scale = scale
    x = _sign_pattern(hidden, torch.bfloat16)
    out, _ = module(x)
    effective = out.double() * x.double()
    stored = module.layer_norm_weight.double()
    exact = scale * (1 + stored if zero_centered else stored)
    relative_error = ((effective - exact) / exact).abs().max().item()
    assert relative_error <= 2**-8 + 1e-5, relative_error
    assert module.zero_centered_gamma is zero_centered  # restored after the call


@pytest.mark.parametrize("norm_affine", [True, False])
def test_megatron_fsdp_classifies_the_lns_class_like_te(seeded, norm_affine):
    """Megatron-FSDP picks parameter layouts by class name: megatron-core 0.19.2,
    ``FullyShardedDataParallel._detect_parallelism_type`` in
    ``distributed/fsdp/mcore_fsdp_adapter.py`` special-cases ``type(module).__name__ ==
    "TELayerNormColumnParallelLinear"`` (norm params replicated, GEMM params column);
    an unknown name containing "Norm" falls through to "replicated" for every parameter,
    which would replicate the column-parallel GEMM weight."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    te_named = type("TELayerNormColumnParallelLinear", (StandIn,), {})
    tf = tiny_config(normalization="LayerNorm", bias=True).transformer_config()
    adapter = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # classification only
    layouts = []
    for cls in (te_named, with_norm_scaling(te_named, norm_affine)):
        module = cls(
            64, 48, config=tf, init_method=torch.nn.init.normal_, gather_output=False,
            bias=True, skip_bias_add=False,
        )  # fmt: skip
        layouts.append(
            {
                name: adapter._detect_parallelism_type(name, module)
                for name, _ in module.named_parameters(recurse=False)
            }
        )
    expected = {
        "weight": "column",
        "bias": "column",
        "layer_norm_weight": "replicated",
        "layer_norm_bias": "replicated",
    }
    assert layouts == [expected, expected]


@pytest.mark.parametrize("zero_centered", [False, True])
def test_parameter_free_fused_norm_stays_frozen_through_reset_parameters(seeded, zero_centered):
    """TE's reset_parameters (which Megatron-FSDP's meta-device init calls) re-wraps every
    parameter as a fresh nn.Parameter, so a frozen one would come back trainable."""
    cfg = tiny_config(
        normalization="LayerNorm", norm_affine=False, layernorm_zero_centered_gamma=zero_centered
    )
    module = with_norm_scaling(StandIn, norm_affine=False)(
        64,
        48,
        config=cfg.transformer_config(),
        init_method=torch.nn.init.normal_,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
    )
    with torch.no_grad():
        module.layer_norm_weight.add_(0.5)  # e.g. a meta tensor materialised with garbage
    module.reset_parameters()
    identity = 0.0 if zero_centered else 1.0
    for name in ("layer_norm_weight", "layer_norm_bias"):
        param = getattr(module, name)
        assert not param.requires_grad, name
        assert torch.all(param == (identity if name == "layer_norm_weight" else 0.0)), name
    assert module.weight.requires_grad
    assert not any("layer_norm" in k for k in module.state_dict())
