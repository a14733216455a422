"""Stopping, failing and resuming runs: nothing hangs, nothing is lost, each problem is
named in one line."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import DEMO_CONFIG as DEMO
from helpers import (
    ROOT,
    TINY_RUN_OVERRIDES,
    fresh_launch_env,
    run_distributed,
    still_running,
    tiny_run_config,
    wait_while_running,
)

from megatron_lns.training.checkpoint import latest_complete_checkpoint
from megatron_lns.training.run_report import run_report

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_corpus_cache")]


def _fit(cfg, poison=None):
    """Train; returns the summary's essentials, or the one-line error of a UserError."""
    import torch

    from megatron_lns.base.errors import UserError
    from megatron_lns.training.trainer import Trainer

    try:
        trainer = Trainer(cfg)
        if poison is not None:  # make every step's loss and gradients non-finite
            with torch.no_grad():
                next(trainer.model[0].parameters()).fill_(poison)
        summary = trainer.fit()
    except UserError as err:
        return {"error": str(err)}
    return {
        "losses": summary.train_losses,
        "resumed_from": summary.resumed_from,
        "steps": summary.steps,
        "skipped": summary.skipped_steps,
        "lrs": [r["lr"] for r in _metrics(summary.run_dir) if "lr" in r],
    }


def _metrics(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path, cfg, **kwargs):
    return run_distributed(
        _fit, 1, tmp_path / f"r{time.monotonic_ns()}", cfg, kwargs.get("poison")
    )[0]


def test_nan_loss_stops_the_run_before_its_next_checkpoint(tmp_path):
    result = _run(tmp_path, tiny_run_config(tmp_path, "trainer.precision=32"), poison=float("nan"))
    assert result["error"].startswith("step 1: loss nan, gradient norm nan: the run diverged")
    assert latest_complete_checkpoint(tmp_path / "lns" / "checkpoints") is None


def test_a_nan_validation_loss_stops_the_run_before_the_checkpoint_of_its_step(tmp_path):
    # The update of step 2 (lr 5e29, no clipping) makes the weights non-finite: step 2's
    # training loss was taken before it, its validation loss after.
    cfg = tiny_run_config(
        tmp_path,
        "model.optim.lr=1e30",
        "trainer.gradient_clip_val=0",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
    )
    result = _run(tmp_path, cfg)
    assert result["error"].startswith("step 2: validation loss nan: the run diverged")
    assert latest_complete_checkpoint(tmp_path / "lns" / "checkpoints") is None
    # Its goodput: an attempt that failed, whose two steps a rerun trains again.
    (attempt,) = run_report(tmp_path / "lns").goodput.attempts
    assert (attempt.how, attempt.last_step, attempt.lost_steps) == ("failed", 2, 2)


@pytest.mark.long
def test_an_fp16_run_whose_updates_are_all_skipped_stops(tmp_path):
    cfg = tiny_run_config(tmp_path, "trainer.precision=16-mixed", "trainer.max_steps=200")
    result = _run(tmp_path, cfg, poison=float("inf"))
    assert result["error"].startswith("the last 50 optimizer updates after step 0 were all skipped")


def test_unreadable_newest_checkpoint_is_named_or_skipped_when_asked(tmp_path, straight_tiny_run):
    _run(tmp_path, tiny_run_config(tmp_path, "trainer.exit_interval=5",
                           "exp_manager.checkpoint_callback_params.every_n_train_steps=2"))  # fmt: skip
    newest = latest_complete_checkpoint(tmp_path / "lns" / "checkpoints")
    assert newest.name == "iter_0000005"
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated

    failed = _run(tmp_path, tiny_run_config(tmp_path))
    assert failed["error"].startswith(f"could not load checkpoint {newest}: ")
    assert "Traceback" not in failed["error"] and "\n" not in failed["error"]

    resumed = _run(tmp_path, tiny_run_config(tmp_path, "exp_manager.resume_past_unreadable=true"))
    assert resumed["resumed_from"] == 4
    assert resumed["losses"] == straight_tiny_run["losses"][4:]
    # The skipped checkpoint is kept, out of the way, not overwritten or picked again.
    checkpoints = tmp_path / "lns" / "checkpoints"
    assert [p.name for p in checkpoints.glob("abandoned-*-from-iter_0000004/*")] == [newest.name]
    assert latest_complete_checkpoint(checkpoints).name == "iter_0000006"


