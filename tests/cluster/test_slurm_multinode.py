"""``megatron-lns submit`` across nodes, on the multi-node test cluster
(``slurm/test-cluster/cluster.sh start DIR --nodes 3``: each node a slurmd in its own
network namespace, with its own address and hostname; docs/cluster.md):

- a 2-node x 2-task job (TP=2 within a node, DP=2 across the nodes, gloo over the
  namespaces' network) ends with exactly the losses of the same config on 4 local ranks;
- every task's rank environment comes from the compressed node list SLURM gives, and
  MASTER_ADDR (its first host) resolves on every node to rank 0's node;
- a preemption warning to both nodes saves, requeues and resumes bitwise; a node lost
  afterwards (off the network, its slurmd and ranks killed) makes SLURM requeue the
  job, which comes back on the remaining node and the third one and finishes with the
  uninterrupted losses (one job for both: every start-up of 4 ranks is expensive).

Needs ``SLURM_CONF`` of a cluster with 2 idle nodes (3, and ``cluster.sh``'s DIR, for the
interrupted job); skips without, except under CI=true, where it fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DEMO_CONFIG, ROOT, fresh_launch_env
from slurm_jobs import (
    JOB,
    MAX_STEPS,
    TERMINAL,
    logs,
    losses,
    require_cluster,
    start_requeued_soon,
    submit,
    submitting,
    trained_steps,
    wait_for_end,
    wait_until,
)

from megatron_lns.cluster.slurm.rank_env import expand_nodelist
from megatron_lns.runtime.fault_injection import FAULT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.long]  # one at a time: tests/conftest.py

TWO_NODES = ["trainer.num_nodes=2"]
CLUSTER_SH = ROOT / "slurm" / "test-cluster" / "cluster.sh"
LOCAL_RUN_TIMEOUT_S = 300
# SlurmdTimeout (20 s) until the lost node is DOWN, the requeue, and a restart.
NODE_LOSS_WAIT_S = 120


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    require_cluster(nodes=2)
    with submitting(tmp_path_factory.getbasetemp() / "corpus_cache") as submitted:
        yield submitted


@pytest.fixture(scope="module")
def two_node_run(slurm, tmp_path_factory):
    """The 2-node job, and (at the same time, on this machine) the same config on 4 local
    ranks: the same layout, TP=2 x DP=2, in one process group on one host."""
    job = submit(slurm, tmp_path_factory.mktemp("two_nodes"), *TWO_NODES)
    local_dir = tmp_path_factory.mktemp("four_local_ranks")
    overrides = [*JOB, "trainer.devices=4", f"exp_manager.exp_dir={local_dir}"]
    local = subprocess.Popen(
        [sys.executable, "-m", "megatron_lns.cli", "train", str(DEMO_CONFIG), *overrides],
        env=fresh_launch_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = local.communicate(timeout=LOCAL_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        local.kill()
        output, _ = local.communicate()
        pytest.fail(f"4 local ranks: no end after {LOCAL_RUN_TIMEOUT_S}s\n{output[-3000:]}")
    assert local.returncode == 0, output[-3000:]
    return job, wait_for_end(job), local_dir / "lns"


def test_two_node_job_matches_four_local_ranks_bitwise(two_node_run):
    job, state, local_run = two_node_run
    assert state["JobState"] == "COMPLETED", logs(job.run_dir)
    assert state["Restarts"] == "0" and state["NumNodes"] == "2"
    # A clean end, not the batch script's backstop for a rank that died while exiting
    # after the trainer finished ("terminate called without an active exception", issue
    # 35); benchmarks/slurm_repeat.py repeats this job to count such ends.
    assert f"finished at step {MAX_STEPS}\n" in job.log.read_text(), logs(job.run_dir)
    for log in job.log.parent.glob("*.log"):
        assert "terminate called" not in log.read_text(), log
    # Gloo's allreduce of two ranks adds the same two numbers whichever host they are
    # on: the curves are equal to the last bit, not approximately.
    assert [step for step, _ in losses(job.run_dir)] == list(range(1, MAX_STEPS + 1))
    assert losses(job.run_dir) == losses(local_run)


def test_job_starts_on_the_compressed_node_list(two_node_run):
    job, state, _ = two_node_run
    nodelist = state["NodeList"]
    assert re.fullmatch(r"[a-z0-9]+\[[0-9,-]+\]", nodelist), nodelist
    assert len(expand_nodelist(nodelist)) == 2
    assert f"restart 0: starting on {nodelist};" in job.log.read_text()


# Each task: its host, its address, the rank environment megatron-lns derives, and the
# address its MASTER_ADDR resolves to there.
RANK_PROBE = """
import os, socket
from megatron_lns.cluster.slurm.rank_env import rank_environment
env = rank_environment(os.environ)
host = socket.gethostname()
print(env["RANK"], host, socket.gethostbyname(host), os.environ["SLURM_JOB_NODELIST"],
      env["MASTER_ADDR"], socket.gethostbyname(env["MASTER_ADDR"]), flush=True)
