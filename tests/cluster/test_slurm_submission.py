"""What a submission leaves behind: nothing when sbatch refuses it, whether training's
(in the run directory) or preprocessing's (in ``PREFIX.parts/``), and a run submitted
but not started is reported as such by ``status`` (with its job id)."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys

import pytest
from helpers import DEMO_CONFIG, wait_while_running

from megatron_lns.cli import main
from megatron_lns.cluster.slurm import sbatch as sbatch_step
from megatron_lns.cluster.slurm.sbatch import SubmitError, submit_script

TINY = ["trainer.max_steps=4", "model.num_layers=2", "model.optim.sched.warmup_steps=1"]


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    """An sbatch on PATH that answers as $FAKE_SBATCH says: a job id, or a refusal."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        "#!/bin/bash\nif [[ $FAKE_SBATCH == refuse ]]; then\n"
        '    echo "sbatch: error: invalid partition specified: nope" >&2; exit 1\nfi\n'
        'if [[ $FAKE_SBATCH == hang ]]; then touch "$FAKE_SBATCH_STARTED"; exec sleep 60; fi\n'
        "if [[ $FAKE_SBATCH == silent ]]; then exit 0; fi\n"
        'if [[ $FAKE_SBATCH == banner ]]; then echo "site: job sent to the gpu partition"; fi\n'
        "echo 4242\n"
    )
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_a_refused_submission_leaves_the_run_directory_as_it_was(fake_sbatch, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_SBATCH", "refuse")
    assert main(["submit", str(DEMO_CONFIG), *TINY, "exp_manager.exp_dir=runs"]) == 2
    assert "invalid partition specified" in capsys.readouterr().err
    assert list(fake_sbatch.iterdir()) == []
    # A run directory that was there keeps what it held, and only that.
    run_dir = fake_sbatch / "runs" / "lns"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "old.log").write_text("x")
    assert main(["submit", str(DEMO_CONFIG), *TINY, "exp_manager.exp_dir=runs"]) == 2
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")) == [
        "logs",
        "logs/old.log",
    ]


def _preprocess_submission(work):
    """``preprocess --submit`` of a one-shard corpus beside ``work`` into ``work/corpus``."""
    data = work.parent / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "s0.jsonl.gz").write_bytes(gzip.compress(json.dumps({"text": "doc"}).encode()))
    (work.parent / "cluster.yaml").write_text("cluster: {}\n")
    command = ["preprocess", "--input", str(data / "*.jsonl.gz")]
    command += ["--output-prefix", str(work / "corpus"), "--nodes", "2"]
    return [*command, "--submit", str(work.parent / "cluster.yaml")]


def test_an_accepted_preprocess_submission_keeps_its_script_and_job_id(
    fake_sbatch, capsys, monkeypatch
):
    monkeypatch.setenv("FAKE_SBATCH", "accept")
    assert main(_preprocess_submission(fake_sbatch)) == 0
    out = capsys.readouterr().out.splitlines()
    (script,) = (fake_sbatch / "corpus.parts" / "slurm").glob("*/job.sbatch")
    assert out[0] == f"submitted job 4242: {script}"
    assert (script.parent / "job_id").read_text() == "4242\n"
    assert out[1].startswith(f"job log: {fake_sbatch}/corpus.parts/slurm/logs/"), out


def test_a_job_id_is_read_from_sbatchs_last_line_or_its_absence_said(
    fake_sbatch, capsys, monkeypatch
):
    """An sbatch that printed no id was taken at its word: "submitted job :" and an empty
    job_id; a site's wrapper printing a line before the id made that line the id."""
    command = ["submit", str(DEMO_CONFIG), *TINY, "exp_manager.exp_dir=runs"]
    monkeypatch.setenv("FAKE_SBATCH", "banner")
    assert main(command) == 0
    assert capsys.readouterr().out.startswith("submitted job 4242: ")
    monkeypatch.setenv("FAKE_SBATCH", "silent")
    assert main([*command, "exp_manager.name=silent"]) == 2
    [error] = capsys.readouterr().err.splitlines()
    (script,) = (fake_sbatch / "runs" / "silent").glob("slurm/*/job.sbatch")
    assert error == (
        f"error: sbatch accepted {script} but printed no job id (nothing): squeue shows "
        "whether the job is queued"
    )
    assert not (script.parent / "job_id").exists()  # the job may run: its files stay


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
def test_a_stop_while_sbatch_runs_takes_the_submission_back(fake_sbatch, monkeypatch, stop):
    """A SIGTERM, or the SIGHUP of a closed terminal, while sbatch waited on the controller
    ended the command by default action: its script stayed without a job id, which
    ``status`` then called a job submitted."""
    started = fake_sbatch.parent / "sbatch started"
    monkeypatch.setenv("FAKE_SBATCH", "hang")
    monkeypatch.setenv("FAKE_SBATCH_STARTED", str(started))
    command = ["submit", str(DEMO_CONFIG), *TINY, "exp_manager.exp_dir=runs"]
    submit = subprocess.Popen(
        [sys.executable, "-m", "megatron_lns.cli", *command], stderr=subprocess.PIPE, text=True
    )
    wait_while_running(submit, started.exists, 120, "sbatch was not run")
    submit.send_signal(stop)
    assert submit.wait(timeout=60) == -stop, submit.stderr.read()
    assert list(fake_sbatch.iterdir()) == []


