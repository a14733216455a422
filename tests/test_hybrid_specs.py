"""The LNS hybrid stack (megatron_lns/model/hybrid_specs.py) on one CPU rank: the depth rule on
constructed patterns, Pre-LN, the final norm, refused sublayers, the Transformer Engine
layout (CPU stand-ins, tests/te_standin.py) and Megatron-LM's ``--spec`` route.

The expected block of each sublayer is written out by hand from the rule in
docs/design.md / hybrid_pattern.py (an attention starts a block; MLP and MoE sublayers
share the block of the attention before them; MLPs before any attention are block 1).
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import perturb_norm_weights, tiny_config, token_inputs
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.hybrid.hybrid_model import HybridModel
from te_standin import StandInTESpecProvider

import megatron_lns.model.hybrid_specs
import megatron_lns.model.te
from megatron_lns.model.fused_norm import FusedNormScaling
from megatron_lns.model.hybrid_specs import get_lns_hybrid_stack_spec, lns_hybrid_stack_spec
from megatron_lns.model.language_model import build_model
from megatron_lns.model.norms import LocalNorm, local_norm_builder
from megatron_lns.model.specs import local_to_fused_state_dict

# pattern -> the paper's block of each sublayer (by hand).
PATTERNS = {
    "-*--**E-": (1, 1, 1, 1, 2, 3, 3, 3),  # MLPs first, two attentions in a row, experts
    "--*-": (1, 1, 1, 1),  # starts with MLPs
    "**-*E": (1, 2, 2, 3, 3),  # two mixers in a row: block 1 has no MLP
    "*-*-*-": (1, 1, 2, 2, 3, 3),  # the GPT twin
}
# The TE stand-in normalises in fp32, as TE's kernel does (tests/test_fused_norm.py's bounds).
STANDIN_LOGITS = dict(rtol=1e-5, atol=1e-5)
STANDIN_GRADS = dict(rtol=1e-4, atol=1e-6)


def hybrid_config(pattern: str, **overrides):
    experts = dict(num_moe_experts=4) if "E" in pattern else {}
    return tiny_config(
        architecture="hybrid",
        hybrid_layer_pattern=pattern,
        num_layers=len(pattern.replace("|", "")),
        **experts,
        **overrides,
    )


def norm_owner(layer) -> torch.nn.Module:
    """The one module that applies a sublayer's pre-norm."""
    (owner,) = layer.pre_norm_owners()
    return owner


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_each_sublayer_is_scaled_by_its_block(seeded, pattern):
    model = build_model(hybrid_config(pattern))[0]
    layers = model.decoder.layers
    assert [layer.layer_number for layer in layers] == list(range(1, len(pattern) + 1))
    for layer, symbol, block in zip(layers, pattern, PATTERNS[pattern], strict=True):
        factor = 1 / math.sqrt(block)
        assert layer.block_number == block
        assert layer.norm_output_scale == factor
        owner = norm_owner(layer)
        expected_owner = layer.input_layernorm if symbol == "*" else layer.pre_mlp_layernorm
        assert owner is expected_owner and isinstance(owner, LocalNorm)
        assert owner.output_scale == factor
    assert sum(type(layer.mlp).__name__ == "MoELayer" for layer in layers) == pattern.count("E")


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_each_norm_outputs_its_block_factor_times_the_pre_ln_norm(seeded, pattern):
    """What the norms compute, not only what they store: on the same input and weights, an
    LNS sublayer's norm is 1/sqrt(block) times the Pre-LN model's, and the final norms agree."""
    lns = build_model(hybrid_config(pattern))[0]
    perturb_norm_weights(lns)
    plain = build_model(hybrid_config(pattern, norm_scaling="none"))[0]
    plain.load_state_dict(lns.state_dict(), strict=True)
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(3))
    pairs = zip(lns.decoder.layers, plain.decoder.layers, PATTERNS[pattern], strict=True)
    with torch.no_grad():
        for lns_layer, plain_layer, block in pairs:
            assert plain_layer.norm_output_scale == 1.0
            scaled, unscaled = norm_owner(lns_layer)(x), norm_owner(plain_layer)(x)
            torch.testing.assert_close(scaled, unscaled / math.sqrt(block), rtol=1e-6, atol=0)
        assert lns.decoder.final_norm.output_scale == 1.0
        torch.testing.assert_close(lns.decoder.final_norm(x), plain.decoder.final_norm(x))


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_pre_ln_scales_nothing(seeded, pattern):
    model = build_model(hybrid_config(pattern, norm_scaling="none"))[0]
    for layer in model.decoder.layers:
        assert layer.norm_output_scale == norm_owner(layer).output_scale == 1.0
    assert model.decoder.final_norm.output_scale == 1.0


def test_the_final_norm_is_never_scaled(seeded):
    model = build_model(hybrid_config("-*--**E-"))[0]
    final = model.decoder.final_norm
    # The spec's norm (as the GPT model's), not the TENorm megatron's HybridStack hard-wires.
    assert isinstance(final, LocalNorm) and final.output_scale == 1.0


