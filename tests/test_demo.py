"""The side-by-side demo (``compare``'s default case) end to end: both variants train, loss
falls with clipping on, and the table, TensorBoard logs, results and plots are written."""

import json
import math
from pathlib import Path

import pytest
from helpers import ROOT, run_distributed

from megatron_lns.config import load_config, validate

pytestmark = pytest.mark.slow

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _demo(cfg, out):
    from megatron_lns.analysis.comparison import DEFAULT_VARIANTS, parse_variants, run_comparison

    comparison = run_comparison(cfg, parse_variants(DEFAULT_VARIANTS), 1, Path(out))
    return [(variant.label, comparison.results[variant.name][0]) for variant in comparison.variants]


@pytest.mark.long
def test_demo_trains_both_arms_and_writes_its_outputs(tmp_path, private_corpus_cache, capfd):
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
            "trainer.log_every_n_steps=10",
            "trainer.gradient_clip_val=0.5",
            "model.optim.sched.warmup_steps=5",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=20",
        ],
    )
    validate(cfg)
    out = tmp_path / "demo"
    arms = run_distributed(_demo, 1, tmp_path, cfg, str(out))[0]
    printed = capfd.readouterr().out
    assert [label for label, _ in arms] == ["LNS", "Pre-LN"]
    for name in ("lns", "pre_ln"):
        run_dir = out / name / "seed1234"
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in records if "loss" in r]
        assert len(losses) == 40  # every step's loss, though the console logs every 10th
        assert sum(losses[-5:]) / 5 < losses[0] - 1.0, name
        norms = [r["grad_norm"] for r in records if "grad_norm" in r]
        assert max(norms) > 0.5  # clipping at 0.5 was active
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
        result = json.loads((run_dir / "compare_result.json").read_text())
        assert math.isfinite(result["held_out_loss"]) and result["held_out_loss"] < losses[0]
        assert result["held_out_loss"] == [r["val_loss"] for r in records if "val_loss" in r][-1]
        stats = result["layer_stats"]
        assert [s["layer_number"] for s in stats] == [1, 2, 3, 4]
        assert all(0 < s["angular_distance"] < 1 and s["output_variance"] > 0 for s in stats)
    for png in ("loss_curves.png", "depth_profiles.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    table = (out / "comparison.md").read_text()
    assert "| LNS | 1 | 0 |" in table and "| Pre-LN | 1 | 0 |" in table
    assert "var growth L/1" in printed and "held-out loss" in printed
    assert "One seed is not a verdict" in printed
