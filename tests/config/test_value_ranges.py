"""An integer too large for the int64 or float that holds it is refused by name, however
it arrives (a literal, a quoted number OmegaConf converts, an interpolation), before a
check or plan's arithmetic converts it to a float (OverflowError)."""

import pytest
from helpers import cli_error_of, config_error, validated_demo_config

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


def test_learnt_timeouts_that_cannot_mean_anything_are_refused_by_name():
    """A safety factor below 1 would declare a step as slow as the slowest seen hung; a
    floor above a phase's cap would be ignored in silence."""
    ft = "exp_manager.fault_tolerance"
    assert config_error(f"{ft}.safety_factor=0.5") == (
        f"{ft}.safety_factor must be >= 1 (a learnt timeout below the slowest time seen ends "
        "a healthy run), got 0.5"
    )
    assert config_error(f"{ft}.rank_heartbeat_timeout=10") == (
        f"{ft}.min_timeout (30) exceeds {ft}.rank_heartbeat_timeout (10), the most a learnt "
        "timeout may be: lower min_timeout, or set calculate_timeouts=false to keep the "
        "configured timeouts"
    )
    # Where nothing is learnt, the floor applies to nothing.
    validated_demo_config(f"{ft}.rank_heartbeat_timeout=10", f"{ft}.calculate_timeouts=false")
    validated_demo_config(f"{ft}.rank_heartbeat_timeout=10", f"{ft}.min_timeout=10")
