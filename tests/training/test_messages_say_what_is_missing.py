"""User-facing lines name what is missing in words, never as Python's ``None``."""

from pathlib import Path

from megatron_lns.training import architecture_checkpoint as architecture
from megatron_lns.training import provenance
from megatron_lns.training.trainer import diverged_message


def test_a_run_diverged_before_its_first_checkpoint_says_there_is_none():
    before_any = diverged_message("step 1: loss nan, gradient norm nan", None)
    assert "None" not in before_any
    assert "(no complete checkpoint yet: a rerun starts afresh)" in before_any
    newest = Path("/runs/lns/checkpoints/iter_0000004")
    assert f"(newest complete one: {newest})" in diverged_message("step 5: loss inf", newest)


def test_a_changed_model_key_says_null_or_unset_not_none():
    saved = "model:\n  num_layers: 4\n  num_moe_experts: null\n"
    current = "model:\n  num_layers: 4\n  num_moe_experts: 4\n  mix_ln_post_fraction: 0.25\n"
    keys = ["model.num_layers", "model.num_moe_experts", "model.mix_ln_post_fraction"]
    assert provenance.changed_values(saved, current, keys) == [
        "model.num_moe_experts: null -> 4",
        "model.mix_ln_post_fraction: unset -> 0.25",
    ]


def test_a_hybrid_checkpoint_without_its_pattern_is_named_as_such():
    problem = architecture.architecture_mismatch(
        {"name": "hybrid"}, {"name": "hybrid", "sublayers": "*-*-"}
    )
    assert "None" not in problem
    assert problem.startswith("it holds a hybrid pattern it does not record (pipeline '|' aside)")
