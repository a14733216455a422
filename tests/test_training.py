"""The side-by-side demo end to end: both arms train, loss falls with clipping on,
and the summary, TensorBoard logs and loss-curve PNG are written."""

import json
import math
from pathlib import Path

import pytest
from helpers import run_distributed

from megatron_lns.config import load_config, validate

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[1] / "nemo_configs" / "tiny_cpu_demo.yaml"


def _demo(cfg):
    from megatron_lns.demo import run_demo

    results = run_demo(cfg, stamp="test")
    return [
        (
            arm.label,
            arm.summary.train_losses,
            arm.summary.valid_loss,
            [s.layer_number for s in arm.layer_stats],
        )
        for arm in results
    ]


def test_demo_trains_both_arms_and_writes_its_outputs(
    tmp_path, tmp_path_factory, monkeypatch, capfd
):
    monkeypatch.setenv("MEGATRON_LNS_CACHE", str(tmp_path_factory.getbasetemp() / "corpus_cache"))
    cfg = load_config(
        DEMO,
        [
            "model.num_layers=4",
            "model.hidden_size=64",
            "model.ffn_hidden_size=128",
            "model.encoder_seq_length=64",
            "trainer.max_steps=40",
            "trainer.val_check_interval=20",
            "trainer.limit_val_batches=2",
            "trainer.log_every_n_steps=1",
            "trainer.gradient_clip_val=0.5",
            "model.optim.sched.warmup_steps=5",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=20",
            f"exp_manager.exp_dir={tmp_path}",
        ],
    )
    validate(cfg)
    arms = run_distributed(_demo, 1, tmp_path, cfg)[0]
    out = capfd.readouterr().out
    assert [label for label, *_ in arms] == ["LNS", "Pre-LN"]
    for label, losses, valid_loss, layers in arms:
        values = [loss for _, loss in losses]
        assert len(values) == 40
        assert sum(values[-5:]) / 5 < values[0] - 1.0, label
        assert math.isfinite(valid_loss) and valid_loss < values[0]
        assert layers == [1, 2, 3, 4]
    run_root = tmp_path / "test"
    for arm in ("lns", "preln"):
        records = [
            json.loads(x) for x in (run_root / arm / "metrics.jsonl").read_text().splitlines()
        ]
        norms = [r["grad_norm"] for r in records if "grad_norm" in r]
        assert max(norms) > 0.5  # clipping at 0.5 was active
        assert list((run_root / arm / "tensorboard").glob("events.out.tfevents.*"))
        stats = json.loads((run_root / arm / "layer_stats.json").read_text())
        assert [s["layer_number"] for s in stats] == [1, 2, 3, 4]
        assert all(0 < s["angular_distance"] < 1 and s["output_variance"] > 0 for s in stats)
    png = run_root / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "var growth L/1" in out and "held-out loss" in out
