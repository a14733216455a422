"""The sbatch script: golden renderings, quoting of hostile values, the batch script's
requeue decisions (run by bash against stand-ins for srun and scontrol), the cluster:
section's checks, and the per-task rank environment derived from SLURM's variables."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES, ROOT

from megatron_lns.cli import main
from megatron_lns.cluster.slurm.rank_env import (
    expand_nodelist,
    master_port,
    rank_environment,
)
from megatron_lns.cluster.slurm.submit import prepare_job, write_job
from megatron_lns.cluster.slurm.task import main as task_main
from megatron_lns.config import ConfigError, load_config, validate

DATA = FIXTURES
DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"
OLMO = ROOT / "nemo_configs" / "olmo_7b_lns_20b.yaml"
TINY_TP2 = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.encoder_seq_length=32",
    "model.micro_batch_size=2",
    "model.global_batch_size=4",
    "model.optim.sched.warmup_steps=2",
    "trainer.max_steps=6",
    "trainer.devices=2",
    "model.tensor_model_parallel_size=2",
]
OLMO_DATA = [
    "model.data.data_prefix=[/lustre/data/dolma/dolma_text_document]",
    "model.tokenizer.type=/lustre/models/olmo-7b-tokenizer",
    "exp_manager.exp_dir=/lustre/runs/olmo_7b_lns_20b",
]
STAMP = "20260101-000000"
HOSTILE = [
    "a'b",
    'a"b',
    "a;touch PWNED",
    "$(touch PWNED)",
    "`touch PWNED`",
    "a b",
    "${HOME}",
    "a\\b",
    "*",
]


def _cfg(path, *overrides):
    cfg = load_config(path, list(overrides))
    validate(cfg, check_files=False)
    return cfg


def _script(cfg, workdir="/home/alice/megatron-lns", python="/opt/venv/bin/python"):
    return prepare_job(cfg, Path(workdir), python, stamp=STAMP).script


def _bash_syntax_ok(script: str) -> None:
    result = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "name, config, overrides",
    [
        ("sbatch_tiny_cpu_tp2.sh", DEMO, TINY_TP2),
        ("sbatch_olmo_7b_16x8.sh", OLMO, OLMO_DATA),
    ],
)
def test_rendered_script_matches_golden_and_is_valid_bash(name, config, overrides):
    script = _script(_cfg(config, *overrides))
    golden = DATA / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text(), f"differs from {golden} (UPDATE_GOLDEN=1 rewrites it)"
    _bash_syntax_ok(script)


def test_a_hybrid_job_is_the_gpt_job_and_its_config_keeps_the_pattern(tmp_path):
    """The model's class is the run config's business: the same script as the GPT job, and
    the config.yaml the job reads has the architecture and the pattern (``*`` quoted)."""
    layout = [*TINY_TP2, "trainer.devices=4", "model.pipeline_model_parallel_size=2"]
    hybrid = [
        "model.architecture=hybrid",
        "model.num_layers=8",
        "model.hybrid_layer_pattern='*-*-|*-*-'",
    ]
    gpt_job = prepare_job(_cfg(DEMO, *layout), tmp_path, "python", stamp=STAMP)
    job = prepare_job(_cfg(DEMO, *layout, *hybrid), tmp_path, "python", stamp=STAMP)
    assert job.script == gpt_job.script
    _bash_syntax_ok(job.script)
    write_job(job)
    written = load_config(job.paths.config)
    validate(written, check_files=False)
    assert written.model.architecture == "hybrid"
    assert written.model.hybrid_layer_pattern == "*-*-|*-*-"
    assert written.model.num_layers == 8


@pytest.mark.parametrize("nodes", [1, 8])
def test_olmoe_job_asks_for_8_to_64_gpus_in_a_container(nodes):
    olmoe = ROOT / "nemo_configs" / "olmoe_1b_7b_lns.yaml"
    script = _script(_cfg(olmoe, *OLMO_DATA, f"trainer.num_nodes={nodes}"))
    for line in (
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "    --container-image=/lustre/containers/megatron-lns-te.sqsh \\",
    ):
        assert line in script.splitlines(), line
    _bash_syntax_ok(script)


def test_olmo_job_asks_for_16_nodes_of_8_gpus_in_a_container():
    script = _script(_cfg(OLMO, *OLMO_DATA))
    for line in (
        "#SBATCH --nodes=16",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --time=04:00:00",
        "#SBATCH --exclusive",
        "    --container-image=/lustre/containers/megatron-lns-te.sqsh \\",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
    ):
        assert line in script.splitlines(), line


# '*' is literal on an #SBATCH line (constraints use it); the rest is refused there.
@pytest.mark.parametrize("value", [*HOSTILE[:-1], "a\nb", "tab\there", "nul\x00"])
@pytest.mark.parametrize(
    "key", ["cluster.partition", "cluster.account", "cluster.qos", "cluster.dependency"]
)
def test_hostile_values_on_sbatch_lines_are_refused_naming_the_key(key, value):
    cfg = _cfg(DEMO, *TINY_TP2)
    setattr(cfg.cluster, key.split(".")[1], value)
    with pytest.raises(ConfigError, match=f"^{key}="):
        _script(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        ("exp_manager.exp_dir='/scratch/my runs'", "exp_manager.exp_dir="),
        ("exp_manager.exp_dir=/scratch/100%", "exp_manager.exp_dir="),
        ("cluster.sbatch_args=['--comment=a b']", "cluster.sbatch_args="),
        ("cluster.sbatch_args=[--time=10]", "conflicts with --time, set from cluster.time_limit"),
        ("cluster.srun_args=[--ntasks-per-node=1]", "conflicts with --ntasks-per-node"),
    ],
)
def test_unrepresentable_or_conflicting_options_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        _script(_cfg(DEMO, *TINY_TP2, override))


@pytest.mark.parametrize(
    "override, full, source",
    [
        ("cluster.sbatch_args=[--no-req]", "--no-requeue", "cluster.max_requeues"),
        ("cluster.sbatch_args=[--sig=B:USR2@60]", "--signal", "cluster.preemption_signal_lead_s"),
        ("cluster.sbatch_args=[--open=truncate]", "--open-mode", "the job log"),
        ("cluster.sbatch_args=[--tasks-per-node=1]", "--tasks-per-node", "trainer.devices"),
        ("cluster.srun_args=[--kill-on=0]", "--kill-on-bad-exit", "the script"),
        ("cluster.srun_args=[--k=0]", "--kill-on-bad-exit", "the script"),
        ("cluster.srun_args=[--container-mount-h]", "--container-mount-home", "the script"),
    ],
)
def test_an_abbreviated_option_the_script_sets_is_refused_like_the_full_name(
    override, full, source
):
    """sbatch and srun read any unambiguous prefix of a long option as the option."""
    with pytest.raises(ConfigError) as info:
        _script(_cfg(DEMO, *TINY_TP2, override))
    message = str(info.value)
    given = override.split("[")[1].rstrip("]")
    assert "\n" not in message and f"'{given}'" in message, message
    assert f"conflicts with {full}, set from {source}" in message, message


def test_every_option_the_script_sets_is_in_slurms_option_table():
    """An option missing from options.py's table would not be found by its prefixes."""
    from megatron_lns.cluster.slurm import render
    from megatron_lns.cluster.slurm.options import SBATCH_LONG_OPTIONS, SRUN_LONG_OPTIONS

    for own, known in (
        (render._OWN_SBATCH_OPTIONS, SBATCH_LONG_OPTIONS),
        (render._OWN_SRUN_OPTIONS, SRUN_LONG_OPTIONS),
    ):
        assert [o for o in own if o.startswith("--") and o[2:] not in known] == []