def test_megatron_counts_the_e_sublayers_as_the_moe_layers(seeded):
    """megatron's router-loss report averages over the MoE layers that moe_layer_freq marks
    among num_layers (here sublayers): the E sublayers, not all of them."""
    config = hybrid_config("-*--**E-").transformer_config()
    assert config.num_layers == 8
    assert config.moe_layer_freq == [0, 0, 0, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("symbol", ["M", "G"])
def test_the_stack_refuses_a_sublayer_it_does_not_build(seeded, symbol):
    """Config validation refuses these patterns first; a HybridModel built around it (as
    Megatron-LM or a user script would) gets the stack's own error, naming the symbol."""
    pattern = f"*-{symbol}-"
    cfg = hybrid_config("*-*-")
    with pytest.raises(ValueError, match=rf"builds \*, -, E sublayers, not '{symbol}' \(a "):
        megatron_lm_model(cfg, pattern, get_lns_hybrid_stack_spec(pattern))


# -- the Transformer Engine layout (CPU stand-ins) ------------------------------------------


@pytest.fixture()
def te_standins(monkeypatch):
    """megatron's TE layer spec from CPU stand-ins (tests/te_standin.py): norms fused into
    linear_qkv and linear_fc1, an MoE sublayer's pre-MLP norm whatever megatron-lns puts
    there (the stand-in TENorm fails if built), the final norm local (TENorm needs CUDA)."""
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", StandInTESpecProvider)
    monkeypatch.setattr(megatron_lns.model.te, "require_te", lambda: None)
    monkeypatch.setattr(
        megatron_lns.model.hybrid_specs, "te_final_norm_builder", local_norm_builder
    )


@pytest.mark.parametrize("pattern", ["-*--**E-", "**-*E"])
def test_te_backend_hybrid_stack_matches_the_local_backend(seeded, te_standins, pattern):
    local = build_model(hybrid_config(pattern))[0]
    te = build_model(hybrid_config(pattern, backend="te"))[0]
    perturb_norm_weights(local)
    te.load_state_dict(local_to_fused_state_dict(local.state_dict()), strict=True)
    for layer, symbol, block in zip(te.decoder.layers, pattern, PATTERNS[pattern], strict=True):
        owner = norm_owner(layer)
        if symbol == "*":
            assert owner is layer.self_attention.linear_qkv and isinstance(owner, FusedNormScaling)
        elif symbol == "-":
            assert owner is layer.mlp.linear_fc1 and isinstance(owner, FusedNormScaling)
        else:  # an MoE sublayer keeps a separate pre-MLP norm
            assert owner is layer.pre_mlp_layernorm and isinstance(owner, LocalNorm)
        assert owner.output_scale == 1 / math.sqrt(block)
    cfg = hybrid_config(pattern)
    tokens, positions, targets = token_inputs(cfg)
    te_logits, local_logits = te(tokens, positions, None), local(tokens, positions, None)
    torch.testing.assert_close(te_logits, local_logits, **STANDIN_LOGITS)
    loss = lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # noqa: E731
    loss(te_logits).backward()
    loss(local_logits).backward()
    local_grads = local_to_fused_state_dict({n: p.grad for n, p in local.named_parameters()})
    for name, param in te.named_parameters():
        torch.testing.assert_close(param.grad, local_grads[name], **STANDIN_GRADS, msg=name)


# -- Megatron-LM's --spec megatron_lns.model.hybrid_specs lns_hybrid_stack_spec -----------------


def megatron_lm_model(cfg, pattern: str, spec=lns_hybrid_stack_spec) -> HybridModel:
    """What Megatron-LM's hybrid model builder does with ``--spec``: the module-level stack
    spec as it is (or ``spec``), the pattern given to HybridModel (the stack reads it from
    the args)."""
    return HybridModel(
        config=cfg.transformer_config(),
        hybrid_stack_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
    )


@pytest.fixture()
def megatron_lm_args(monkeypatch):
    """Megatron-LM's global arguments (``megatron.training.get_args``) set to a namespace."""
    from megatron.training import global_vars

    def set_args(**args):
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", SimpleNamespace(**args) if args else None)

    return set_args


def test_megatron_lm_spec_reads_the_pattern_from_the_arguments(seeded, megatron_lm_args):
    for pattern in ("-*--**E-", "**-*E"):  # twice: the module-level spec keeps no state
        megatron_lm_args(hybrid_layer_pattern=pattern)
        cfg = hybrid_config(pattern)
        model = megatron_lm_model(cfg, pattern)
        blocks = [layer.block_number for layer in model.decoder.layers]
        assert blocks == list(PATTERNS[pattern])
        assert model.decoder.final_norm.output_scale == 1.0
        # The same model as megatron-lns builds: same parameters, same logits.
        ours = build_model(cfg)[0]
        perturb_norm_weights(ours)
        model.load_state_dict(ours.state_dict(), strict=True)
        tokens, positions, _ = token_inputs(cfg)
        with torch.no_grad():
            torch.testing.assert_close(
                model(tokens, positions, None), ours(tokens, positions, None)
            )
    assert lns_hybrid_stack_spec.params["hybrid_layer_pattern"] is None


@pytest.mark.parametrize(
    "args", [{}, {"hybrid_layer_pattern": None}], ids=["no args", "no pattern"]
)
def test_megatron_lm_spec_without_a_pattern_is_one_clear_sentence(seeded, megatron_lm_args, args):
    megatron_lm_args(**args)
    with pytest.raises(ValueError) as error:
        megatron_lm_model(hybrid_config("*-*-"), "*-*-")
    message = str(error.value)
    assert "\n" not in message and message.count(". ") == 0
    assert "hybrid_layer_pattern" in message and "--hybrid-layer-pattern" in message


def test_megatron_lm_spec_without_megatron_training_is_the_same_error(seeded, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "megatron.training", None)  # not installed
    with pytest.raises(ValueError, match="--hybrid-layer-pattern"):
        megatron_lm_model(hybrid_config("*-*-"), "*-*-")
