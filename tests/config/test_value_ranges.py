"""An integer too large for the int64 or float that holds it is refused by name, however
it arrives (a literal, a quoted number OmegaConf converts, an interpolation), before a
check or plan's arithmetic converts it to a float (OverflowError)."""

import pytest
from helpers import cli_error_of, config_error

from megatron_lns.config.rules import positive

HUGE = 10**309  # beyond a float
INT64 = "must lie in [-2**63, 2**63)"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (f"model.hidden_size={HUGE}", f"'model.hidden_size' {INT64}"),
        (f"model.hidden_size={2**63}", f"'model.hidden_size' {INT64}"),
        (f"model.hidden_size='{10**299}'", f"'model.hidden_size' {INT64}"),  # converted
        (f"model.hidden_size=${{multiply:{10**299},1}}", f"'model.hidden_size' {INT64}"),
        (f"model.hidden_dropout={HUGE}", "'model.hidden_dropout' is too large for a floating"),
        (f"model.optim.betas=[{HUGE},0.9]", "'model.optim.betas[0]' is too large for a float"),
        (f"model.nsys_profile.ranks=['{10**299}']", f"'model.nsys_profile.ranks[0]' {INT64}"),
    ],
)
def test_an_integer_too_large_for_its_key_is_refused_by_name(override, expected):
    assert config_error(override).startswith(expected)


def test_plan_refuses_a_sequence_length_beyond_int64(capsys):
    error = cli_error_of(capsys, "plan", "tiny_cpu_demo", f"model.encoder_seq_length={10**299}")
    assert error.startswith(f"error: 'model.encoder_seq_length' {INT64}")
    assert error.endswith("got a 994-bit integer")


def test_an_integer_too_large_for_a_float_is_not_finite():
    assert positive.error("model.x", HUGE) == "model.x must be positive, got a 1027-bit integer"
