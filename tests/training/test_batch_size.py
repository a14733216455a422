"""Batch-size ramp-up (``model.rampup_batch_size``): validation, the schedule megatron's
calculator follows, the order in which samples are drawn, and a run that ramps up and
resumes in the middle of the ramp."""

import json
import time

import pytest
from helpers import DEMO_CONFIG, run_distributed, tiny_run_config
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)

from megatron_lns.config import ConfigError, load_config, validate
from megatron_lns.data.datasets import PretrainingBatchSampler
from megatron_lns.training.batch_size import init_batch_size_calculator, rampup_thresholds


def _config_error(*overrides: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(DEMO_CONFIG, list(overrides)), world_size, check_files=False)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("overrides", "world_size", "expected"),
    [
        (
            ["model.rampup_batch_size=[4,4]"],
            1,
            "model.rampup_batch_size must be [start_batch_size, batch_size_increment, "
            "ramp_up_samples], three positive integers, got [4, 4]",
        ),
        (
            ["model.rampup_batch_size=[4,0,100]"],
            1,
            "model.rampup_batch_size must be [start_batch_size, batch_size_increment, "
            "ramp_up_samples], three positive integers, got [4, 0, 100]",
        ),
        (
            ["model.rampup_batch_size=[4,4,-1]"],
            1,
            "got [4, 4, -1]",
        ),
        (
            ["model.global_batch_size=16", "model.rampup_batch_size=[6,4,100]"],
            1,
            "model.rampup_batch_size=[6, 4, 100]: start_batch_size (6) is not divisible by "
            "model.micro_batch_size x data-parallel size (4 x 1)",
        ),
        (
            ["model.global_batch_size=16", "model.rampup_batch_size=[8,4,100]"],
            2,
            "model.rampup_batch_size=[8, 4, 100]: batch_size_increment (4) is not divisible "
            "by model.micro_batch_size x data-parallel size (4 x 2)",
        ),
        (
            ["model.global_batch_size=16", "model.rampup_batch_size=[32,4,100]"],
            1,
            "model.rampup_batch_size=[32, 4, 100]: start_batch_size (32) exceeds "
            "model.global_batch_size (16)",
        ),
        (
            ["model.global_batch_size=16", "model.rampup_batch_size=[4,8,100]"],
            1,
            "model.rampup_batch_size=[4, 8, 100]: model.global_batch_size - start_batch_size "
            "(16 - 4) is not divisible by batch_size_increment (8)",
        ),
        (
            [
                "model.global_batch_size=32",
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2",
                "model.rampup_batch_size=[8,4,100]",
            ],
            2,
            "model.rampup_batch_size=[8, 4, 100]: batch_size_increment (4) is not divisible by "
            "model.micro_batch_size x data-parallel size x model.pipeline_model_parallel_size "
            "(virtual pipeline) (4 x 1 x 2)",
        ),
    ],
    ids=[
        "two_values",
        "zero_increment",
        "negative_samples",
        "start_not_whole_micro_batches",
        "increment_not_whole_at_dp2",
        "start_above_global",
        "ramp_does_not_reach_global",
        "virtual_pipeline_groups",
    ],
)
def test_invalid_rampup_is_named_in_one_line(overrides, world_size, expected):
    assert expected in _config_error(*overrides, world_size=world_size)


def test_a_non_integer_rampup_value_names_the_key():
    with pytest.raises(ConfigError, match=r"model.rampup_batch_size"):
        load_config(DEMO_CONFIG, ["model.rampup_batch_size=[4,4.5,100]"])


def test_valid_rampup_loads_and_null_means_none():
    cfg = load_config(
        DEMO_CONFIG, ["model.global_batch_size=16", "model.rampup_batch_size=[4,4,96]"]
    )
    validate(cfg, 1, check_files=False)
    assert cfg.model.rampup_batch_size == [4, 4, 96]
    assert load_config(DEMO_CONFIG).model.rampup_batch_size is None


def test_rampup_thresholds_of_megatrons_documented_example():
    # Megatron-LM's help: [16, 8, 300000] with global batch size 1024 ramps in
    # (1024 - 16) / 8 = 126 stages of about 300000 / 126 = 2380.95 samples.
    thresholds = rampup_thresholds([16, 8, 300_000], 1024)
    assert len(thresholds) == 127
    assert thresholds[:3] == [(0, 16), (2381, 24), (4762, 32)]
    assert thresholds[-1] == (300_000, 1024)


