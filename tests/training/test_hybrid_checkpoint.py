"""Checkpoints of hybrid runs, and GPT runs continued in the hybrid model (issue 20).

One spawn of two ranks runs every training (the tiny four-layer model, six steps,
checkpoints at 3 and 6):

* a GPT run continued from its step-3 checkpoint with ``model.architecture=hybrid``
  repeats the uninterrupted GPT run's steps 4-6 bit for bit (weights, Adam state, LR
  schedule and data position all come from the GPT checkpoint): dense (layers stacked in
  the checkpoint, megatron-core's translation) with the plain optimizer at DP=2, stopped
  and continued in its run directory; MoE with a dense first layer (per-layer keys, ours)
  with the distributed optimizer, from the checkpoint named; the dense one at PP=2 too;
* a hybrid run with an explicit pattern at PP=2 (``*-*-|*-*-``) stopped and resumed
  repeats itself bit for bit, and its checkpoint resumes at PP=1 (the pattern given
  again without ``|``) and at TP=2 + SP;
* the GPT model refuses a hybrid checkpoint in one line.
"""

from pathlib import Path

import pytest
from helpers import TINY_MOE_OVERRIDES, logged_losses, tiny_run_config, worker_results

from megatron_lns.config.loader import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.usefixtures("private_corpus_cache")]

HYBRID = ["model.architecture=hybrid"]
DP2 = ["trainer.devices=2"]
MOE = TINY_MOE_OVERRIDES
# The tiny model's hybrid twin as an explicit pattern, split for two pipeline stages.
PP2_PATTERN = [
    *HYBRID,
    "model.num_layers=8",
    "model.hybrid_layer_pattern='*-*-|*-*-'",
    "model.pipeline_model_parallel_size=2",
]
# Where the PP=2 hybrid checkpoint resumes: one stage (the pattern without '|'), and TP=2.
OTHER_LAYOUTS = {
    "pp1": [*HYBRID, "model.num_layers=8", "model.hybrid_layer_pattern='*-*-*-*-'"],
    "tp2": [*HYBRID, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
}
STOP_AT_3 = ["trainer.exit_interval=3"]


def _train(root: Path, name: str, *overrides: str) -> int:
    """Train in ``root/name``; the step it resumed from."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_lns.training.trainer import Trainer

    # megatron's router-loss tracker is process-global and sized by the first model's
    # layer count: a hybrid model has twice the GPT model's (sublayers).
    destroy_moe_metrics_tracker()
    return Trainer(tiny_run_config(root / name, *DP2, *overrides)).fit().resumed_from


def _trainings(tmp: str) -> dict:
    from megatron_lns.base.errors import UserError

    root, out = Path(tmp), {}

    def losses(name):
        return logged_losses(root / name / "lns")

    # Dense: stopped and continued in its run directory (``megatron-lns train CONFIG
    # model.architecture=hybrid``); MoE: the GPT run's checkpoint named.
    _train(root, "gpt_dense")
    _train(root, "migrated_dense", *STOP_AT_3)
    out["migrated_dense_from"] = _train(root, "migrated_dense", *HYBRID)
    _train(root, "gpt_moe", *MOE)
    gpt_moe_3 = root / "gpt_moe" / "lns" / "checkpoints" / "iter_0000003"
    resume_moe = f"exp_manager.resume_from_checkpoint={gpt_moe_3}"
    out["migrated_moe_from"] = _train(root, "migrated_moe", *MOE, *HYBRID, resume_moe)
    gpt_dense_3 = root / "gpt_dense" / "lns" / "checkpoints" / "iter_0000003"
    resume_dense = f"exp_manager.resume_from_checkpoint={gpt_dense_3}"
    pp2 = "model.pipeline_model_parallel_size=2"
    out["migrated_pp2_from"] = _train(root, "migrated_pp2", *HYBRID, pp2, resume_dense)
    for name in ("gpt_dense", "migrated_dense", "gpt_moe", "migrated_moe", "migrated_pp2"):
        out[name] = losses(name)

    _train(root, "hybrid", *PP2_PATTERN)
    _train(root, "hybrid_resumed", *PP2_PATTERN, *STOP_AT_3)
    out["hybrid_resumed_from"] = _train(root, "hybrid_resumed", *PP2_PATTERN)
    out["hybrid"], out["hybrid_resumed"] = losses("hybrid"), losses("hybrid_resumed")
    checkpoint = root / "hybrid" / "lns" / "checkpoints" / "iter_0000003"
    resume = f"exp_manager.resume_from_checkpoint={checkpoint}"
    for name, layout in OTHER_LAYOUTS.items():
        out[f"{name}_from"] = _train(root, name, *layout, resume)
        out[name] = losses(name)
    try:
        _train(root, "back_to_gpt", "model.num_layers=4", resume)
    except UserError as err:
        out["back_to_gpt_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return worker_results(tmp_path_factory, "hybrid_checkpoint", _trainings, 2)


def _after_step_3(losses):
    return [loss for step, loss in losses if step > 3]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_gpt_run_continues_in_the_hybrid_model(runs, kind):
    for rank in runs:
        assert rank[f"migrated_{kind}_from"] == 3
        gpt, migrated = rank[f"gpt_{kind}"], rank[f"migrated_{kind}"]
        assert [step for step, _ in migrated][-3:] == [4, 5, 6]
        # Step 4 is the loaded weights' forward on the loaded data position; 5 and 6 follow
        # from the loaded Adam state and schedule. The two models compute the same sums in
        # the same order: bit for bit.
        assert migrated[-3:] == gpt[3:]


def test_a_hybrid_run_resumes_bitwise(runs):
    for rank in runs:
        assert rank["hybrid_resumed_from"] == 3
        assert [step for step, _ in rank["hybrid"]] == list(range(1, 7))
        assert rank["hybrid_resumed"] == rank["hybrid"]


def test_a_gpt_checkpoint_continues_in_the_hybrid_model_at_another_layout(runs):
    for rank in runs:
        assert rank["migrated_pp2_from"] == 3
        steps, losses = zip(*rank["migrated_pp2"], strict=True)
        assert list(steps) == [4, 5, 6]
        assert list(losses) == pytest.approx(_after_step_3(rank["gpt_dense"]), rel=1e-5)


@pytest.mark.parametrize("layout", list(OTHER_LAYOUTS))
def test_a_hybrid_checkpoint_resumes_at_another_layout(runs, layout):
    for rank in runs:
        assert rank[f"{layout}_from"] == 3
        steps, losses = zip(*rank[layout], strict=True)
        assert list(steps) == [4, 5, 6]
        assert list(losses) == pytest.approx(_after_step_3(rank["hybrid"]), rel=1e-5)


def test_the_gpt_model_refuses_a_hybrid_checkpoint_in_one_line(runs):
    for rank in runs:
        error = rank["back_to_gpt_error"]
        assert "\n" not in error
        assert "was written by the hybrid model: resume it with model.architecture=hybrid" in error


def test_a_pattern_split_for_another_pipeline_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"has 2 pipeline segments .* but the layout has 1"):
        tiny_run_config(tmp_path, *PP2_PATTERN[:-1])