def test_resume_from_a_chosen_checkpoint(tmp_path, straight_tiny_run):
    # A checkpoint of another run directory, which is not the newest there.
    chosen = straight_tiny_run["run_dir"] / "checkpoints" / "iter_0000003"
    other = _run(
        tmp_path,
        tiny_run_config(tmp_path / "other", f"exp_manager.resume_from_checkpoint={chosen}"),
    )
    assert other["resumed_from"] == 3
    assert other["losses"] == straight_tiny_run["losses"][3:]
    missing = _run(
        tmp_path, tiny_run_config(tmp_path / "x", "exp_manager.resume_from_checkpoint=/nope")
    )
    assert missing["error"].startswith(
        "exp_manager.resume_from_checkpoint: /nope is not a complete"
    )


def test_a_run_directory_given_for_the_checkpoint_says_what_to_give(tmp_path, straight_tiny_run):
    """It said "has no complete.json: its save never finished" of a run directory and of
    its checkpoints/: neither is a checkpoint, none of their saves was cut short."""
    from megatron_lns.training.checkpoint_dirs import CheckpointError
    from megatron_lns.training.resume import checkpoints_to_try

    run = straight_tiny_run["run_dir"]
    newest = run / "checkpoints" / "iter_0000006"
    resume_the_run = (
        "; or, to resume that run from its newest checkpoint, leave "
        f"exp_manager.resume_from_checkpoint unset and give exp_manager.exp_dir={run.parent} "
        f"exp_manager.name={run.name}"
    )
    for given, what in [
        (run, "a run directory"),
        (run / "checkpoints", "a directory of checkpoints"),
    ]:
        cfg = tiny_run_config(tmp_path, f"exp_manager.resume_from_checkpoint={given}")
        with pytest.raises(CheckpointError) as refused:
            checkpoints_to_try(cfg, tmp_path / "lns" / "checkpoints")
        assert str(refused.value) == (
            f"exp_manager.resume_from_checkpoint: {given} is {what}, not a checkpoint: give one "
            f"of the iter_NNNNNNN directories in {run / 'checkpoints'} (the newest complete one "
            f"is {newest})" + resume_the_run
        )


def test_a_changed_schedule_is_refused_on_resume_unless_overridden(tmp_path):
    _run(tmp_path, tiny_run_config(tmp_path, "trainer.exit_interval=3"))
    refused = _run(
        tmp_path, tiny_run_config(tmp_path, "model.optim.lr=5e-3", "trainer.max_steps=8")
    )
    assert (
        "was trained with another LR schedule (model.optim.lr: 0.002 -> 0.005" in refused["error"]
    )
    assert "trainer.max_steps - model.optim.sched.constant_steps: 6 -> 8" in refused["error"]
    assert "exp_manager.override_opt_param_scheduler=true" in refused["error"]

    overridden = _run(tmp_path, tiny_run_config(tmp_path, "model.optim.lr=5e-3", "trainer.max_steps=8",
                                        "exp_manager.override_opt_param_scheduler=true"))  # fmt: skip
    assert overridden["resumed_from"] == 3 and overridden["steps"] == 8
    assert [s for s, _ in overridden["losses"]] == [4, 5, 6, 7, 8]
    # The new schedule from step 4: cosine from 5e-3 (warmup 2 is over) to min_lr 2e-4.
    fresh = _run(
        tmp_path, tiny_run_config(tmp_path / "fresh", "model.optim.lr=5e-3", "trainer.max_steps=8")
    )
    assert overridden["lrs"][-5:] == pytest.approx(fresh["lrs"][-5:], rel=1e-12)


def test_a_resume_with_another_layer_variant_names_the_key(tmp_path):
    """It was a kilobyte of megatron's internal tensor names (a raw KeyError of
    ``apply_factory_merges`` from Mix-LN's per-layer keys), or the first tensor that did
    not fit; the config key that changed is what the user can act on."""
    variant = ("model.norm_scaling=none", "trainer.exit_interval=3")
    _run(tmp_path, tiny_run_config(tmp_path, *variant, "model.layer_variant=mix_ln"))
    for other in ("pre_ln", "layerscale"):
        refused = _run(
            tmp_path, tiny_run_config(tmp_path, *variant, f"model.layer_variant={other}")
        )
        assert refused["error"] == (
            f"checkpoint {tmp_path / 'lns' / 'checkpoints' / 'iter_0000003'} was written by "
            f"another model (model.layer_variant: mix_ln -> {other}): a run resumes with the "
            "model it trained; restore those values, or start a new run (another "
            "exp_manager.name)"
        )


