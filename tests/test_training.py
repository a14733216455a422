"""Short training runs: loss goes down with clipping on; the demo works at PP=2."""

import math

import pytest
from helpers import run_distributed

from megatron_lns.demo import DemoSettings, run_demo
from megatron_lns.runtime import ParallelLayout
from megatron_lns.training.optim import OptimSettings

pytestmark = pytest.mark.slow


def _tiny_demo(layout=ParallelLayout(), steps=40) -> DemoSettings:
    return DemoSettings(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        seq_length=64,
        micro_batch_size=4,
        num_microbatches=2,
        steps=steps,
        eval_batches=2,
        log_every=1,
        optim=OptimSettings(lr=3e-3, min_lr=3e-4, warmup_steps=min(5, steps - 1), clip_grad=0.5),
        layout=layout,
    )


def test_short_run_lowers_loss_with_clipping(megatron_world1, capsys):
    results = run_demo(_tiny_demo())
    logged = capsys.readouterr().out
    first = float(logged.split("step     1  loss ")[1].split()[0])
    for arm in results:
        assert arm.train_loss < first - 1.0, (arm.name, first, arm.train_loss)
        assert math.isfinite(arm.valid_loss) and arm.valid_loss < first
        assert [s.layer_number for s in arm.layer_stats] == [1, 2, 3, 4]
    # Clipping was active at least once early in training (grad norm above the 0.5 bound).
    norms = [float(x.split()[0]) for x in logged.split("grad_norm ")[1:]]
    assert max(norms) > 0.5


def _demo_worker(settings):
    results = run_demo(settings)
    return [(r.name, r.valid_loss, [s.layer_number for s in r.layer_stats]) for r in results]


def test_demo_runs_pipeline_parallel(tmp_path):
    results = run_distributed(_demo_worker, 2, tmp_path, _tiny_demo(ParallelLayout(pipeline=2), 5))
    assert results[0] == results[1]  # every rank reports the same table
    for name, valid_loss, layers in results[0]:
        assert layers == [1, 2, 3, 4], name
        assert math.isfinite(valid_loss)