def test_an_ambiguous_prefix_that_may_mean_a_set_option_is_refused():
    with pytest.raises(ConfigError, match=r"'--no-' is ambiguous \(--no-kill, --no-requeue\)"):
        _script(_cfg(DEMO, *TINY_TP2, "cluster.sbatch_args=[--no-]"))


@pytest.mark.parametrize(
    "args",
    [
        "cluster.sbatch_args=[--mem-per-cpu=4G,--no-kill,--comm=x,--new-in-slurm-99]",
        "cluster.srun_args=[--mpi=pmix,--cpu-b=cores,--container-writable]",
    ],
)
def test_options_the_script_does_not_set_pass_in_any_spelling(args):
    assert "--" in _script(_cfg(DEMO, *TINY_TP2, args))


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x1bb"])
def test_control_characters_in_script_body_values_are_refused(value):
    cfg = _cfg(DEMO, *TINY_TP2)
    cfg.cluster.env_vars = {"NCCL_DEBUG": value}
    with pytest.raises(ConfigError, match=r"^cluster\.env_vars\.NCCL_DEBUG=.*control character"):
        _script(cfg)


# --- the batch script itself, run by bash with srun and scontrol stand-ins ---------------

FAKE_SRUN = r"""#!/bin/bash
# Records what it was given, then behaves as the test asks ($FAKE_MODE).
printf '%s\0' "$@" > "$FAKE_OUT/argv"
for name in $FAKE_ENV_NAMES; do printf '%s\0' "${!name}"; done > "$FAKE_OUT/env"
run_dir=${FAKE_STATUS%/*}
# What the trainer would record for the progress guard ("resumed 4 startup_s=30").
if [[ -n ${FAKE_RECORD:-} ]]; then
    echo "$SLURM_JOB_ID ${SLURM_RESTART_COUNT:-0} $FAKE_RECORD" >> "$run_dir/run_progress"
fi
# The trainer's line: in run_status, and in the file the batch script reads for its attempt.
status() { echo "$1" > "$FAKE_STATUS"; echo "$1" > "$MEGATRON_LNS_RUN_STATUS_COPY"; }
save() {  # a committed checkpoint of step $FAKE_STEP
    local dir
    printf -v dir '%s/checkpoints/iter_%07d' "$run_dir" "$FAKE_STEP"
    mkdir -p "$dir" && touch "$dir/complete.json"
    status "stopped $FAKE_STEP"
}
case $FAKE_MODE in
    finish) status "finished 6"; exit 0 ;;
    fail) exit 3 ;;
    lost_lock)
        # Another job of the same run directory holds its lock and finishes meanwhile;
        # this job's ranks fail on the lock (input error).
        echo "finished 6" > "$FAKE_STATUS"
        echo "srun: error: n1: tasks 0-1: Exited with exit code 2" >&2
        exit 2 ;;
    exit_interval) status "stopped 3"; exit 0 ;;
    preempt)
        # Save and stop when the batch shell forwards the warning; SLURM warns the
        # batch shell (--signal=B:USR1), here we do it for SLURM.
        trap 'status "stopped 4"; exit 0' USR1
        kill -USR1 "$PPID"
        for _ in $(seq 100); do sleep 0.1; done
        exit 9 ;;
    term)
        # scancel or `scontrol requeue`: SLURM sends TERM; the ranks save and stop.
        kill -TERM "$PPID"
        sleep 0.5
        status "stopped 4"; exit 0 ;;
    preempt_saving)
        trap 'save; exit 0' USR1
        kill -USR1 "$PPID"
        for _ in $(seq 100); do sleep 0.1; done
        exit 9 ;;
    preempt_during_startup)
        # No handler yet: the forwarded warning kills the task (status 138).
        kill -USR1 "$PPID"
        for _ in $(seq 100); do sleep 0.1; done
        exit 9 ;;
    attempts)
        # In-job restarts: attempt N does the Nth word of $FAKE_ATTEMPTS, saying what srun
        # says of failed tasks: crash@NODE (a rank SIGKILLed; srun kills the others),
        # hang@NODE (a watchdog's exit), save_crash@NODE (commits the checkpoint of step
        # FAKE_STEP + N, then crashes), input_error, finish, finish_then_abort.
        printf '%s\n' "$MEGATRON_LNS_ATTEMPT $*" >> "$FAKE_OUT/attempts"
        words=($FAKE_ATTEMPTS)
        what=${words[$MEGATRON_LNS_ATTEMPT]}
        node=${what#*@}
        case $what in
            crash@*)
                echo "srun: error: $node: task 3: Killed" >&2
                echo "srun: error: n1: tasks 0-2: Killed" >&2
                exit 137 ;;
            hang@*)
                # A watchdog on n1 names the stalled rank on $node, then exits 75.
                echo "[lns] hang: rank 3 (host $node, pid 99) stopped responding; rank 0 ..."
                echo "srun: error: n1: task 0: Exited with exit code 75" >&2
                exit 75 ;;
            save_crash@*)
                FAKE_STEP=$((FAKE_STEP + MEGATRON_LNS_ATTEMPT)) save
                rm "$FAKE_STATUS" "$MEGATRON_LNS_RUN_STATUS_COPY"
                echo "srun: error: $node: task 3: Killed" >&2
                exit 137 ;;
            input_error) echo "srun: error: n1: tasks 0-3: Exited with exit code 2" >&2; exit 2 ;;
            finish) status "finished 6"; exit 0 ;;
            finish_then_abort)
                status "finished 6"
                echo "srun: error: n2: task 3: Exited with exit code 134" >&2
                exit 143 ;;
        esac ;;
esac
"""
FAKE_SCONTROL = """#!/bin/bash
# The one-line query of the job's suspension is answered, not recorded with the actions.
if [[ $1 == -o && $2 == show ]]; then
    echo "JobId=$SLURM_JOB_ID JobState=RUNNING SuspendTime=${FAKE_SUSPEND_TIME:-None} x=y"
    exit 0
fi
echo "$*" >> "$FAKE_OUT/scontrol"
"""


