import math

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lns.model.norms import LocalNorm
from megatron_lns.model.scaling import lns_factor


def _config(**kw):
    values = dict(num_layers=2, hidden_size=8, num_attention_heads=2, normalization="LayerNorm")
    values.update(kw)
    return TransformerConfig(**values)


def _explicit(norm_type, x, weight, bias, eps, scale):
    if norm_type == "RMSNorm":
        out = torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)
    else:
        out = torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return out * scale


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_affine_norm_with_scale_matches_multiply_after_norm(normalization, zero_centered):
    torch.manual_seed(0)
    cfg = _config(normalization=normalization, layernorm_zero_centered_gamma=zero_centered)
    norm = LocalNorm(cfg, hidden_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
        if norm.bias is not None:
            norm.bias.normal_()
    norm.output_scale = 1 / math.sqrt(5)
    x = torch.randn(3, 2, 8, requires_grad=True)
    y = norm(x)
    gamma = (1 + norm.weight) if zero_centered else norm.weight
    expected = _explicit(normalization, x, gamma, norm.bias, 1e-5, norm.output_scale)
    torch.testing.assert_close(y, expected)

    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *norm.parameters()], grad)
    want = torch.autograd.grad(expected, [x, *norm.parameters()], grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_zero_centered_gamma_initialises_to_zero_and_acts_as_identity():
    norm = LocalNorm(_config(normalization="RMSNorm", layernorm_zero_centered_gamma=True), 8)
    assert torch.count_nonzero(norm.weight) == 0
    x = torch.randn(4, 8)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (8,), eps=1e-5))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_non_parametric_norm_has_no_parameters_and_scales_output(normalization):
    norm = LocalNorm(_config(normalization=normalization), 8, affine=False)
    assert list(norm.parameters()) == []
    assert norm.state_dict() == {}
    x = torch.randn(4, 8)
    plain = norm(x)
    norm.output_scale = 0.5
    torch.testing.assert_close(norm(x), plain * 0.5)
    # The cached constant gamma is not state: it never reaches a checkpoint.
    assert norm.state_dict() == {}


def test_sequence_parallel_marks_parameters_for_tp_grad_allreduce():
    norm = LocalNorm(_config(sequence_parallel=True, tensor_model_parallel_size=2), 8)
    assert [getattr(p, "sequence_parallel", None) for p in norm.parameters()] == [True, True]
    norm = LocalNorm(_config(), 8)
    assert [getattr(p, "sequence_parallel", None) for p in norm.parameters()] == [False, False]


def test_unsupported_normalization_is_a_clear_error():
    cfg = _config()
    cfg.normalization = "L2Norm"
    with pytest.raises(ValueError, match="normalization='L2Norm'"):
        LocalNorm(cfg, 8)


def test_output_scale_is_not_in_state_dict():
    norm = LocalNorm(_config(), 8)
    norm.output_scale = 0.25
    assert set(norm.state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("affine", [True, False])
def test_folding_matches_the_multiply_after_norm_reference(affine):
    from megatron_lns.model.norms import MultiplyAfterNorm

    torch.manual_seed(0)
    cfg = _config(normalization="RMSNorm")
    folded, reference = LocalNorm(cfg, 8, affine=affine), MultiplyAfterNorm(cfg, 8, affine=affine)
    if affine:
        with torch.no_grad():
            folded.weight.normal_()
        reference.load_state_dict(folded.state_dict())
    folded.output_scale = reference.output_scale = 1 / math.sqrt(3)
    x = torch.randn(4, 8)
    torch.testing.assert_close(folded(x), reference(x))
    assert reference.output_scale == 1 / math.sqrt(3)


@pytest.mark.parametrize("layer", [64, 100])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_deep_layer_bf16_effective_scale_is_as_precise_as_plain_gamma(zero_centered, layer):
    """Layers 64 and 100, bf16 parameters (as under Float16Module): the norm multiplies
    by s*(1+g) to bf16's rounding, not by a rounded s*g + (s-1) (off by up to 1.6%)."""
    hidden, scale = 64, lns_factor(layer)
    cfg = _config(
        hidden_size=hidden,
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=zero_centered,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    norm = LocalNorm(cfg, hidden)
    g = 0.02 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        norm.weight.copy_(g if zero_centered else 1 + g)
    norm.output_scale = scale
    x = torch.tensor([1.0, -1.0] * (hidden // 2), dtype=torch.bfloat16)
    effective = norm(x).double() * x.double()
    stored = norm.weight.double()
    exact = scale * (1 + stored if zero_centered else stored)
    relative_error = ((effective - exact) / exact).abs().max().item()
    assert relative_error <= 2**-8 + 1e-5, relative_error
