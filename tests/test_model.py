"""Single-process model tests: LNS against an independent reference, Pre-LN against megatron."""

import math
from fractions import Fraction

import pytest
import torch
from helpers import checkpoint_keys, perturb_norm_weights, tiny_config
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from reference_llama import ReferenceLlama, reference_sizes

from megatron_lns.model.language_model import build_model
from megatron_lns.model.layer import LNSTransformerLayer


def _inputs(cfg, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=gen)
    positions = torch.arange(cfg.seq_length).unsqueeze(0).expand(batch, -1)
    return tokens, positions


def _reference_for(cfg, lns):
    return ReferenceLlama(
        **reference_sizes(cfg),
        lns=lns,
        normalization=cfg.normalization,
        eps=cfg.layernorm_epsilon,
        head_dim=cfg.head_size,
    ).double()


@pytest.mark.parametrize("norm_scaling", ["lns", "none"])
# kv_channels=24: four 24-channel heads, 96 wide, over a 64-wide residual stream.
@pytest.mark.parametrize("kv_channels", [None, 24], ids=["hidden_over_heads", "kv_channels"])
def test_logits_and_gradients_match_independent_reference(seeded, norm_scaling, kv_channels):
    cfg = tiny_config(norm_scaling=norm_scaling, num_layers=6, kv_channels=kv_channels)
    model = build_model(cfg)[0].double()
    perturb_norm_weights(model)
    reference = _reference_for(cfg, lns=norm_scaling == "lns")
    reference.load_megatron_state_dict(model.state_dict())

    tokens, positions = _inputs(cfg)
    logits = model(tokens, positions, None)
    expected = reference(tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)

    targets = torch.randint(0, cfg.vocab_size, tokens.shape)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ref_loss = torch.nn.functional.cross_entropy(expected.flatten(0, 1), targets.flatten())
    loss.backward()
    ref_loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad, reference.p[name].grad, rtol=1e-8, atol=1e-10, msg=name
        )


@pytest.mark.parametrize("kv_channels", [None, 24], ids=["hidden_over_heads", "kv_channels"])
def test_flops_per_token_counts_the_models_matmul_weights(seeded, kv_channels):
    """6 FLOPs per matmul weight per token (every linear layer and the output layer, not the
    embedding lookup), plus causal attention over heads x head size channels."""
    cfg = tiny_config(kv_channels=kv_channels)
    model = build_model(cfg)[0]
    matmul_weights = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() == 2 and not name.startswith("embedding.")
    )
    attention = 6 * cfg.num_layers * cfg.num_attention_heads * cfg.head_size * cfg.seq_length
    assert cfg.flops_per_token() == 6 * matmul_weights + attention


@pytest.mark.parametrize("pattern", ["*-*-", "*--*-", "-*E**E"])
def test_hybrid_flops_per_token_count_each_sublayers_weights(seeded, pattern):
    """The same count for a hybrid pattern: every sublayer's matmul weights (a routed
    expert ``topk / num_experts`` times), causal attention once per attention sublayer."""
    moe = "E" in pattern
    cfg = (_moe_config if moe else tiny_config)(
        architecture="hybrid", num_layers=len(pattern), hybrid_layer_pattern=pattern
    )
    matmul_weights = Fraction(0)
    for name, p in build_model(cfg)[0].named_parameters():
        if p.dim() == 2 and not name.startswith("embedding."):
            share = (
                Fraction(cfg.moe_router_topk, cfg.num_moe_experts) if _routed_expert(name) else 1
            )
            matmul_weights += p.numel() * share
    attention = 6 * pattern.count("*") * cfg.num_attention_heads * cfg.head_size * cfg.seq_length
    assert cfg.flops_per_token() == 6 * matmul_weights + attention