def _run_batch_script(
    tmp_path, cfg, mode, restart=None, python="/opt/venv/bin/python", env=(), **fake
):
    """Run the rendered script with stand-ins; ``fake``: FAKE_STEP, FAKE_RECORD, ..."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    for left in out.iterdir():  # what the stand-ins recorded in an earlier run
        left.unlink()
    workdir = tmp_path / "work dir 'x' $(touch PWNED)"
    workdir.mkdir(exist_ok=True)
    job = prepare_job(cfg, workdir, python, stamp=STAMP)
    run_env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_OUT": str(out),
        "FAKE_MODE": mode,
        "FAKE_STATUS": str(job.paths.run_dir / "run_status"),
        "FAKE_ENV_NAMES": " ".join(env),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "megatron_lns-tiny_cpu_demo",
        "SLURM_JOB_NODELIST": "vm",
        **{f"FAKE_{name.upper()}": str(value) for name, value in fake.items()},
    }
    if restart is not None:
        run_env["SLURM_RESTART_COUNT"] = str(restart)
    result = subprocess.run(
        ["bash", "-c", job.script], cwd=tmp_path, env=run_env, capture_output=True, text=True
    )
    requeues = (out / "scontrol").read_text() if (out / "scontrol").exists() else ""
    assert not list(tmp_path.rglob("PWNED")), "a value was executed by the shell"
    return result, requeues, out, job


def _exp(tmp_path):
    return f"exp_manager.exp_dir={tmp_path}/runs"


def test_hostile_values_reach_srun_and_the_environment_unchanged(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    names = [f"HOSTILE_{i}" for i in range(len(HOSTILE))]
    cfg.cluster.env_vars = dict(zip(names, HOSTILE, strict=True))
    cfg.cluster.srun_args = [f"--comment={v}" for v in HOSTILE]
    python = str(tmp_path / "venv $(touch PWNED)" / "bin" / "python")
    result, _, out, job = _run_batch_script(tmp_path, cfg, "finish", python=python, env=names)
    assert result.returncode == 0, result.stderr
    argv = (out / "argv").read_text().split("\0")[:-1]
    assert argv[-5:] == [python, "-u", "-m", "megatron_lns.launch.task", str(job.paths.config)]
    assert argv[3:-5] == [f"--comment={v}" for v in HOSTILE]
    assert (out / "env").read_text().split("\0")[:-1] == HOSTILE
    _bash_syntax_ok(job.script)


def test_batch_script_ends_without_requeue_when_training_finished(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    result, requeues, _, job = _run_batch_script(tmp_path, cfg, "finish")
    assert result.returncode == 0 and requeues == ""
    logs = job.paths.log_dir
    assert "finished at step 6" in (logs / "megatron_lns-tiny_cpu_demo-42-restart0.log").read_text()
    assert "finished at step 6" in result.stdout  # the job log (sbatch --output)


def test_batch_script_requeues_after_a_warning_and_a_clean_stop(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "preempt", restart=2)
    assert result.returncode == 0, result.stdout
    assert requeues == "requeue 42\n"
    assert "USR1" in result.stdout and "requeueing (3 of at most 5)" in result.stdout


def test_batch_script_requeues_when_the_warning_killed_ranks_still_starting(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "preempt_during_startup")
    assert result.returncode == 0, result.stdout
    assert requeues == "requeue 42\n"


def test_batch_script_stops_requeueing_at_max_requeues(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path), "cluster.max_requeues=2")
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "preempt", restart=2)
    assert result.returncode == 1 and requeues == ""
    assert "cluster.max_requeues=2 reached" in result.stdout


def test_after_a_term_the_job_log_leaves_the_requeue_to_slurm(tmp_path):
    """`scontrol requeue` ends the job with a TERM and SLURM requeues it: "not requeued"
    would be wrong."""
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "term")
    assert result.returncode == 0 and requeues == ""
    last = result.stdout.splitlines()[-1]
    assert "stopped at step 4 after TERM (checkpoint saved); not requeued by this job" in last
    assert "SLURM requeues it itself after scontrol requeue" in last


def test_a_restart_says_whether_the_job_or_slurm_requeued_it(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "preempt", restart=0)
    assert requeues == "requeue 42\n"
    result, _, _, _ = _run_batch_script(tmp_path, cfg, "finish", restart=1)
    first = result.stdout.splitlines()[0]
    assert "(requeued by this job after a preemption warning)" in first
    result, _, _, _ = _run_batch_script(tmp_path, cfg, "finish", restart=2)
    assert "(requeued by SLURM: scontrol requeue" in result.stdout.splitlines()[0]


@pytest.mark.parametrize("mode, code", [("fail", 3), ("exit_interval", 0)])
def test_batch_script_does_not_requeue_a_failure_or_a_stop_without_warning(tmp_path, mode, code):
    # The stand-in stops at step 3: a step of trainer.exit_interval.
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path), "trainer.exit_interval=3")
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, mode)
    assert result.returncode == code and requeues == ""


# --- the progress guard (docs/cluster.md#progress-guard) ---------------------------------


def _progress(job):
    return _timeless((job.paths.run_dir / "run_progress").read_text()).splitlines()


def _timeless(text):
    """Seconds measured by the script (0 or 1 here) as N."""
    return re.sub(r"(after_s=|came |\(TERM\) )\d+", r"\1N", text)


def test_two_runs_killed_while_starting_stop_the_requeues_saying_the_slice_is_too_short(
    tmp_path,
):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path), "cluster.preemption_signal_lead_s=120")
    # An earlier job of the experiment measured its start-up, step and save.
    run_dir = tmp_path / "runs" / "lns"
    run_dir.mkdir(parents=True)
    (run_dir / "run_progress").write_text(
        "7 0 start 0\n7 0 resumed 0 startup_s=610 every=50\n7 0 saved 50 step_s=2.50 save_s=40.0\n"
    )
    first, requeues, out, job = _run_batch_script(
        tmp_path, cfg, "preempt_during_startup", restart=0, env=["MEGATRON_LNS_BATCH_START"]
    )
    assert first.returncode == 0 and requeues == "requeue 42\n", first.stdout
    assert (out / "env").read_text().rstrip("\0").isdigit()  # the trainer's start-up clock
    second, requeues, _, _ = _run_batch_script(tmp_path, cfg, "preempt_during_startup", restart=1)
    assert second.returncode == 1 and requeues == "", second.stdout
    last = _timeless(second.stdout.splitlines()[-1])
    assert "not requeued: the last 2 runs of this job did not advance the newest complete " \
        "checkpoint (step 0): the time slice is too short: the warning came N s after the " \
        "start, while the ranks were still starting (start-up: 610 s; then one step: 2.50 s " \
        "and one save: 40.0 s, within cluster.preemption_signal_lead_s=120 s); raise " \
        "cluster.time_limit" in last  # fmt: skip
    assert _progress(job)[3:] == [
        "42 0 start 0", "42 0 warned - after_s=N", "42 1 start 0", "42 1 warned - after_s=N",
        "42 1 guard -",
    ]  # fmt: skip


def test_a_run_that_commits_a_newer_checkpoint_resets_the_count(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    runs = ["preempt_during_startup", "preempt_saving", "preempt_during_startup"]
    for restart, mode in enumerate(runs):
        result, requeues, _, job = _run_batch_script(tmp_path, cfg, mode, restart, step=5)
        assert result.returncode == 0 and requeues == "requeue 42\n", result.stdout
    result, requeues, _, job = _run_batch_script(tmp_path, cfg, "preempt_during_startup", 3)
    assert result.returncode == 1 and requeues == ""
    assert "the last 2 runs of this job did not advance the newest complete checkpoint " \
        "(step 5)" in result.stdout  # fmt: skip
    assert [line for line in _progress(job) if " start " in line] == [
        "42 0 start 0", "42 1 start 0", "42 2 start 5", "42 3 start 5",
    ]  # fmt: skip


def test_a_stop_that_commits_nothing_after_the_start_up_is_not_called_a_short_slice(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    for restart in (0, 1):  # started, stopped at step 4, but no checkpoint committed
        result, requeues, _, _ = _run_batch_script(
            tmp_path, cfg, "preempt", restart, record="resumed 4 startup_s=0 every=3"
        )
    assert result.returncode == 1 and requeues == ""
    last = _timeless(result.stdout.splitlines()[-1])
    assert "the warning came N s after the start, when the ranks had started" in last
    assert "time slice is too short" not in last


def test_runs_of_an_earlier_job_with_the_same_id_do_not_count(tmp_path):
    """SLURM reuses job ids after its state is reset: a new job 42 is not the old one."""
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    run_dir = tmp_path / "runs" / "lns"
    run_dir.mkdir(parents=True)
    old = "42 0 start 0\n42 0 termed - after_s=9\n42 1 start 0\n42 1 termed - after_s=9\n"
    (run_dir / "run_progress").write_text(old)
    result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "preempt_during_startup", 0)
    assert result.returncode == 0 and requeues == "requeue 42\n", result.stdout


def test_the_ranks_warnings_about_time_reach_the_job_log(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    warning = "cluster.preemption_signal_lead_s=60 s cannot cover one step (2.0 s) plus ..."
    result, _, _, _ = _run_batch_script(tmp_path, cfg, "finish", record=f"warning - {warning}")
    assert result.returncode == 0
    assert f"job 42 restart 0: warning: {warning}" in result.stdout  # the job log


def test_slurm_requeues_without_progress_stop_at_the_next_start(tmp_path):
    """SLURM requeues a job on its own (PreemptMode=REQUEUE): after two runs it ended
    before a checkpoint was committed, the next run does not start."""
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    for restart in (0, 1):
        result, requeues, _, _ = _run_batch_script(tmp_path, cfg, "term", restart)
        assert result.returncode == 0 and requeues == ""
    assert "if SLURM requeues it, the next run will not start" in result.stdout
    third, _, out, _ = _run_batch_script(tmp_path, cfg, "finish", 2)
    assert third.returncode == 1 and not (out / "argv").exists(), third.stdout
    last = _timeless(third.stdout.splitlines()[-1])
    assert "not started: the last 2 runs of this job did not advance" in last
    assert "SLURM ended them (TERM) N s after the start" in last
    # Requeued by hand after that stop: the guard counts afresh.
    fourth, _, out, _ = _run_batch_script(tmp_path, cfg, "finish", 3)
    assert fourth.returncode == 0 and "finished at step 6" in fourth.stdout


def test_submit_dry_run_prints_the_script_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["submit", str(DEMO), *TINY_TP2, "exp_manager.exp_dir=runs", "--dry-run"])
    assert code == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash\n")
    assert f"#SBATCH --output={tmp_path}/runs/lns/logs/%x-%j.log" in script
    assert list(tmp_path.iterdir()) == []


def test_submit_fails_at_submit_time_on_a_bad_layout_or_missing_sbatch(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(DEMO), *TINY_TP2, "trainer.devices=3"]) == 2
    assert "not divisible" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["submit", str(DEMO), *TINY_TP2]) == 2
    assert "sbatch not found on PATH" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- the cluster: section ---------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.time_limit=4:00:00", r"cluster\.time_limit=14400 must be a quoted string"),
        ("cluster.time_limit='4h'", r"cluster\.time_limit='4h' is not a SLURM time"),
        ("cluster.time_limit='00:05:00'", r"cluster\.preemption_signal_lead_s \(300\) must be"),
        ("cluster.preemption_signal_lead_s=0", r"cluster\.preemption_signal_lead_s must be in"),
        ("cluster.max_requeues=-1", r"cluster\.max_requeues must be >= 0"),
        ("cluster.gpus_per_node=8", r"cluster\.gpus_per_node=8 but trainer\.accelerator=cpu"),
        ("cluster.mem=lots", r"cluster\.mem='lots' is not a SLURM size"),
        ("cluster.cpus_per_task=0", r"cluster\.cpus_per_task must be positive"),
        ("cluster.job_name_prefix='my job '", r"cluster\.job_name_prefix \+ name"),
        ("cluster.container_mounts=[/data:/data]", r"needs cluster\.container_image"),
        ("+cluster.env_vars.RANK=3", r"cluster\.env_vars\.RANK: set per task from SLURM"),
        ("cluster.srun_args=[pmix]", r"cluster\.srun_args: 'pmix' is not an option"),
        (
            "cluster.partitoin=gpu",
            r"no key 'cluster\.partitoin' \(did you mean 'cluster\.partition'",
        ),
    ],
)
def test_cluster_section_is_checked_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(DEMO, *TINY_TP2, override)


def test_olmo_gpus_per_node_must_match_devices():
    with pytest.raises(ConfigError, match=r"cluster\.gpus_per_node \(4\) differs"):
        _cfg(OLMO, *OLMO_DATA, "cluster.gpus_per_node=4")


@pytest.mark.parametrize(
    "limit, seconds",
    [("90", 5400), ("5:30", 330), ("2:00:00", 7200), ("1-12", 129600), ("1-0:1:2", 86462)],
)
def test_time_limits_in_every_slurm_form(limit, seconds):
    from megatron_lns.config.cluster import time_limit_seconds

    assert time_limit_seconds(limit) == seconds


def test_a_container_job_keeps_the_home_directory_out_of_the_image():
    """pyxis mounts $HOME by default, and ~/.local's packages would shadow the image's."""
    assert "    --no-container-mount-home \\" in _script(_cfg(OLMO, *OLMO_DATA)).splitlines()
    assert "container-mount-home" not in _script(_cfg(DEMO, *TINY_TP2))


def test_an_unmounted_submit_directory_is_named_in_one_warning(capsys):
    script = _script(_cfg(OLMO, *OLMO_DATA), workdir="/home/alice/megatron-lns")
    assert "--container-workdir" not in script
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: the submit directory ")
    assert "/home/alice/megatron-lns is not mounted" in err and "/lustre:/lustre" in err
    script = _script(_cfg(OLMO, *OLMO_DATA), workdir="/lustre/alice/megatron-lns")
    assert "    --container-workdir=/lustre/alice/megatron-lns \\" in script.splitlines()
    assert capsys.readouterr().err == ""


def _readme_submit_overrides() -> list[str]:
    """The overrides of the README's OLMo-7B `submit` example, as the shell splits them."""
    text = (ROOT / "README.md").read_text()
    start = text.index("megatron-lns submit nemo_configs/olmo_7b_lns_20b.yaml")
    command = text[start : text.index("\n```", start)].split("\n.venv")[0]
    words = shlex.split(command.replace("\\\n", " "), comments=True)[3:]
    return [word.replace("$USER", "alice") for word in words]