"""


def test_every_rank_finds_rank_zero_through_the_first_host_of_the_node_list(slurm):
    result = subprocess.run(
        ["srun", "--nodes=2", "--ntasks-per-node=2", sys.executable, "-c", RANK_PROBE],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = sorted(line.split() for line in result.stdout.splitlines())
    assert [row[0] for row in rows] == ["0", "1", "2", "3"], result.stdout
    hosts = {row[1]: row[2] for row in rows}
    assert len(hosts) == 2 and len(set(hosts.values())) == 2, rows  # two hosts, two addresses
    nodelist = rows[0][3]
    assert re.fullmatch(r"[a-z0-9]+\[[0-9,-]+\]", nodelist), nodelist
    rank0_host, rank0_address = rows[0][1], rows[0][2]
    assert expand_nodelist(nodelist)[0] == rank0_host
    for _, _, _, _, master_addr, resolved in rows:
        assert master_addr == rank0_host and resolved == rank0_address, rows


def _cluster_dir() -> Path:
    """The directory `cluster.sh start` ran in: where SLURM_CONF is, with the network it
    made (needed to take one of its nodes down)."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    if not (conf.parent / "run" / "network").is_file():
        reason = f"{conf} is not a multi-node cluster.sh cluster (no run/network beside it)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    return conf.parent