@pytest.mark.parametrize(
    ("rampup", "global_batch_size", "dp"),
    [([2, 2, 12], 8, 1), ([4, 4, 50], 16, 2), ([2, 2, 3], 12, 1), ([8, 4, 100], 8, 2)],
    ids=["even_stages", "uneven_stages_dp2", "fewer_samples_than_stages", "start_is_global"],
)
def test_calculator_follows_the_ramp_formula(rampup, global_batch_size, dp):
    """megatron's calculator, given our thresholds, gives start + floor(c * stages / samples)
    * increment sequences after c consumed samples, then the global batch size."""
    start, increment, samples = rampup
    stages = (global_batch_size - start) // increment
    init_batch_size_calculator(0, global_batch_size, 2, dp, rampup)
    for consumed in range(3 * samples):
        if stages == 0 or consumed >= samples:
            expected = global_batch_size
        else:
            expected = start + (consumed * stages // samples) * increment
        update_num_microbatches(consumed, consistency_check=True)
        assert get_current_global_batch_size() == expected, consumed
        assert get_num_microbatches() == expected // (2 * dp)


def test_ramping_steps_draw_the_next_samples_in_order_across_data_parallel_ranks():
    micro, dp, global_batch_size = 2, 2, 16
    init_batch_size_calculator(0, global_batch_size, micro, dp, [4, 4, 40])
    samplers = [iter(PretrainingBatchSampler(10_000, 0, micro, dp, rank)) for rank in range(dp)]
    consumed, sizes = 0, []
    for _ in range(12):
        update_num_microbatches(consumed, consistency_check=True)
        drawn = [i for s in samplers for _ in range(get_num_microbatches()) for i in next(s)]
        assert sorted(drawn) == list(range(consumed, consumed + len(drawn)))
        consumed += len(drawn)
        sizes.append(len(drawn))
    # Stages start at samples 0, 14, 27 and 40 (ceil(k * 40 / 3)).
    assert sizes == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16, 16, 16]


# Micro batch 2 at DP 1, global 8, ramp 2 -> 8 in steps of 2 over 12 samples: the
# thresholds are 0:2 4:4 8:6 12:8, so steps 1..6 take 2, 2, 4, 6, 8, 8 sequences.
RAMP = ["model.global_batch_size=8", "model.rampup_batch_size=[2,2,12]"]
RAMP_BATCH_SIZES = [2, 2, 4, 6, 8, 8]


def _train(cfg):
    from megatron_lns.training.trainer import Trainer

    summary = Trainer(cfg).fit()
    return {"losses": summary.train_losses, "valid": summary.valid_loss}


def _run(tmp_path, cfg):
    return run_distributed(_train, 1, tmp_path / f"r{time.monotonic_ns()}", cfg)[0]


def _logged_steps(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["global_batch_size"], r["consumed_samples"]) for r in rows if "loss" in r]


@pytest.mark.slow
@pytest.mark.usefixtures("private_corpus_cache")
def test_rampup_run_follows_the_schedule_and_resumes_mid_ramp_exactly(tmp_path):
    straight = _run(tmp_path, tiny_run_config(tmp_path / "straight", *RAMP))
    consumed = [sum(RAMP_BATCH_SIZES[: i + 1]) for i in range(6)]
    expected = list(zip(range(1, 7), RAMP_BATCH_SIZES, consumed, strict=True))
    assert _logged_steps(tmp_path / "straight" / "lns") == expected

    # Stopped after step 3 (8 samples consumed, batch size 4), then resumed: steps 4..6
    # continue the ramp at 6, 8, 8 with the same losses, bitwise.
    first = _run(tmp_path, tiny_run_config(tmp_path / "resumed", *RAMP, "trainer.exit_interval=3"))
    assert [s for s, _ in first["losses"]] == [1, 2, 3]
    second = _run(tmp_path, tiny_run_config(tmp_path / "resumed", *RAMP))
    assert first["losses"] + second["losses"] == straight["losses"]
    assert second["valid"] == straight["valid"]
    assert _logged_steps(tmp_path / "resumed" / "lns") == expected