def test_the_readme_submit_example_renders_from_any_directory(capsys):
    """Its run directory must be mounted in the container, wherever submit runs."""
    overrides = _readme_submit_overrides()
    assert any(o.startswith("cluster.account=") for o in overrides), overrides
    script = _script(_cfg(OLMO, *overrides), workdir="/home/alice/megatron-lns")
    assert "#SBATCH --nodes=16" in script.splitlines()


def test_each_submission_gets_its_own_job_name(tmp_path):
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    first = prepare_job(cfg, tmp_path, "python", stamp="20260101-000000")
    again = prepare_job(cfg, tmp_path, "python", stamp="20260101-000100")
    cfg.exp_manager.name = "preln"
    other_run = prepare_job(cfg, tmp_path, "python", stamp="20260101-000000")
    names = [
        next(line for line in job.script.splitlines() if line.startswith("#SBATCH --job-name="))
        for job in (first, again, other_run)
    ]
    assert names[0] == "#SBATCH --job-name=megatron_lns-tiny_cpu_demo-lns-20260101-000000"
    assert len(set(names)) == 3


def test_container_job_needs_the_experiment_mounted_at_the_same_path():
    with pytest.raises(ConfigError, match="mounted at the same path"):
        _script(_cfg(OLMO, *OLMO_DATA, "cluster.container_mounts=[/lustre:/mnt]"))


