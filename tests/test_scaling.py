import math

import pytest
import torch

from megatron_lns.model.scaling import (
    fold_scale_into_beta,
    fold_scale_into_gamma,
    lns_factor,
    norm_output_scale,
)


@pytest.mark.parametrize("layer_number", [1, 2, 3, 7, 32, 100])
def test_factor_is_inverse_sqrt_of_one_based_layer_number(layer_number):
    assert lns_factor(layer_number) == pytest.approx(1 / math.sqrt(layer_number), rel=0, abs=0)
    assert isinstance(lns_factor(layer_number), float)


def test_first_layer_is_unscaled():
    assert lns_factor(1) == 1.0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_factor_rejects_non_one_based_ints(bad):
    with pytest.raises(ValueError, match="1-based"):
        lns_factor(bad)


def test_norm_scaling_modes():
    assert norm_output_scale("lns", 4) == 0.5
    assert norm_output_scale("none", 4) == 1.0
    with pytest.raises(ValueError, match="norm_scaling"):
        norm_output_scale("LNS", 4)


def _layer_norm(x, gamma, beta, zero_centered):
    x_hat = torch.nn.functional.layer_norm(x, x.shape[-1:])
    effective = (1 + gamma) if zero_centered else gamma
    return x_hat * effective + beta


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("scale", [1.0, 1 / math.sqrt(2), 1 / math.sqrt(17)])
def test_folding_equals_scaling_the_output(zero_centered, scale):
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64)
    gamma = torch.randn(8, dtype=torch.float64)
    beta = torch.randn(8, dtype=torch.float64)
    expected = _layer_norm(x, gamma, beta, zero_centered) * scale
    folded = _layer_norm(
        x,
        fold_scale_into_gamma(gamma, scale, zero_centered),
        fold_scale_into_beta(beta, scale),
        zero_centered,
    )
    torch.testing.assert_close(folded, expected, rtol=1e-12, atol=1e-12)


def test_zero_centered_rule_is_exact_formula():
    gamma = torch.tensor([0.0, 0.5, -1.0], dtype=torch.float64)
    s = 0.25
    torch.testing.assert_close(
        fold_scale_into_gamma(gamma, s, zero_centered=True), s * gamma + (s - 1)
    )
    # The zero-centred identity gamma (0) becomes s - 1, i.e. an effective weight of s.
    assert fold_scale_into_gamma(torch.zeros(1), s, True).item() == pytest.approx(s - 1)


def test_folding_gradients_match_explicit_multiply():
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=torch.float64)
    s = 1 / math.sqrt(3)
    g1 = torch.randn(6, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(6, dtype=torch.float64, requires_grad=True)
    g2 = g1.detach().clone().requires_grad_()
    b2 = b1.detach().clone().requires_grad_()
    (_layer_norm(x, g1, b1, False) * s).pow(2).sum().backward()
    _layer_norm(x, fold_scale_into_gamma(g2, s), fold_scale_into_beta(b2, s), False).pow(
        2
    ).sum().backward()
    torch.testing.assert_close(g1.grad, g2.grad)
    torch.testing.assert_close(b1.grad, b2.grad)


def test_unit_scale_and_missing_bias_are_passthrough():
    gamma = torch.randn(3)
    assert fold_scale_into_gamma(gamma, 1.0) is gamma
    assert fold_scale_into_beta(None, 0.5) is None