def _cluster_sh(*args: str) -> None:
    result = subprocess.run([str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_preempted_then_lost_node_job_comes_back_each_time_and_ends_bitwise(
    slurm, two_node_run, tmp_path
):
    """One job, two interruptions (each 4-rank start-up costs ~40 s of this machine's
    two cores, so one job serves both): a preemption warning reaches both nodes, the
    job saves, requeues itself and resumes; then a node is lost, SLURM requeues the job
    onto the remaining capacity (the surviving node and the third), and it resumes from
    the newest checkpoint and finishes."""
    require_cluster(nodes=3)
    cluster = _cluster_dir()
    job = submit(
        slurm, tmp_path, *TWO_NODES, "exp_manager.checkpoint_callback_params.every_n_train_steps=3"
    )
    assert wait_until(job, trained_steps(job, 3), "step 3")["JobState"] == "RUNNING"
    subprocess.run(["scancel", "--signal=USR1", "--full", job.id], check=True)
    wait_until(job, lambda state: state["Restarts"] == "1", "requeue after USR1")
    stopped_at = int(job.log.read_text().split("restart 0: stopped at step ")[1].split(";")[0])
    assert 3 <= stopped_at < MAX_STEPS, stopped_at
    start_requeued_soon(job)

    # The node is lost once the second run has resumed: its ranks then hold the run
    # directory's lock and train the remaining steps (several seconds, with two saves;
    # polled at 0.2 s, the loss comes well before the end).
    def resumed(state):
        run_log = job.run_log(1)
        return state["JobState"] in TERMINAL or (
            run_log.is_file() and "resumed from" in run_log.read_text()
        )

    state = wait_until(job, resumed, "resume after USR1", poll_s=0.2)
    assert state["JobState"] == "RUNNING" and state["Restarts"] == "1", logs(job.run_dir)
    nodes = expand_nodelist(state["NodeList"])
    lost = nodes[1]  # not the batch script's node: that one lives on
    lost_number = re.search(r"(\d+)$", lost).group(1)
    _cluster_sh("kill-node", str(cluster), lost_number)
    try:
        state = wait_until(
            job,
            lambda state: state["Restarts"] == "2" or state["JobState"] in TERMINAL,
            "requeue after the node loss",
            NODE_LOSS_WAIT_S,
        )
        assert state["Restarts"] == "2", f"not requeued: {state}\n{logs(job.run_dir)}"
        start_requeued_soon(job)
        state = wait_for_end(job)
    finally:
        _cluster_sh("revive-node", str(cluster), lost_number)

    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "2", logs(job.run_dir)
    final_nodes = expand_nodelist(state["NodeList"])
    assert len(final_nodes) == 2 and lost not in final_nodes, (nodes, final_nodes)
    job_log = job.log.read_text()
    assert "requeueing (1 of at most 5)" in job_log, job_log
    assert "restart 2: starting on" in job_log and "requeued by SLURM" in job_log, job_log
    assert f"(step {stopped_at})" in job.run_log(1).read_text()
    assert "resumed from" in job.run_log(2).read_text()
    # Every step up to the preemption once (the requeue resumed exactly there); steps the
    # second run took before the node was lost again in the third; every one of them,
    # each time, with the uninterrupted job's loss.
    expected = dict(losses(two_node_run[0].run_dir))
    logged = losses(job.run_dir)
    assert [step for step, _ in logged[:stopped_at]] == list(range(1, stopped_at + 1))
    assert {step for step, _ in logged} == set(expected) == set(range(1, MAX_STEPS + 1))
    assert [(step, expected[step]) for step, _ in logged] == logged


# --- in-job restarts (docs/cluster.md#in-job-restarts) ----------------------------------

# Rank 3 is the second task of the second node: its crash is the node's.
CRASH_AT_STEP_3 = "kind=crash,rank=3,step=3"


def _in_job_restarts(job_log: str) -> list[str]:
    return [line for line in job_log.splitlines() if "restarting in-job" in line]


def test_a_node_that_failed_twice_is_left_out_for_the_spare_node(
    slurm, two_node_run, tmp_path, monkeypatch
):
    """A crashed rank restarts in-job, and a node that failed twice is left out: with
    cluster.spare_nodes=1 the job holds all three nodes and trains on two. Rank 3 (on the
    second of them) SIGKILLs itself in step 3, after the checkpoint of step 2, in attempts 0
    and 1: srun ends the step, the batch script runs it again in the same allocation (no
    requeue) from step 2; the third attempt runs without that node, on the first and the
    spare, and the curve is the uninterrupted job's to the last bit. (The script's other
    decisions, such as ending the job after restarts that commit nothing newer, are tested
    with an srun stand-in in test_slurm_render.py, and with real ranks by
    tests/training/test_in_job_restart.py.)"""
    require_cluster(nodes=3)
    monkeypatch.setenv(FAULT_ENV, f"{CRASH_AT_STEP_3};{CRASH_AT_STEP_3},attempt=1")
    job = submit(
        slurm,
        tmp_path,
        *TWO_NODES,
        "cluster.spare_nodes=1",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
    )
    state = wait_for_end(job)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "0", logs(job.run_dir)
    assert state["NumNodes"] == "3"
    job_log = job.log.read_text()
    failed = re.findall(r"attempt [01] failed: task 3 on (\S+): Killed", job_log)
    assert len(failed) == 2 and failed[0] == failed[1], job_log
    assert f"{failed[0]} failed twice: left out of the next srun (spare node 1 of 1" in job_log
    restarts = _in_job_restarts(job_log)
    assert len(restarts) == 2 and "requeu" not in job_log, job_log
    expected = f"attempt 0 failed: task 3 on {failed[0]}: Killed; restarting in-job (1 of"
    assert expected + " at most 3) from the checkpoint of step 2" in restarts[0], job_log
    assert "fault injection: crash on rank 3 at step 3" in job.run_log(0).read_text()
    assert "restarted 2 attempt=1" in (job.run_dir / "run_progress").read_text()
    logged = losses(job.run_dir)
    assert [step for step, _ in logged] == list(range(1, MAX_STEPS + 1)), logged
    assert logged == losses(two_node_run[0].run_dir)


def test_without_a_spare_the_job_requeues_itself_without_the_node_that_failed_twice(
    slurm, two_node_run, tmp_path, monkeypatch
):
    """Rank 3 crashes in step 3 of attempt 0 and in step 5 of attempt 1 (after the
    checkpoint of step 4: progress, so the restarts go on); its node has failed twice and
    there is no spare: the job requeues itself excluding that node, comes back on the other
    two and finishes with the uninterrupted losses."""
    require_cluster(nodes=3)
    monkeypatch.setenv(FAULT_ENV, f"{CRASH_AT_STEP_3};kind=crash,rank=3,step=5,attempt=1")
    job = submit(
        slurm, tmp_path, *TWO_NODES, "exp_manager.checkpoint_callback_params.every_n_train_steps=2"
    )
    wait_until(job, lambda state: state["Restarts"] == "1", "requeue", 300)
    start_requeued_soon(job)
    state = wait_for_end(job)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", logs(job.run_dir)
    job_log = job.log.read_text()
    failed = re.findall(r"attempt [01] failed: task 3 on (\S+): Killed", job_log)
    assert len(failed) == 2 and failed[0] == failed[1], job_log
    bad = failed[0]
    assert f"{bad} failed twice and no spare node is left: requeueing without {bad}" in job_log
    assert f"(requeued by this job to leave out {bad}, which failed twice)" in job_log
    assert state["ExcNodeList"] == bad and bad not in expand_nodelist(state["NodeList"])
    logged = losses(job.run_dir)
    assert {step for step, _ in logged} == set(range(1, MAX_STEPS + 1))
    expected = dict(losses(two_node_run[0].run_dir))
    assert [(step, expected[step]) for step, _ in logged] == logged
