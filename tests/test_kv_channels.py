"""model.kv_channels end to end: a run whose head size is not hidden_size / heads trains
from YAML at TP=1 and TP=2 with the same loss curve."""

import math
import time

import pytest
from helpers import run_distributed, tiny_run_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_corpus_cache")]

# Six 16-channel heads (96 wide) in 2 query groups over a 64-wide residual stream: 64 does
# not divide by 6, so only kv_channels makes this model valid.
HEAD_SIZE = ["model.num_attention_heads=6", "model.num_query_groups=2", "model.kv_channels=16"]


def _train(cfg):
    from megatron.core import parallel_state

    from megatron_lns.model.language_model import unwrap
    from megatron_lns.training.trainer import Trainer

    trainer = Trainer(cfg)
    summary = trainer.fit()
    attention = unwrap(trainer.model[0]).decoder.layers[0].self_attention
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return {
        "losses": [loss for _, loss in summary.train_losses],
        "head_size": attention.hidden_size_per_attention_head,
        "qkv_rows": attention.linear_qkv.weight.shape[0] * tp,
        "proj_columns": attention.linear_proj.weight.shape[1] * tp,
    }


def _run(tmp_path, *overrides):
    cfg = tiny_run_config(tmp_path, *HEAD_SIZE, *overrides)
    world = cfg.trainer.devices
    return run_distributed(_train, world, tmp_path / f"r{time.monotonic_ns()}", cfg)[0]


def test_head_size_model_trains_at_tp1_and_tp2_alike(tmp_path):
    tp1 = _run(tmp_path / "tp1")
    tp2 = _run(tmp_path / "tp2", "trainer.devices=2", "model.tensor_model_parallel_size=2")
    for result in (tp1, tp2):
        assert result["head_size"] == 16
        assert result["qkv_rows"] == (6 + 2 * 2) * 16 and result["proj_columns"] == 6 * 16
        losses = result["losses"]
        assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0]
    assert tp2["losses"] == pytest.approx(tp1["losses"], rel=1e-4)