# --- rank environment -----------------------------------------------------------------


def test_nodelists_expand_like_slurm():
    assert expand_nodelist("gpu[001-003],cpu[1,3-5]") == [
        *("gpu001", "gpu002", "gpu003"),
        *("cpu1", "cpu3", "cpu4", "cpu5"),
    ]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("rack-a[9-11]-ib,x") == ["rack-a9-ib", "rack-a10-ib", "rack-a11-ib", "x"]
    assert expand_nodelist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]


@pytest.mark.parametrize("bad", ["gpu[1-", "gpu1]", "gpu[3-1]", "gpu[a-b]", "a,,b", "g[[1]]"])
def test_malformed_nodelists_are_errors(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


@pytest.mark.parametrize(
    "procid, node, localid", [(0, "gpu001", 0), (67, "gpu009", 3), (127, "gpu016", 7)]
)
def test_rank_environment_of_16_nodes_x_8_tasks(procid, node, localid):
    assert expand_nodelist("gpu[001-016]")[procid // 8] == node
    env = {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": "128",
        "SLURM_LOCALID": str(localid),
        "SLURM_JOB_NODELIST": "gpu[001-016]",
        "SLURMD_NODENAME": node,
        "SLURM_JOB_ID": "4711",
    }
    assert rank_environment(env) == {
        "RANK": str(procid),
        "WORLD_SIZE": "128",
        "LOCAL_RANK": str(localid),
        "MASTER_ADDR": "gpu001",
        "MASTER_PORT": str(master_port(4711)),
    }


def test_master_port_is_fixed_per_job_and_below_the_ephemeral_range():
    ports = {master_port(job) for job in range(100_000, 100_100)}
    assert len(ports) == 100
    assert all(1024 < p < 32768 for p in ports)
    assert master_port(4711) == master_port(4711)


def test_task_outside_srun_fails_with_one_line(capsys, monkeypatch):
    for name in ("SLURM_PROCID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    assert task_main(["config.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SLURM_JOB_NODELIST is not set" in err


def test_the_module_path_batch_scripts_run_still_runs_the_task():
    """Written job.sbatch files name `-m megatron_lns.launch.task`; it must keep working."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "megatron_lns.launch.task", "config.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: SLURM_JOB_NODELIST is not set")


def test_quote_round_trips_through_bash():
    from megatron_lns.cluster.slurm.render import quote

    for value in HOSTILE:
        out = subprocess.run(
            ["bash", "-c", f"printf %s {quote('k', value)}"], capture_output=True, text=True
        ).stdout
        assert out == value
        assert quote("k", value) == shlex.quote(value)


# --- in-job restarts (docs/cluster.md#in-job-restarts) ----------------------------------


def _restarted(tmp_path, attempts, *overrides, restart=None):
    """The batch script, its srun stand-in doing ``attempts`` (FAKE_SRUN's words) in turn;
    also what each attempt's srun was given, by MEGATRON_LNS_ATTEMPT."""
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path), *overrides)
    result, requeues, out, job = _run_batch_script(
        tmp_path, cfg, "attempts", restart=restart, attempts=attempts, step=2
    )
    given = [line.split(" ", 1) for line in (out / "attempts").read_text().splitlines()]
    return result, requeues, job, given


def _notes(job_log: str) -> list[str]:
    """The job log's lines without their time stamps."""
    return [line.split(" ", 1)[1] for line in job_log.splitlines()]


def test_a_crashed_rank_is_restarted_in_job_with_the_next_attempt_number(tmp_path):
    result, requeues, job, given = _restarted(tmp_path, "crash@n2 finish")
    assert result.returncode == 0 and requeues == "", result.stdout
    assert [attempt for attempt, _ in given] == ["0", "1"]
    assert given[0][1] == given[1][1]  # the same srun, no node left out
    notes = _notes(result.stdout)
    assert notes[1:] == [
        "job 42 restart 0: attempt 0 failed: task 3 on n2: Killed; restarting in-job (1 of at "
        "most 3) from the start (no complete checkpoint yet)",
        "job 42 restart 0: finished at step 6",
    ]
    assert "42 0 restarted 0 attempt=1" in _progress(job)[1]


def test_a_hang_is_restarted_and_blamed_on_the_stalled_ranks_host(tmp_path):
    """The watchdog that exits first runs on a healthy node (n1): the node that counts
    towards leaving it out is the one its line names, twice here, then left out."""
    result, _, _, given = _restarted(tmp_path, "hang@n2 hang@n2 finish", "cluster.spare_nodes=1")
    assert result.returncode == 0 and len(given) == 3
    assert (
        "attempt 0 failed: task 0 on n1: Exited with exit code 75 (its watchdog found the run "
        "hung on n2); restarting in-job"
    ) in result.stdout
    assert "--exclude=n2" in given[2][1].split()


def test_a_failure_after_slurm_suspended_the_job_blames_no_node(tmp_path):
    """scontrol suspend stops every rank; what fails after the resume (a collective's
    timeout that counted the pause) is no evidence against the node, however often."""
    cfg = _cfg(DEMO, *TINY_TP2, _exp(tmp_path))
    result, requeues, out, _ = _run_batch_script(
        tmp_path, cfg, "attempts", attempts="hang@n2 crash@n2 finish", step=2,
        suspend_time="2999-01-01T00:00:00",  # resumed after the attempt started
    )  # fmt: skip
    given = [line.split(" ", 1) for line in (out / "attempts").read_text().splitlines()]
    assert result.returncode == 0 and requeues == "" and len(given) == 3, result.stdout
    assert not any(word.startswith("--exclude") for _, argv in given for word in argv.split())
    assert (
        "attempt 0 failed: task 0 on n1: Exited with exit code 75 (its watchdog found the run "
        "hung on n2) after SLURM suspended the job (not blamed on n2); restarting in-job"
    ) in result.stdout
    assert "task 3 on n2: Killed after SLURM suspended the job (not blamed on n2)" in (
        result.stdout
    )
    assert "failed twice" not in result.stdout


def test_restarts_without_a_newer_checkpoint_end_the_job_with_that_cause(tmp_path):
    result, requeues, _, given = _restarted(tmp_path, "crash@n2 crash@n3 crash@n4 finish")
    assert result.returncode == 137 and requeues == ""
    assert len(given) == 3  # the first start and 2 restarts (max_restarts_without_progress)
    notes = _notes(result.stdout)
    assert notes[-2] == (
        "job 42 restart 0: attempt 2 failed: task 3 on n4: Killed; not restarted: the last 2 "
        "in-job restarts committed no checkpoint newer than step 0 "
        "(exp_manager.fault_tolerance.max_restarts_without_progress=2)"
    )
    assert notes[-1] == "job 42 restart 0: failed: srun exited with status 137; not requeued"


def test_restarts_used_up_without_progress_name_the_recurring_failure(tmp_path):
    """Both limits hit by the same failure: the cause named is the one the local restarts
    name (runtime/restarts.py), that the failure recurs."""
    result, _, _, given = _restarted(
        tmp_path,
        "crash@n2 crash@n3 crash@n4 finish",
        "exp_manager.fault_tolerance.max_rank_restarts=2",
    )
    assert result.returncode == 137 and len(given) == 3
    assert "not restarted: the last 2 in-job restarts committed no checkpoint" in result.stdout


def test_restarts_that_commit_checkpoints_go_on_until_max_rank_restarts(tmp_path):
    attempts = "save_crash@n2 save_crash@n3 save_crash@n4 save_crash@n5 finish"
    result, _, _, given = _restarted(
        tmp_path, attempts, "exp_manager.fault_tolerance.max_rank_restarts=2"
    )
    assert result.returncode == 137 and len(given) == 3
    assert "restarting in-job (2 of at most 2) from the checkpoint of step 3" in result.stdout
    assert (
        "attempt 2 failed: task 3 on n4: Killed; not restarted: all "
        "exp_manager.fault_tolerance.max_rank_restarts=2 in-job restarts used"
    ) in result.stdout


@pytest.mark.parametrize(
    "attempts, overrides, why",
    [
        ("input_error finish", [], "a rank reported an input error (exit code 2)"),
        ("crash@n2 finish", ["exp_manager.fault_tolerance.max_rank_restarts=0"], "are off"),
        ("crash@n2 finish", ["exp_manager.create_fault_tolerance_callback=false"], "are off"),
    ],
)
def test_no_restart_after_an_input_error_or_with_restarts_off(tmp_path, attempts, overrides, why):
    result, requeues, _, given = _restarted(tmp_path, attempts, *overrides)
    assert result.returncode != 0 and requeues == "" and len(given) == 1
    assert why in result.stdout and "restarting in-job" not in result.stdout


def test_a_node_that_failed_twice_is_left_out_while_a_spare_remains(tmp_path):
    result, requeues, job, given = _restarted(
        tmp_path, "crash@n2 crash@n2 finish", "cluster.spare_nodes=1"
    )
    assert result.returncode == 0 and requeues == "", result.stdout
    assert "#SBATCH --nodes=2\n" in job.script  # trainer.num_nodes=1 and the spare
    first_srun = given[0][1].split()
    assert "--nodes=1" in first_srun and "--ntasks=2" in first_srun
    assert not any(word.startswith("--exclude") for word in first_srun)
    assert "--exclude=n2" in given[2][1].split()
    assert "n2 failed twice: left out of the next srun (spare node 1 of 1; left out: n2)" in (
        result.stdout
    )


def test_without_a_spare_node_the_job_requeues_itself_excluding_the_node(tmp_path):
    result, requeues, _, given = _restarted(tmp_path, "crash@n2 crash@n2 finish")
    assert result.returncode == 0 and len(given) == 2, result.stdout
    assert requeues == "show job 42\nrequeue 42\nupdate JobId=42 ExcNodeList=n2\n"
    assert "n2 failed twice and no spare node is left: requeueing without n2 (1 of at most" in (
        result.stdout
    )
    result, _, _, _ = _restarted(tmp_path, "finish", restart=1)
    assert "(requeued by this job to leave out n2, which failed twice)" in result.stdout


def test_a_rank_that_fails_after_the_trainer_finished_does_not_fail_the_job(tmp_path):
    result, requeues, _, given = _restarted(tmp_path, "finish_then_abort")
    assert result.returncode == 0 and requeues == "" and len(given) == 1
    assert "finished at step 6 (srun exited with status 143 after the trainer finished" in (
        result.stdout
    )


def test_each_attempt_rendezvouses_on_its_own_port_and_step_nodes():
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_STEP_NODELIST": "n[1,3]",
        "SLURM_JOB_ID": "4711",
    }
    first = rank_environment(env)
    again = rank_environment({**env, "MEGATRON_LNS_ATTEMPT": "1"})
    assert first["MASTER_PORT"] == str(master_port(4711))
    assert again["MASTER_PORT"] == str(master_port(4711, 1)) != first["MASTER_PORT"]
    assert first["MASTER_ADDR"] == again["MASTER_ADDR"] == "n1"
    assert rank_environment({**env, "SLURM_STEP_NODELIST": "n[2-3]"})["MASTER_ADDR"] == "n2"