def _resume_step_3(tmp_path, straight_tiny_run, *overrides):
    """The straight tiny run resumed from its step-3 checkpoint with ``overrides``, in a
    run directory of its own."""
    chosen = straight_tiny_run["run_dir"] / "checkpoints" / "iter_0000003"
    resume = f"exp_manager.resume_from_checkpoint={chosen}"
    return _run(tmp_path, tiny_run_config(tmp_path / "other", resume, *overrides))


@pytest.mark.parametrize("changed", ["model.optim.eps=0.5", "model.optim.betas=[0.5,0.9]"])
def test_a_resume_trains_with_the_configured_betas_and_eps(tmp_path, straight_tiny_run, changed):
    """The checkpoint's param groups held the old values and overwrote the config's, so
    the resumed run repeated the old one's losses bit for bit."""
    resumed = _resume_step_3(tmp_path, straight_tiny_run, changed)
    assert resumed["resumed_from"] == 3
    # Step 4's loss comes before its update; the updates after it are the new optimizer's.
    assert resumed["losses"][0] == straight_tiny_run["losses"][3]
    assert resumed["losses"][1][1] != straight_tiny_run["losses"][4][1]


def test_a_resume_with_another_model_or_optimizer_state_is_refused_by_name(
    tmp_path, straight_tiny_run
):
    """Another head count fits the same tensors and trained another model without a word;
    another optimizer crashed in megatron or failed naming no key, and a run allowed to pass
    unreadable checkpoints passed these valid ones over and set them aside."""
    shutil.copytree(straight_tiny_run["run_dir"], tmp_path / "lns")
    checkpoints = tmp_path / "lns" / "checkpoints"
    newest = checkpoints / "iter_0000006"
    past = "exp_manager.resume_past_unreadable=true"
    refusals = {
        "model.num_attention_heads=2": "by another model (model.num_attention_heads: 4 -> 2)",
        "model.optim.name=sgd": "with another optimizer state (model.optim.name: adamw -> sgd)",
        "trainer.precision=bf16": "with another optimizer state (trainer.precision: 32 -> bf16)",
    }
    for override, named in refusals.items():
        refused = _run(tmp_path, tiny_run_config(tmp_path, past, override))
        assert refused["error"].startswith(f"checkpoint {newest} was written {named}: ")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_0000003", "iter_0000006"]
    # Another name of the same megatron optimizer is no change.
    assert (
        _resume_step_3(tmp_path, straight_tiny_run, "model.optim.name=adam")["losses"]
        == (straight_tiny_run["losses"][3:])
    )


def test_a_checkpoint_whose_config_is_unreadable_is_damaged_in_one_line(
    tmp_path, straight_tiny_run
):
    """Resume's setting checks read the checkpoint's config.yaml unguarded: YAML that does
    not parse, or is not UTF-8, ended in a traceback; a list was compared with nothing."""
    shutil.copytree(straight_tiny_run["run_dir"], tmp_path / "lns")
    newest = tmp_path / "lns" / "checkpoints" / "iter_0000006"
    damaged = f"checkpoint {newest} is damaged: config file {newest / 'config.yaml'}"
    for text, problem in (
        (b"model: [\n", ": line 2, column 1: expected the node content"),
        (b"\xff\xfe", " is not UTF-8 text"),
        (b"- 1\n", " must be a mapping with the settings the checkpoint was written with"),
    ):
        (newest / "config.yaml").write_bytes(text)
        error = _run(tmp_path, tiny_run_config(tmp_path))["error"]
        assert error.startswith(damaged + problem) and "\n" not in error, error