def test_a_refused_preprocess_submission_leaves_no_submission_folder(
    fake_sbatch, capsys, monkeypatch
):
    """``preprocess --submit`` left its slurm/<time>/ folder (and the logs folder beside
    it) when sbatch refused the job; it rolls back as training's ``submit`` does."""
    monkeypatch.setenv("FAKE_SBATCH", "refuse")
    command = _preprocess_submission(fake_sbatch)
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: sbatch refused "), error
    assert error.endswith("invalid partition specified: nope\n"), error
    assert len(error.splitlines()) == 1, error
    assert list(fake_sbatch.iterdir()) == []
    # Parts that were there keep what they held, and only that.
    parts = fake_sbatch / "corpus.parts"
    (parts / "slurm" / "logs").mkdir(parents=True)
    (parts / "slurm" / "logs" / "old.log").write_text("x")
    assert main(command) == 2
    assert sorted(p.relative_to(parts).as_posix() for p in parts.rglob("*")) == [
        "slurm",
        "slurm/logs",
        "slurm/logs/old.log",
    ]
    # An output in a directory not made yet: the refusal leaves none of it either.
    unmade = fake_sbatch / "new" / "dir"
    assert main(_preprocess_submission(unmade)) == 2
    assert not unmade.exists()


def test_a_submission_into_a_folder_that_is_there_leaves_it_alone(fake_sbatch, monkeypatch):
    """The rollback removes only what the submission made: a folder another submission of
    the same second made, before this one looked or after, stays with what it holds."""
    monkeypatch.setenv("FAKE_SBATCH", "accept")
    folder = fake_sbatch / "slurm" / "earlier"
    folder.mkdir(parents=True)
    (folder / "job.sbatch").write_text("earlier")
    with pytest.raises(SubmitError, match="File exists"):
        submit_script(folder, "#!/bin/bash\n", fake_sbatch, fake_sbatch / "logs")
    assert (folder / "job.sbatch").read_text() == "earlier"
    assert sorted(p.name for p in fake_sbatch.rglob("*")) == ["earlier", "job.sbatch", "slurm"]

    racing = fake_sbatch / "slurm" / "racing"
    looked = sbatch_step._missing_directories

    def made_meanwhile(*paths):
        missing = looked(*paths)
        racing.mkdir()
        (racing / "config.yaml").write_text("the other job's")
        return missing

    monkeypatch.setattr(sbatch_step, "_missing_directories", made_meanwhile)
    with pytest.raises(SubmitError, match="File exists"):
        submit_script(racing, "#!/bin/bash\n", fake_sbatch, fake_sbatch / "logs")
    assert (racing / "config.yaml").read_text() == "the other job's"


def test_status_of_a_run_submitted_but_not_started_says_so_with_its_job_id(
    fake_sbatch, capsys, monkeypatch
):
    monkeypatch.setenv("FAKE_SBATCH", "accept")
    assert main(["submit", str(DEMO_CONFIG), *TINY, "exp_manager.exp_dir=runs"]) == 0
    capsys.readouterr()
    run_dir = fake_sbatch / "runs" / "lns"
    assert main(["status", str(run_dir)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{run_dir}: submitted as SLURM job 4242 ("), line
    assert "not started yet" in line
    # The experiment directory names the run, not its slurm/<time>/ folder.
    assert main(["status", str(run_dir.parent)]) == 2
    error = capsys.readouterr().err
    assert f"holds the run {run_dir}: give that one" in error, error
    # --json names the job too; null where the submission recorded no id.
    assert main(["status", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (script,) = run_dir.glob("slurm/*/job.sbatch")
    queued = {"run_dir": str(run_dir), "state": "not started", "job_id": "4242"}
    assert report == queued | {"job_script": str(script)}
    for job_id in run_dir.glob("slurm/*/job_id"):
        job_id.unlink()
    assert main(["status", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job_id"] is None
    # A job_id that is not text is no id either (it was a traceback).
    (script.parent / "job_id").write_bytes(b"\xff\xfe")
    assert main(["status", str(run_dir)]) == 0
    assert "a SLURM job whose id was not recorded" in capsys.readouterr().out
