"""``megatron-lns preprocess ... --submit`` on the multi-node test cluster
(``slurm/test-cluster/cluster.sh start DIR --nodes 3``; docs/cluster.md):

- a 2-node job writes the same bytes as one process does (.bin, .idx, .json);
- a job one of whose tasks is killed midway (stopped once some of its units are done,
  then SIGKILLed: found by the pid its unit's lock names) still ends COMPLETED with the
  same bytes: the script runs the tokenize step again, which redoes the killed task's
  unfinished units only; the units finished before the kill keep their receipts untouched.

32 gzipped JSONL shards of the demo corpus and the tests' Hugging Face tokenizer; about
20 s of cluster time. Needs ``SLURM_CONF`` of a cluster with 2 idle nodes; skips without,
except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
from slurm_jobs import Job, logs, require_cluster, submitting, wait_for_end

from megatron_lns.cli import main
from megatron_lns.data.corpus_inputs import expand_inputs
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.preprocess import CorpusRun, preprocess_corpus
from megatron_lns.data.preprocess_plan import plan_units, task_share
from megatron_lns.data.unit_worker import TokenizerSpec

pytestmark = [pytest.mark.slow, pytest.mark.long]  # one at a time: tests/conftest.py

SHARDS = 32
DOCUMENTS_PER_SHARD = 600  # ~55 ms of the tokenizer per unit: a task can be caught midway
KILL_WAIT_S = 120


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, factory):
    """The shards, the tokenizer's arguments, and the one-process run's files."""
    root = tmp_path_factory.mktemp("corpus")
    docs = demo_documents()
    for i in range(SHARDS):
        chosen = [docs[(i * 97 + j) % len(docs)] for j in range(DOCUMENTS_PER_SHARD)]
        lines = "".join(json.dumps({"text": d}) + "\n" for d in chosen)
        (root / "shards" / f"{i:02d}.jsonl.gz").parent.mkdir(exist_ok=True)
        (root / "shards" / f"{i:02d}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    tokenizer = factory.tokenizer("huggingface")
    inputs = [str(root / "shards" / "*.jsonl.gz")]
    spec = TokenizerSpec("huggingface", tokenizer.type, None)
    preprocess_corpus(CorpusRun(inputs, root / "one" / "corpus", spec, workers=1))
    arguments = ["--input", *inputs, "--tokenizer-library", "huggingface"]
    arguments += ["--tokenizer-type", tokenizer.type, "--workers", "1"]
    return arguments, _files(root / "one" / "corpus"), inputs


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    require_cluster(nodes=2)
    with submitting(tmp_path_factory.getbasetemp() / "corpus_cache") as submitted:
        yield submitted


def _files(prefix: Path) -> dict[str, bytes]:
    return {s: Path(f"{prefix}{s}").read_bytes() for s in (".bin", ".idx", ".json")}


def _submit(submitted: list[str], arguments: list[str], prefix: Path) -> Job:
    config = prefix.parent / "cluster.yaml"
    config.write_text('cluster:\n  time_limit: "10"\n')
    stdout, stderr = io.StringIO(), io.StringIO()
    args = ["preprocess", *arguments, "--output-prefix", str(prefix)]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([*args, "--submit", str(config), "--nodes", "2"])
    assert code == 0, stderr.getvalue()
    first, second = stdout.getvalue().splitlines()
    job_id = first.split()[2].rstrip(":")
    submitted.append(job_id)
    log = Path(second.removeprefix("job log: "))
    assert log.parent == Path(f"{prefix}.parts") / "slurm" / "logs", second
    return Job(job_id, log.parent.parent, log)


def _ended(job: Job) -> str:
    state = wait_for_end(job)
    assert state["JobState"] == "COMPLETED", f"{state}\n{logs(job.run_dir)}"
    return job.log.read_text()


def test_two_nodes_write_the_bytes_of_one_process(slurm, corpus, tmp_path):
    arguments, one_process, inputs = corpus
    prefix = tmp_path / "two" / "corpus"
    prefix.parent.mkdir()
    log = _ended(_submit(slurm, arguments, prefix))
    assert _files(prefix) == one_process, log
    units = plan_units(expand_inputs(inputs))
    for task in (0, 1):
        n = len(task_share(units, task, 2))
        assert f"{task}: task {task}/2: {n} units, {n} tokenized now, 0 done before" in log
    assert "step 3/3: merge" in log and log.rstrip().endswith("finished")


def test_a_task_killed_midway_is_redone_and_nothing_else(slurm, corpus, tmp_path):
    arguments, one_process, inputs = corpus
    prefix = tmp_path / "killed" / "corpus"
    prefix.parent.mkdir()
    share, other = (task_share(plan_units(expand_inputs(inputs)), t, 2) for t in (0, 1))
    units = Path(f"{prefix}.parts") / "units"
    job = _submit(slurm, arguments, prefix)

    # Task 0 is stopped as soon as it holds its third unit's lock ("pid N on HOST"),
    # then killed: some of its units are done, the others not, one maybe half-written.
    pid = _lock_holder(job, units / f"{share[2].name}.lock")
    os.kill(pid, signal.SIGSTOP)
    finished = {p.name: p.stat().st_mtime_ns for p in units.glob("[0-9]*[0-9].json")}
    done = [u for u in share if f"{u.name}.json" in finished]
    assert 2 <= len(done) < len(share), f"task 0 was not caught midway: {len(done)} done"
    os.kill(pid, signal.SIGKILL)

    log = _ended(job)
    assert _files(prefix) == one_process, log
    assert "tokenize: failed with status" in log and "retry 1 of 2" in log, log
    rest = len(share) - len(done)
    assert f"0: task 0/2: {len(share)} units, {rest} tokenized now, {len(done)} done" in log
    assert f"1: task 1/2: {len(other)} units, 0 tokenized now, {len(other)} done before" in log
    now = {name: (units / name).stat().st_mtime_ns for name in finished}
    assert now == finished, "a unit finished before the kill was written again"
    assert not list(units.glob("*.tmp-*")), "the killed unit's temporaries are left"


def _lock_holder(job: Job, lock: Path) -> int:
    """The pid a unit's lock names, once a process has taken it."""
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            words = lock.read_text().split()  # "pid N on HOST"; empty while being written
            if len(words) == 4 and words[0] == "pid":
                return int(words[1])
        time.sleep(0.005)
    pytest.fail(f"no process took {lock} within {KILL_WAIT_S} s\n{logs(job.run_dir)}")
