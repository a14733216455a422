"""``megatron-lns preprocess ... --submit``: the batch script it renders (the cluster:
section read as for training, container flags, options the script sets refused by name),
the keys it does not use named, and the script's decisions, run by bash against a
stand-in for srun: a refused plan stops the job, a failed tokenize step is run again a
bounded number of times, a requeue past cluster.max_requeues does not start."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import hugging_face_tokenizer_dir

from megatron_lns.cli import main
from megatron_lns.commands.preprocess import preprocess_options

HOSTILE = "dir 'x' $(touch PWNED) `touch PWNED`"


@pytest.fixture
def corpus(tmp_path) -> Path:
    data = tmp_path / HOSTILE / "data"
    data.mkdir(parents=True)
    for i in range(3):
        text = "".join(json.dumps({"text": f"doc {i} {j}"}) + "\n" for j in range(5))
        (data / f"s{i}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    return data


def _config(tmp_path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def _render(capsys, corpus, config, *extra, nodes="2", output=None):
    output = output or config.parent / "out" / "corpus"
    code = main(
        [
            "preprocess",
            "--input",
            str(corpus / "*.jsonl.gz"),
            "--output-prefix",
            str(output),
            "--submit",
            str(config),
            *extra,
            "--nodes",
            nodes,
            "--dry-run",
        ]
    )
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_script_plans_tokenizes_on_every_node_and_merges(tmp_path, capsys, plain_corpus):
    config = _config(
        tmp_path, 'cluster:\n  partition: cpu\n  time_limit: "30"\n  env_vars: {HF_HOME: /x}\n'
    )
    code, script, err = _render(capsys, plain_corpus, config, "cluster.account=acc")
    assert code == 0, err
    assert err == ""
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    logs = tmp_path / "out" / "corpus.parts" / "slurm" / "logs"
    assert directives[0].startswith("#SBATCH --job-name=megatron_lns-preprocess-corpus-")
    assert directives[1:5] == [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={logs}/%x-%j.log",
        "#SBATCH --open-mode=append",
    ]
    assert "#SBATCH --requeue" in directives and "#SBATCH --partition=cpu" in directives
    assert "#SBATCH --account=acc" in directives and "#SBATCH --time=30" in directives
    # No cpus_per_task: whole nodes, each task with the node's CPUs.
    assert "#SBATCH --exclusive" in directives
    assert '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in script
    assert "export HF_HOME=/x" in script
    steps = [line.strip() for line in script.splitlines() if " -m megatron_lns.cli " in line]
    assert len(steps) == 3
    assert steps[0].endswith('--plan-only | tee "$plan_output"')
    assert steps[1].endswith("--task slurm")
    assert steps[2].endswith("--max-bad-records 0")  # the merge: no step option
    assert f"--input '{plain_corpus}/*.jsonl.gz' --output-prefix {tmp_path}/out/corpus" in script
    assert not (tmp_path / "out").exists(), "--dry-run wrote something"


def test_an_output_sbatch_cannot_log_beside_is_refused_naming_the_flag(tmp_path, capsys, corpus):
    output = corpus.parent / "out" / "corpus"
    code, _, err = _render(capsys, corpus, _config(tmp_path, "cluster: {}\n"), output=output)
    assert code != 0
    assert "--output-prefix=" in err and "cannot be written on an #SBATCH line" in err


def test_hostile_input_paths_reach_srun_unchanged(tmp_path, capsys, corpus):
    result, steps, calls = _run_script(tmp_path, capsys, corpus, [0, 0, 0])
    assert result.returncode == 0, result.stdout + result.stderr
    assert steps == ["plan", "task", "merge"]
    assert all(f" --input {corpus}/*.jsonl.gz --output-prefix " in call for call in calls)
    assert not list(tmp_path.rglob("PWNED")), "a value was executed by the shell"


@pytest.fixture
def plain_corpus(tmp_path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        text = "".join(json.dumps({"text": f"doc {i} {j}"}) + "\n" for j in range(5))
        (data / f"s{i}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    return data


def test_cpus_per_task_and_a_container_reach_every_step(tmp_path, capsys, plain_corpus):
    config = _config(
        tmp_path,
        f"cluster:\n  cpus_per_task: 16\n  container_image: nvcr.io/nvidia/nemo:25.04\n"
        f"  container_mounts: ['{tmp_path}:{tmp_path}']\n",
    )
    code, script, err = _render(capsys, plain_corpus, config, "--workers", "12")
    assert code == 0, err
    assert "#SBATCH --cpus-per-task=16" in script and "#SBATCH --exclusive" not in script
    assert "SLURM_CPUS_ON_NODE" not in script
    for flag in (
        "--cpus-per-task=16",
        "--container-image=nvcr.io/nvidia/nemo:25.04",
        "--no-container-mount-home",
        f"--container-mounts={tmp_path}:{tmp_path}",
    ):
        assert script.count(f"    {flag} \\") == 3, flag
    # The container's interpreter; the workers given stay the same in every step.
    assert script.count("python -u -m megatron_lns.cli preprocess --input") == 3
    assert script.count("--workers 12") == 3


def test_a_container_must_see_the_output_at_its_own_path(tmp_path, capsys, plain_corpus):
    config = _config(tmp_path, "cluster:\n  container_image: img\n  container_mounts: [/a:/a]\n")
    code, _, err = _render(capsys, plain_corpus, config)
    assert code != 0
    assert f"--output-prefix: {tmp_path}/out must be mounted at the same path in the " in err
    assert f"add '{tmp_path}/out:{tmp_path}/out' or a parent to cluster.container_mounts" in err


def test_a_container_must_see_the_inputs_at_their_own_path(tmp_path, capsys, plain_corpus):
    out = tmp_path / "out"
    config = _config(
        tmp_path, f"cluster:\n  container_image: img\n  container_mounts: ['{out}:{out}']\n"
    )
    code, _, err = _render(capsys, plain_corpus, config)
    assert code != 0
    assert f"--input: {plain_corpus} must be mounted at the same path in the container" in err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "cluster.srun_args=[--kill-on=1]",
            "'--kill-on=1' (an abbreviation of --kill-on-bad-exit) conflicts with "
            "--kill-on-bad-exit, set from the script (the other tasks finish their units)",
        ),
        (
            "cluster.sbatch_args=[--nodes=3]",
            "'--nodes=3' conflicts with --nodes, set from preprocess --nodes",
        ),
        (
            "cluster.sbatch_args=[--output=/tmp/x]",
            "conflicts with --output, set from the output prefix (PREFIX.parts/slurm/logs/)",
        ),
        ("model.num_layers=4", "model.num_layers=4: preprocessing reads only the cluster:"),
        ("cluster.time_limit=4:00:00", "cluster.time_limit=14400 must be a quoted string"),
    ],
)
def test_a_refused_setting_is_named(tmp_path, capsys, plain_corpus, override, message):
    code, script, err = _render(capsys, plain_corpus, _config(tmp_path, "cluster: {}\n"), override)
    assert code != 0 and script == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1, err


def test_training_only_keys_are_named_in_one_note(tmp_path, capsys, plain_corpus):
    config = _config(
        tmp_path,
        "trainer: {num_nodes: 16, devices: 8}\ncluster:\n  gpus_per_node: 8\n"
        "  preemption_signal_lead_s: 120\n",
    )
    code, script, err = _render(capsys, plain_corpus, config)
    assert code == 0, err
    assert err.count("\n") == 1
    assert err.startswith("note: not used by preprocessing: trainer.num_nodes=16 ")
    for key in ("trainer.devices=8", "cluster.gpus_per_node=8", "preemption_signal_lead_s=120"):
        assert key in err
    assert "gpus" not in script.lower().replace("no gpu", "")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--task", "0/2"], "--task and --submit: the job runs every step itself"),
        (["--plan-only"], "--plan-only and --submit"),
        (["--nodes", "0"], "--nodes 0: give at least 1"),
    ],
)
def test_flags_of_a_local_run_are_refused_with_submit(
    tmp_path, capsys, plain_corpus, flags, message
):
    config = _config(tmp_path, "cluster: {}\n")
    nodes = flags[1] if flags[0] == "--nodes" else "2"
    extra = [] if flags[0] == "--nodes" else flags
    code, _, err = _render(capsys, plain_corpus, config, *extra, nodes=nodes)
    assert code != 0 and message in err


def test_every_option_reaches_every_step_but_the_submissions_own(tmp_path, capsys, plain_corpus):
    """--submit passed a fixed list of options: --encoder gigatoken (and --quiet) were
    dropped, and the job tokenized with the standard encoder. The options are now read
    from the parser: each reaches the three steps as given, but the submission's own and
    those each step sets (refused with --submit, above)."""
    (tmp_path / "tokenizer").mkdir()
    tokenizer = hugging_face_tokenizer_dir(tmp_path / "tokenizer")
    given = {
        "--tokenizer-library": "huggingface",
        "--tokenizer-type": str(tokenizer),
        "--encoder": "gigatoken",
        "--json-key": "body",
        "--workers": "3",
        "--max-bad-records": "5",
        "--overwrite": None,
        "--quiet": None,
    }
    own = {"--input", "--output-prefix", "--submit", "--nodes", "--dry-run"}
    options = {max(a.option_strings, key=len) for a in preprocess_options()}
    # --tokenizer-model is passed as --tokenizer-type is; --task and --plan-only refused.
    others = {"--tokenizer-model", "--task", "--plan-only"}
    assert options == {*given, *own, *others}, "a new option: test it here"
    words = [word for flag, value in given.items() for word in (flag, value) if word]
    code, script, err = _render(capsys, plain_corpus, _config(tmp_path, "cluster: {}\n"), *words)
    assert code == 0, err
    steps = [line for line in script.splitlines() if " -m megatron_lns.cli " in line]
    assert len(steps) == 3
    for step in steps:
        for flag, value in given.items():
            expected = f" {flag} {value} " if value else f" {flag} "
            assert expected in f"{step} ", step


def test_submit_flags_without_submit_are_refused(capsys, plain_corpus):
    args = ["preprocess", "--input", str(plain_corpus), "--output-prefix", "x", "--nodes", "2"]
    assert main(args) != 0
    assert "--nodes 2: only with --submit CONFIG" in capsys.readouterr().err


# --- the script itself, run by bash against a stand-in for srun --------------------------

FAKE_SRUN = r"""#!/bin/bash
# One line per call: its arguments; prints $FAKE_PLAN_SAYS for the plan; exits with the
# next of $FAKE_CODES.
printf '%s\n' "$*" >> "$FAKE_OUT/calls"
[[ $* == *--plan-only* ]] && echo "${FAKE_PLAN_SAYS:-planned 3 units}"
calls=$(wc -l < "$FAKE_OUT/calls")
codes=($FAKE_CODES)
exit "${codes[calls - 1]:-0}"
"""


def _run_script(
    tmp_path, capsys, plain_corpus, codes, restart=0, config="cluster: {}\n", plan_says=""
):
    _, script, err = _render(capsys, plain_corpus, _config(tmp_path, config))
    assert script, err
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    (tmp_path / "calls").unlink(missing_ok=True)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_OUT": str(tmp_path),
        "FAKE_CODES": " ".join(map(str, codes)),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_ON_NODE": "8",
        "SLURM_RESTART_COUNT": str(restart),
        "FAKE_PLAN_SAYS": plan_says,
    }
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    steps = ["plan" if "--plan-only" in c else "task" if "--task" in c else "merge" for c in calls]
    return result, steps, calls


def test_a_job_that_runs_through_plans_tokenizes_and_merges(tmp_path, capsys, plain_corpus):
    result, steps, calls = _run_script(tmp_path, capsys, plain_corpus, [0, 0, 0])
    assert result.returncode == 0, result.stdout + result.stderr
    assert steps == ["plan", "task", "merge"]
    assert calls[1].startswith("--nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=0 --label ")
    assert "--cpus-per-task=8 " in calls[1]  # $SLURM_CPUS_ON_NODE, expanded by the script
    assert result.stdout.rstrip().endswith("finished")


def test_a_refused_plan_ends_the_job_before_any_node_tokenizes(tmp_path, capsys, plain_corpus):
    result, steps, _ = _run_script(tmp_path, capsys, plain_corpus, [1])
    assert result.returncode == 1
    assert steps == ["plan"]
    assert "plan: failed with status 1" in result.stdout


def test_a_killed_task_is_run_again_and_then_merged(tmp_path, capsys, plain_corpus):
    result, steps, _ = _run_script(tmp_path, capsys, plain_corpus, [0, 137, 0, 0])
    assert result.returncode == 0, result.stdout
    assert steps == ["plan", "task", "task", "merge"]
    assert "tokenize: failed with status 137" in result.stdout
    assert "running the tokenize step again" in result.stdout
    assert "retry 1 of 2" in result.stdout


def test_the_tokenize_step_is_retried_a_bounded_number_of_times(tmp_path, capsys, plain_corpus):
    result, steps, _ = _run_script(tmp_path, capsys, plain_corpus, [0, 1, 1, 1, 0])
    assert result.returncode == 1
    assert steps == ["plan", "task", "task", "task"]
    assert "the tokenize step failed 3 times" in result.stdout


def test_a_requeue_resumes_and_one_past_max_requeues_does_not_start(tmp_path, capsys, plain_corpus):
    config = "cluster:\n  max_requeues: 2\n"
    result, steps, _ = _run_script(tmp_path, capsys, plain_corpus, [], restart=2, config=config)
    assert result.returncode == 0 and steps == ["plan", "task", "merge"]
    assert "requeued by SLURM" in result.stdout
    result, steps, _ = _run_script(tmp_path, capsys, plain_corpus, [], restart=3, config=config)
    assert result.returncode == 1 and steps == []
    assert "more than cluster.max_requeues=2" in result.stdout


def test_no_requeue_without_max_requeues(tmp_path, capsys, plain_corpus):
    code, script, err = _render(
        capsys, plain_corpus, _config(tmp_path, "cluster:\n  max_requeues: 0\n")
    )
    assert code == 0, err
    assert "\n#SBATCH --requeue\n" not in script and "\n#SBATCH --no-requeue\n" in script


def test_a_dataset_up_to_date_ends_the_job_after_the_plan(tmp_path, capsys, plain_corpus):
    """What the plan says of a dataset published with the same plan (here by a real run)
    is what the script looks for."""
    prefix = tmp_path / "out" / "corpus"
    args = ["preprocess", "--input", str(plain_corpus), "--output-prefix", str(prefix)]
    assert main([*args, "--quiet"]) == 0
    capsys.readouterr()
    assert main([*args, "--quiet", "--plan-only"]) == 0
    says = capsys.readouterr().out.strip()
    result, steps, _ = _run_script(tmp_path, capsys, plain_corpus, [0], plan_says=says)
    assert result.returncode == 0, result.stdout
    assert steps == ["plan"]
    assert "finished: the dataset was up to date" in result.stdout