def _moe_config(topk=2, moe_layer_freq=(0, 1, 1, 1), shared=None, gate=False, **overrides):
    return tiny_config(
        num_moe_experts=4,
        moe_router_topk=topk,
        moe_layer_freq=list(moe_layer_freq) if isinstance(moe_layer_freq, tuple) else 2,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=shared,
        extra_transformer_config=dict(
            moe_token_dispatcher_type="allgather",
            moe_router_pre_softmax=topk == 1,  # megatron requires it for softmax top-1
            moe_shared_expert_gate=gate,
        ),
        **overrides,
    )


MOE_CASES = {
    "top2_mixed_layers": dict(topk=2),
    "top1_every_other_layer_gated_shared_expert": dict(
        topk=1, moe_layer_freq=2, shared=32, gate=True
    ),
}


def _routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


@pytest.mark.parametrize("case", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_moe_flops_per_token_count_the_weights_a_token_meets(seeded, case):
    """A token meets the router, ``topk`` of the routed experts and the shared expert (with
    its gate): each routed expert's weights count ``topk / num_experts`` times."""
    cfg = _moe_config(**case)
    model = build_model(cfg)[0]
    matmul_weights = Fraction(0)
    for name, p in model.named_parameters():
        if p.dim() == 2 and not name.startswith("embedding."):
            share = (
                Fraction(cfg.moe_router_topk, cfg.num_moe_experts) if _routed_expert(name) else 1
            )
            matmul_weights += p.numel() * share
    assert any(_routed_expert(name) for name, _ in model.named_parameters())
    attention = 6 * cfg.num_layers * cfg.num_attention_heads * cfg.head_size * cfg.seq_length
    assert cfg.flops_per_token() == 6 * matmul_weights + attention


PARAMETER_CASES = {
    "dense_rmsnorm": lambda: tiny_config(),
    "dense_layernorm_tied_qk_norm": lambda: tiny_config(
        normalization="LayerNorm", share_embeddings_and_output_weights=True, qk_layernorm=True
    ),
    "dense_learned_positions_no_norm_weights": lambda: tiny_config(
        position_embedding_type="learned_absolute", norm_affine=False
    ),
    **{f"moe_{k}": (lambda c=c: _moe_config(**c)) for k, c in MOE_CASES.items()},
    # HybridModel: the GPT twin, a dense pattern no GPT model has (two MLPs in block 1, a
    # second block of attention only), and MoE sublayers mixed with dense ones.
    "hybrid_gpt_twin_moe": lambda: _moe_config(architecture="hybrid"),
    "hybrid_dense_not_gpt_equivalent": lambda: tiny_config(
        architecture="hybrid", num_layers=5, hybrid_layer_pattern="*--*-"
    ),
    "hybrid_moe_not_gpt_equivalent": lambda: _moe_config(
        architecture="hybrid", num_layers=6, hybrid_layer_pattern="*E-**E", shared=32, gate=True
    ),
}


@pytest.mark.parametrize("make", PARAMETER_CASES.values(), ids=PARAMETER_CASES.keys())
def test_parameter_counts_match_the_built_model(seeded, make):
    """Total: every parameter of the built model; active: without the ``num_experts - topk``
    routed experts a token does not meet in each MoE layer."""
    cfg = make()
    named = dict(build_model(cfg)[0].named_parameters())
    total = sum(p.numel() for p in named.values())
    routed = sum(p.numel() for name, p in named.items() if _routed_expert(name))
    idle = Fraction(cfg.num_moe_experts - cfg.moe_router_topk, cfg.num_moe_experts) if routed else 0
    counts = cfg.parameter_counts()
    assert counts.total == total
    assert counts.active == total - routed * idle
    assert (counts.active < counts.total) == bool(routed)


def test_lns_changes_the_function(seeded):
    """Guard against a silently disabled LNS path (the paper repo's own bug)."""
    cfg = tiny_config(num_layers=4)
    lns = build_model(cfg)[0]
    plain = build_model(tiny_config(num_layers=4, norm_scaling="none"))[0]
    plain.load_state_dict(lns.state_dict())
    tokens, positions = _inputs(cfg)
    assert not torch.allclose(lns(tokens, positions, None), plain(tokens, positions, None))


def test_every_pre_norm_gets_its_layer_factor_and_final_norm_none(seeded):
    model = build_model(tiny_config(num_layers=5))[0]
    for layer in model.decoder.layers:
        assert isinstance(layer, LNSTransformerLayer)
        expected = 1 / math.sqrt(layer.layer_number)
        assert layer.input_layernorm.output_scale == expected
        assert layer.pre_mlp_layernorm.output_scale == expected
    assert [layer.layer_number for layer in model.decoder.layers] == [1, 2, 3, 4, 5]
    assert model.decoder.final_layernorm.output_scale == 1.0


def test_pre_ln_mode_is_identical_to_megatron_local_spec(seeded):
    cfg = tiny_config(norm_scaling="none")
    ours = build_model(cfg)[0]
    tf_config = cfg.transformer_config()
    megatron_model = GPTModel(
        config=tf_config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=cfg.normalization),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        position_embedding_type="rope",
    )
    # Same parameter names and checkpoint keys as megatron's own spec.
    assert ours.state_dict().keys() == megatron_model.state_dict().keys()
    assert checkpoint_keys(ours) == checkpoint_keys(megatron_model)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in checkpoint_keys(ours)
    perturb_norm_weights(ours)
    megatron_model.load_state_dict(ours.state_dict())
    tokens, positions = _inputs(cfg)
    assert torch.equal(ours(tokens, positions, None), megatron_model(tokens, positions, None))


