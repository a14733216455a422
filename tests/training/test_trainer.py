"""The Trainer as an object: a skipped optimizer update (fp16 loss-scale overflow)
advances neither the iteration counter nor the learning-rate schedule."""

import json

import pytest
from helpers import ROOT, run_distributed

from megatron_lns.config import load_config, validate
from megatron_lns.training.attempt_recorder import ATTEMPT_EVENTS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_corpus_cache")]

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=64",
    "model.encoder_seq_length=16",
    "model.micro_batch_size=2",
    "model.global_batch_size=2",
    "model.data.splits_string=90,10,0",
    "model.optim.sched.warmup_steps=1",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=1",
]


def _fit_fp16(cfg):
    from megatron_lns.training.trainer import Trainer

    trainer = Trainer(cfg)
    summary = trainer.fit()
    return {
        "losses": summary.train_losses,
        "skipped": summary.skipped_steps,
        "iteration": trainer.state.iteration,
        "consumed": trainer.state.consumed_samples,
        "scheduler_steps": trainer.scheduler.num_steps,
    }


def test_skipped_fp16_updates_advance_neither_iteration_nor_schedule(tmp_path):
    cfg = load_config(
        DEMO,
        [
            *TINY,
            "trainer.precision=16-mixed",
            "trainer.max_steps=3",
            f"exp_manager.exp_dir={tmp_path}",
        ],
    )
    validate(cfg)
    result = run_distributed(_fit_fp16, 1, tmp_path, cfg)[0]
    # megatron's dynamic loss scale starts at 2**32: the scaled fp16 gradients of the
    # first steps overflow for certain, and the optimizer skips those updates.
    assert result["skipped"] > 0
    assert result["iteration"] == result["scheduler_steps"] == 3
    assert [step for step, _ in result["losses"]] == [1, 2, 3]
    assert result["consumed"] == (3 + result["skipped"]) * 2  # the data moved on regardless
    records = [json.loads(line) for line in (tmp_path / "lns" / "metrics.jsonl").open()]
    assert max(r.get("skipped_steps", 0) for r in records) == result["skipped"]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]


def _fit_with_gc_and_profile(cfg):
    import gc

    from megatron_lns.training.trainer import Trainer

    trainer = Trainer(cfg)
    collected_at, enabled_during_fit = [], []
    collect = gc.collect

    def counting_collect(*args):
        collected_at.append(trainer.state.iteration)
        enabled_during_fit.append(gc.isenabled())
        return collect(*args)

    gc.collect = counting_collect
    try:
        trainer.fit()
    finally:
        gc.collect = collect
    traces = sorted(p.name for p in (trainer.run_dir / "profile").iterdir())
    return collected_at, enabled_during_fit, gc.isenabled(), traces


def test_manual_gc_interval_and_profile_window_in_a_run(tmp_path):
    cfg = load_config(
        DEMO,
        [
            *TINY,
            "trainer.max_steps=5",
            "model.gc_interval=2",
            "model.nsys_profile.enabled=true",
            "model.nsys_profile.start_step=2",
            "model.nsys_profile.end_step=3",
            f"exp_manager.exp_dir={tmp_path}",
        ],
    )
    validate(cfg)
    collected_at, enabled, enabled_after, traces = run_distributed(
        _fit_with_gc_and_profile, 1, tmp_path, cfg
    )[0]
    # Once at the start of fit, then after steps 2 and 4; automatic GC off meanwhile.
    assert collected_at == [0, 2, 4]
    assert enabled == [False, False, False] and enabled_after
    assert traces == ["rank0_steps2-3.json"]


def _fit(cfg):
    """Train as ``megatron-lns train`` does: in the job its launcher started it in."""
    from megatron_lns.cluster import job_of_this_process
    from megatron_lns.training.trainer import Trainer

    Trainer(cfg, job=job_of_this_process()).fit()


def test_under_the_batch_script_the_run_records_its_progress_and_warns(
    tmp_path, monkeypatch, capfd
):
    """What the progress guard reads (cluster/slurm/progress.py), and the warning of a time limit
    that ends before the start-up does."""
    import time

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    # The batch script started 1000 s ago; the time limit is 10 minutes.
    monkeypatch.setenv("MEGATRON_LNS_BATCH_START", str(int(time.time()) - 1000))
    cfg = load_config(
        DEMO,
        [
            *TINY,
            "trainer.max_steps=4",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            "cluster.time_limit='10'",
            "cluster.preemption_signal_lead_s=60",
            f"exp_manager.exp_dir={tmp_path}",
        ],
    )
    validate(cfg)
    run_distributed(_fit, 1, tmp_path, cfg)
    all_lines = (tmp_path / "lns" / "run_progress").read_text().splitlines()
    accounting = [line for line in all_lines if line.split()[2] in ATTEMPT_EVENTS]
    lines = [line for line in all_lines if line not in accounting]
    assert [line.split()[:4] for line in lines] == [
        ["42", "1", "resumed", "0"],
        ["42", "1", "saved", "2"],
        ["42", "1", "warning", "-"],  # for the job log (the batch script repeats it)
        ["42", "1", "saved", "4"],
    ]
    assert int(lines[0].split()[4].removeprefix("startup_s=")) >= 1000
    assert lines[0].split()[5] == "every=2"
    # The goodput accounting (training/goodput.py), of SLURM's attempt: start-up from the
    # batch script's start; a line at each commit; the end.
    words = [line.split()[:4] for line in accounting]
    assert words[0] == ["42", "1", "began", "0"] and words[-1] == ["42", "1", "ended", "4"]
    # (a line every half minute as well, on a machine slow enough for one)
    assert {"2", "4"} <= {step for *_, event, step in words if event == "trained"}
    assert float(accounting[0].split()[5].removeprefix("startup_s=")) >= 1000
    assert "how=finished" in accounting[-1]
    out = capfd.readouterr().out
    # The periodic log line estimates the time left; the attempt ends with the goodput.
    assert "time_to_max_steps " in out
    assert "step 4 of 4" in out and "goodput " in out, out
    warnings = [line for line in out.splitlines() if "warning: " in line]
    assert len(warnings) == 1, out
    assert "warning: the time limit (600 s) minus cluster.preemption_signal_lead_s (60 s) is " \
        "shorter than the start-up" in warnings[0]  # fmt: skip