def test_a_refused_resume_leaves_the_last_runs_config_and_status(tmp_path, straight_tiny_run):
    """The refused start had replaced config.yaml with its own config and removed
    run_status: `status` contradicted itself, and `train RUN_DIR` took up the refused
    settings."""
    shutil.copytree(straight_tiny_run["run_dir"], tmp_path / "lns")
    run = tmp_path / "lns"
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "run_status")}
    assert before["run_status"] == b"finished 6\n"
    refused = _run(tmp_path, tiny_run_config(tmp_path, "trainer.precision=bf16"))
    assert "with another optimizer state (trainer.precision: 32 -> bf16)" in refused["error"]
    assert {name: (run / name).read_bytes() for name in before} == before
    assert not (run / ".lock").exists()


def test_another_sequence_length_is_refused_as_changed_data_or_counted(tmp_path, straight_tiny_run):
    """The samples after the resume are cut at the new length: refused as changed data
    is, naming the key; with the override, ``status`` counts each stretch's tokens at the
    length it was trained at (it counted every sample at the last length)."""
    shutil.copytree(straight_tiny_run["run_dir"], tmp_path / "lns")
    step3 = tmp_path / "lns" / "checkpoints" / "iter_0000003"
    shorter = (f"exp_manager.resume_from_checkpoint={step3}", "model.encoder_seq_length=16")
    refused = _run(tmp_path, tiny_run_config(tmp_path, *shorter))
    assert refused["error"].startswith(
        f"checkpoint {step3} was written with other samples (model.encoder_seq_length: 32 -> 16"
    )
    assert "exp_manager.resume_with_changed_data=true" in refused["error"]
    reseeded = _run(tmp_path, tiny_run_config(tmp_path, "model.seed=7"))
    assert "(model.seed: 1234 -> 7)" in reseeded["error"]

    allowed = "exp_manager.resume_with_changed_data=true"
    assert _run(tmp_path, tiny_run_config(tmp_path, *shorter, allowed))["resumed_from"] == 3
    assert run_report(tmp_path / "lns").tokens == 12 * 32 + 12 * 16  # 4 samples a step


def test_a_resume_with_nothing_left_to_do_says_so_and_writes_nothing(tmp_path, capfd):
    _run(tmp_path, tiny_run_config(tmp_path))
    final = tmp_path / "lns" / "checkpoints" / "iter_0000006"
    before = final.stat().st_mtime_ns
    again = _run(tmp_path, tiny_run_config(tmp_path))
    assert again["steps"] == 6 and again["losses"] == []
    out = capfd.readouterr().out
    assert "nothing to do:" in out
    assert "was written" not in out and "provenance" not in out  # same run: nothing to report
    assert final.stat().st_mtime_ns == before


