"""Checkpoints of mixture-of-experts runs through the trainer: a run stopped and resumed at
EP=2 repeats the uninterrupted run bit for bit, and its checkpoint resumes at TP=2
(weights and the distributed optimizer's state resharded) and at EP=1 and back (the
optimizer state regrouped between one part and two).

One spawn of two ranks runs every training: the tiny model with a dense first layer and
three MoE layers (megatron files mixed layers under per-layer checkpoint keys), the
alltoall dispatcher, the distributed optimizer.
"""

from pathlib import Path

import pytest
from helpers import TINY_MOE_OVERRIDES, logged_losses, worker_results

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.usefixtures("private_corpus_cache")]

MOE_RUN = ["trainer.devices=2", *TINY_MOE_OVERRIDES]
EP2 = ["model.expert_model_parallel_size=2"]
# The layouts an EP=2 checkpoint is resumed at: the same two ranks as TP=2 with whole
# experts (expert TP 1), so the weights, dense and expert, and the optimizer's state are
# resharded.
OTHER_LAYOUTS = {
    "tp2_etp1": [
        "model.tensor_model_parallel_size=2",
        "model.sequence_parallel=true",
        *EP2,
        "model.expert_tensor_parallel_size=1",
    ],
}


def _local_parameters(trainer) -> dict:
    return {
        f"{i}.{name}": param.detach().clone()
        for i, chunk in enumerate(trainer.model)
        for name, param in chunk.module.named_parameters()
    }


def _train_stop_resume(tmp: str) -> dict:
    from helpers import tiny_run_config

    from megatron_lns.training.trainer import Trainer

    root = Path(tmp)
    straight = Trainer(tiny_run_config(root / "straight", *MOE_RUN, *EP2))
    straight.fit()
    Trainer(tiny_run_config(root / "resumed", *MOE_RUN, *EP2, "trainer.exit_interval=3")).fit()
    resumed = Trainer(tiny_run_config(root / "resumed", *MOE_RUN, *EP2))
    summary = resumed.fit()
    out = {
        "resumed_from": summary.resumed_from,
        "straight": logged_losses(root / "straight" / "lns"),
        "resumed": logged_losses(root / "resumed" / "lns"),
        "straight_params": _local_parameters(straight),
        "resumed_params": _local_parameters(resumed),
    }
    checkpoint = root / "straight" / "lns" / "checkpoints" / "iter_0000003"
    for name, layout in OTHER_LAYOUTS.items():
        resume = f"exp_manager.resume_from_checkpoint={checkpoint}"
        other = Trainer(tiny_run_config(root / name, *MOE_RUN, *layout, resume))
        out[f"{name}_resumed_from"] = other.fit().resumed_from
        out[name] = logged_losses(root / name / "lns")
    # EP=2 -> EP=1 (DP=2, expert TP == TP: one optimizer) for step 4, then back to EP=2
    # (two: dense and experts) for steps 5 and 6: the optimizer state regrouped each way.
    resume = f"exp_manager.resume_from_checkpoint={checkpoint}"
    ep1 = Trainer(tiny_run_config(root / "ep1", *MOE_RUN, resume, "trainer.exit_interval=4"))
    out["ep1_parts"] = len(getattr(ep1.optimizer, "chained_optimizers", [0]))
    out["ep1_resumed_from"] = ep1.fit().resumed_from
    ep2 = Trainer(tiny_run_config(root / "ep1", *MOE_RUN, *EP2))
    out["ep1_ep2_parts"] = len(ep2.optimizer.chained_optimizers)
    out["ep1_ep2_resumed_from"] = ep2.fit().resumed_from
    out["ep1_ep2"] = logged_losses(root / "ep1" / "lns")
    out["ep1_ep2_adam_steps"] = sorted(
        {
            int(state["step"])
            for part in ep2.optimizer.chained_optimizers
            for state in part.optimizer.state.values()
        }
    )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return worker_results(tmp_path_factory, "moe_checkpoint", _train_stop_resume, 2)


def test_an_ep2_moe_run_resumes_bitwise(runs):
    for rank in runs:
        assert rank["resumed_from"] == 3
        assert [step for step, _ in rank["straight"]] == list(range(1, 7))
        assert rank["resumed"] == rank["straight"]
        params = rank["straight_params"]
        assert any(".experts." in name for name in params)
        assert rank["resumed_params"].keys() == params.keys()
        for name, value in rank["resumed_params"].items():
            assert value.equal(params[name]), name


@pytest.mark.parametrize("layout", list(OTHER_LAYOUTS))
def test_an_ep2_checkpoint_resumes_at_another_layout(runs, layout):
    for rank in runs:
        assert rank[f"{layout}_resumed_from"] == 3
        steps, losses = zip(*rank[layout], strict=True)
        expected = [loss for step, loss in rank["straight"] if step > 3]
        assert list(steps) == [4, 5, 6]
        assert list(losses) == pytest.approx(expected, rel=1e-4)


def test_an_ep2_checkpoint_resumes_at_ep1_and_back_with_its_optimizer_state(runs):
    """The two-part optimizer state (dense, experts) of EP=2 loads into EP=1's one part
    and back: every Adam moment by its parameter's key, the step and the param groups, so
    the losses after each switch are the uninterrupted run's."""
    for rank in runs:
        assert (rank["ep1_parts"], rank["ep1_ep2_parts"]) == (1, 2)
        assert (rank["ep1_resumed_from"], rank["ep1_ep2_resumed_from"]) == (3, 4)
        steps, losses = zip(*rank["ep1_ep2"], strict=True)
        expected = [loss for step, loss in rank["straight"] if step > 3]
        assert list(steps) == [4, 5, 6]
        assert list(losses) == pytest.approx(expected, rel=1e-4)
        assert rank["ep1_ep2_adam_steps"] == [6]