def test_pre_ln_checkpoint_loads_into_lns_model_and_back(seeded):
    lns = build_model(tiny_config())[0]
    plain = build_model(tiny_config(norm_scaling="none"))[0]
    lns.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(lns.state_dict(), strict=True)
    assert checkpoint_keys(lns) == checkpoint_keys(plain)


def test_factor_survives_meta_init_to_empty_and_load_state_dict(seeded):
    cfg = tiny_config(num_layers=4)
    eager = build_model(cfg)[0]
    perturb_norm_weights(eager)
    with torch.device("meta"):
        lazy = build_model(cfg)[0]
    assert all(p.is_meta for p in lazy.parameters())
    lazy = lazy.to_empty(device="cpu")
    lazy.load_state_dict(eager.state_dict())
    for layer in lazy.decoder.layers:
        assert layer.input_layernorm.output_scale == 1 / math.sqrt(layer.layer_number)
    tokens, positions = _inputs(cfg)
    torch.testing.assert_close(lazy(tokens, positions, None), eager(tokens, positions, None))


def test_lns_defaults_to_plain_normal_output_init_scaled_is_opt_in():
    lns, plain = tiny_config(), tiny_config(norm_scaling="none")
    assert lns.resolved_output_layer_init() == "normal"
    assert plain.resolved_output_layer_init() == "scaled"
    assert tiny_config(output_layer_init="scaled").resolved_output_layer_init() == "scaled"
    std = lns.init_method_std
    assert lns.transformer_config(cpu_init=True).output_layer_init_method.keywords["std"] == std
    scaled = tiny_config(output_layer_init="scaled").transformer_config(cpu_init=True)
    assert scaled.output_layer_init_method.keywords["std"] == pytest.approx(
        std / math.sqrt(2 * lns.num_layers)
    )


def test_output_projection_init_follows_the_choice(seeded):
    cfg = tiny_config(num_layers=8, hidden_size=128, ffn_hidden_size=256, init_method_std=0.02)
    normal = build_model(cfg)[0]
    scaled = build_model(
        tiny_config(
            num_layers=8,
            hidden_size=128,
            ffn_hidden_size=256,
            init_method_std=0.02,
            output_layer_init="scaled",
        )
    )[0]
    std_normal = normal.decoder.layers[0].mlp.linear_fc2.weight.std().item()
    std_scaled = scaled.decoder.layers[0].mlp.linear_fc2.weight.std().item()
    assert std_normal == pytest.approx(0.02, rel=0.1)
    assert std_scaled == pytest.approx(0.02 / 4, rel=0.1)