def _cli(*args, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_lns.cli", *args],
        cwd=ROOT,
        env=fresh_launch_env(MEGATRON_LNS_CACHE=os.environ["MEGATRON_LNS_CACHE"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.mark.parametrize("lost", ["metadata.json", ".metadata"])
def test_a_committed_checkpoint_that_lost_a_file_is_named_not_passed_over(
    tmp_path, straight_tiny_run, lost
):
    """Passed over, the run would resume from iter_3 and its save of step 6 would delete
    the damaged iter_6; read, torch printed its tracebacks before the one line."""
    shutil.copytree(straight_tiny_run["run_dir"], tmp_path / "lns")
    damaged = tmp_path / "lns" / "checkpoints" / "iter_0000006"
    (damaged / lost).unlink()
    train = ["train", str(DEMO), *TINY_RUN_OVERRIDES, f"exp_manager.exp_dir={tmp_path}"]
    out, err = _cli(*train, "trainer.max_steps=9").communicate(timeout=600)
    assert err.splitlines() == [
        f"error: checkpoint {damaged} is damaged: {lost} missing; set "
        "exp_manager.resume_past_unreadable=true to resume from the newest one before it "
        "(this one is then moved aside, kept)"
    ], err
    assert (damaged / "complete.json").is_file() and "resumed from" not in out


_PAST_UNREADABLE = (
    "; set exp_manager.resume_past_unreadable=true to resume from the newest one before it "
    "(this one is then moved aside, kept)"
)


@pytest.mark.parametrize(
    "damaged_file, train_says, analyze_says",
    [
        (
            ".metadata",
            "could not load checkpoint {}: its .metadata (the index of its shards) cannot be "
            "read: pickle data was truncated",
            None,  # as train says
        ),
        (
            "__0_0.distcp",
            r"could not load checkpoint {}: its shard __0_0.distcp is truncated \(1000 bytes "
            r"of at least \d+\)",
            None,
        ),
        (
            "complete.json",
            "checkpoint {} is damaged: complete.json is not valid JSON (Expecting value: line 1 "
            "column 1 (char 0))",
            "{} is not a complete checkpoint: it is damaged: complete.json is not valid JSON "
            "(Expecting value: line 1 column 1 (char 0))",
        ),
    ],
    ids=["index", "shard", "marker"],
)
def test_a_checkpoint_with_a_damaged_file_is_refused_by_train_and_analyze_in_one_line(
    tmp_path, straight_tiny_run, damaged_file, train_says, analyze_says
):
    """torch logged two tracebacks of a truncated .metadata before the error; analyze's
    error carried torch's page of traceback; a truncated shard was ``EOFError: Ran out of
    input``, naming no file, without the way past it; and analyze used the checkpoint
    whose complete.json train refused."""
    shutil.copytree(straight_tiny_run["run_dir"], tmp_path / "lns")
    damaged = tmp_path / "lns" / "checkpoints" / "iter_0000006"
    if damaged_file == "complete.json":
        (damaged / damaged_file).write_text("garbage{")
    else:
        os.truncate(damaged / damaged_file, 100 if damaged_file == ".metadata" else 1000)
    train = ["train", str(DEMO), *TINY_RUN_OVERRIDES, f"exp_manager.exp_dir={tmp_path}"]
    _, err = _cli(*train, "trainer.max_steps=9").communicate(timeout=600)
    train_says = train_says.format(damaged)
    if damaged_file == "__0_0.distcp":
        [line] = err.splitlines()
        assert re.fullmatch("error: " + train_says + re.escape(_PAST_UNREADABLE), line), err
    else:
        assert err.splitlines() == ["error: " + train_says + _PAST_UNREADABLE], err
    out_dir = tmp_path / "analysis"
    analysis = _cli("analyze", str(tmp_path / "lns"), "--out", str(out_dir), "--no-prune")
    _, err = analysis.communicate(timeout=600)
    [line] = err.splitlines()
    if damaged_file == "__0_0.distcp":
        assert re.fullmatch("error: " + train_says, line), err
    else:
        assert line == "error: " + (analyze_says or train_says).format(damaged), err
    assert not out_dir.exists()


@pytest.mark.long
def test_sigterm_stops_both_ranks_of_a_local_run_which_then_resumes_bitwise(tmp_path):
    two_ranks = ["trainer.devices=2", "model.tensor_model_parallel_size=2", "trainer.max_steps=40",
                 "exp_manager.checkpoint_callback_params.every_n_train_steps=100"]  # fmt: skip
    overrides = [*TINY_RUN_OVERRIDES, *two_ranks]
    straight = _cli("train", str(DEMO), *overrides, f"exp_manager.exp_dir={tmp_path / 'straight'}")
    assert straight.wait(timeout=600) == 0, straight.stderr.read()

    run = [*overrides, f"exp_manager.exp_dir={tmp_path}"]
    launcher = _cli("train", str(DEMO), *run)
    metrics = tmp_path / "lns" / "metrics.jsonl"
    wait_while_running(
        launcher, lambda: metrics.is_file() and metrics.read_text().strip(), 300, "no step logged"
    )
    ranks = psutil.Process(launcher.pid).children(recursive=True)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 0, launcher.stderr.read()
    assert "stopping at step" in launcher.stdout.read()
    assert not still_running(ranks)

    stopped_at = int(latest_complete_checkpoint(tmp_path / "lns" / "checkpoints").name[5:])
    assert 1 <= stopped_at < 40
    resumed = _cli("train", str(DEMO), *run)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    losses = [(r["step"], r["loss"]) for r in _metrics(tmp_path / "lns") if "loss" in r]
    expected = [
        (r["step"], r["loss"]) for r in _metrics(tmp_path / "straight" / "lns") if "loss" in r
    ]
    assert losses == expected  # bitwise, and no step logged twice
    # Where the run's time went (megatron-lns status): two attempts, the first stopped
    # cleanly (nothing lost), each with its start-up from the launcher's start.
    report = run_report(tmp_path / "lns")
    attempts = report.goodput.attempts
    assert [(a.how, a.first_step, a.last_step) for a in attempts] == [
        ("stopped", 0, stopped_at), ("finished", stopped_at, 40),
    ]  # fmt: skip
    assert all(a.startup_s > 0 for a in attempts) and attempts[1].load_s > 0
    assert report.goodput.rows["lost work"] == 0 and min(report.goodput.rows.values()) >= 0
    assert "goodput " in resumed.stdout.read()


@pytest.mark.long
def test_a_user_error_in_every_rank_is_reported_once(tmp_path):
    cli = _cli("train", str(DEMO), *TINY_RUN_OVERRIDES, "trainer.devices=2", f"exp_manager.exp_dir={tmp_path}",
               "exp_manager.resume_from_checkpoint=/no/such/iter_0000003")  # fmt: skip
    assert cli.wait(timeout=300) == 2
    err = cli.stderr.read()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == ["error: exp_manager.resume_from_checkpoint: /no/such/iter_0000003 is not a "
                     "complete checkpoint (an iter_NNNNNNN directory with complete.json): it "
                     "does not exist"]  # fmt: skip
    assert "Traceback" not in err
    assert "in-job restart" not in err  # a restart would only repeat it


def _record_pid_and_wait_forever(directory):
    Path(directory, f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)


@pytest.mark.long
def test_ranks_that_outlive_the_timeout_are_killed_and_reported(tmp_path):
    from megatron_lns.runtime import RanksTimedOut, spawn_local

    # The ranks must import torch and write their pids within the timeout: on a loaded
    # 2-core CI machine that took more than 20 s (a CI run failed with no pid files).
    start = time.monotonic()
    with pytest.raises(RanksTimedOut, match=r"^2 rank\(s\) still running after 45 s; killed$"):
        spawn_local(_record_pid_and_wait_forever, 2, str(tmp_path), timeout_s=45)
    assert time.monotonic() - start < 200
    pids = [int(path.read_text()) for path in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_a_save_the_previous_run_did_not_finish_is_reported_at_the_next_start(tmp_path):
    """A run killed while saving cannot say so; the next one does, naming what it loads."""
    from megatron_lns.training.resume import interrupted_save_note

    assert interrupted_save_note(tmp_path / "none", None) is None
    (tmp_path / "iter_0000004").mkdir()
    assert interrupted_save_note(tmp_path, tmp_path / "iter_0000004") is None
    (tmp_path / "iter_0000002.partial").mkdir()  # older than what is loaded: not news
    assert interrupted_save_note(tmp_path, tmp_path / "iter_0000004") is None
    (tmp_path / "iter_0000008.partial").mkdir()
    assert interrupted_save_note(tmp_path, tmp_path / "iter_0000004") == (
        "the previous run was killed while saving iter_0000008 (left as "
        "iter_0000008.partial, never loaded); resuming from iter_0000004, the newest "
        "complete checkpoint"
    )
    assert "starting from scratch" in interrupted_save_note(tmp_path, None)


def test_a_rewind_sets_the_abandoned_branch_aside_where_no_resume_picks_it(tmp_path, capfd):
    straight = _run(tmp_path, tiny_run_config(tmp_path))  # iter_3, iter_6
    checkpoints = tmp_path / "lns" / "checkpoints"
    (checkpoints / "iter_0000007.partial").mkdir()  # a killed save of the old branch
    rewind = f"exp_manager.resume_from_checkpoint={checkpoints / 'iter_0000003'}"
    branch = _run(tmp_path, tiny_run_config(tmp_path, rewind, "trainer.exit_interval=4"))
    assert branch["resumed_from"] == 3 and branch["steps"] == 4
    # A plain resume now continues the new branch, not the old iter_6.
    assert latest_complete_checkpoint(checkpoints) == checkpoints / "iter_0000004"
    [aside] = checkpoints.glob("abandoned-*-from-iter_0000003")
    assert sorted(p.name for p in aside.iterdir()) == ["iter_0000006", "iter_0000007.partial"]
    assert (aside / "iter_0000006" / "complete.json").is_file()
    out = capfd.readouterr().out
    assert "moved the newer checkpoints iter_0000007.partial, iter_0000006 aside to" in out
    # The same command again (a requeue) continues the branch: no second rewind.
    again = _run(tmp_path, tiny_run_config(tmp_path, rewind, "trainer.exit_interval=4"))
    assert again["resumed_from"] == 4 and again["losses"] == straight["losses"][4:]
    assert [p.name for p in checkpoints.glob("abandoned-*")] == [aside.name]
    assert "the rewind to iter_0000003 was already done at " in capfd.readouterr().out


def test_a_rewind_the_full_disk_refuses_ends_every_rank_and_the_run_stays_as_it_was(
    straight_tiny_run, tmp_path
):
    """Setting the abandoned branch aside on a full disk: both ranks end with one line
    (no rank left waiting for rank 0), nothing has moved; once space is freed the same
    command rewinds."""
    from helpers import directory_bytes, fill_leaving, small_filesystem

    straight = straight_tiny_run["run_dir"]
    run_dir = tmp_path / "lns"
    shutil.copytree(straight, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    size_kib = directory_bytes(straight / "checkpoints") * 3 // 2 // 1024 + 256  # 2 + the branch's
    with small_filesystem(run_dir / "checkpoints", size_kib) as checkpoints:
        for name in ("iter_0000003", "iter_0000006"):
            shutil.copytree(straight / "checkpoints" / name, checkpoints / name)
        fill_leaving(checkpoints, 0)
        rewind = f"exp_manager.resume_from_checkpoint={checkpoints / 'iter_0000003'}"
        cfg = tiny_run_config(tmp_path, rewind, "trainer.devices=2")
        [error] = {r["error"] for r in run_distributed(_fit, 2, tmp_path / "full", cfg, None)}
        assert re.fullmatch(
            rf"cannot write {re.escape(str(checkpoints))}/abandoned-[-0-9]+-from-iter_0000003/"
            r"moving.json: no space left on device \(.*\); nothing was moved, a rerun sets the "
            "newer checkpoints aside once space is freed",
            error,
        )
        listing = sorted(p.name for p in checkpoints.iterdir())
        assert listing == ["filler", "iter_0000003", "iter_0000006"]

        (checkpoints / "filler").unlink()
        branch = _run(tmp_path, tiny_run_config(tmp_path, rewind, "trainer.exit_interval=4"))
        assert branch["resumed_from"] == 3 and branch["steps"] == 4
        [aside] = checkpoints.glob("abandoned-*-from-iter_0000003")
        assert [p.name for p in aside.iterdir()] == ["iter_0000006"]


@pytest.mark.long
def test_a_full_disk_ends_every_rank_with_one_line_and_the_run_resumes(straight_tiny_run, tmp_path):
    """Two ranks on a disk that holds the step-3 checkpoint and not the step-6 one: both
    end, one line names the checkpoint (no traceback, no rank left in a collective), only
    iter_0000003 remains; on a larger disk the same command resumes from it and ends."""
    from helpers import directory_bytes, small_filesystem

    checkpoint_bytes = directory_bytes(straight_tiny_run["run_dir"] / "checkpoints/iter_0000003")
    size_kib = checkpoint_bytes * 3 // 2 // 1024 + 256
    with small_filesystem(tmp_path / "disk", size_kib) as disk:
        command = [sys.executable, "-m", "megatron_lns.cli", "train", str(DEMO),
                   *TINY_RUN_OVERRIDES, "trainer.devices=2", f"exp_manager.exp_dir={disk}"]  # fmt: skip
        full = subprocess.run(
            command, cwd=ROOT, env=fresh_launch_env(), capture_output=True, text=True, timeout=600
        )
        checkpoints = disk / "lns" / "checkpoints"
        errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
        assert full.returncode == 2, full.stderr[-3000:]
        assert len(errors) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
        assert errors[0].startswith(
            f"error: cannot write {checkpoints / 'iter_0000006'}: no space left on device ("
        )
        assert errors[0].endswith(
            "; iter_0000006.partial removed, a rerun resumes from iter_0000003 once space is freed"
        )
        assert "Local worker" not in full.stderr  # megatron's log of it, said in the line
        assert [p.name for p in checkpoints.iterdir()] == ["iter_0000003"]

        subprocess.run(["mount", "-o", f"remount,size={size_kib * 3}k", str(disk)], check=True)
        resumed = subprocess.run(
            command, cwd=ROOT, env=fresh_launch_env(), capture_output=True, text=True, timeout=600
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resumed from {checkpoints / 'iter_0000003'} (step 3)" in resumed.stdout
        assert latest_complete_checkpoint(checkpoints).name == "iter_0000006"
