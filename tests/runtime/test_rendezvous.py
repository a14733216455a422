"""A rank whose peers never come ends within trainer.rendezvous_timeout_s, or at once on
SIGTERM, in one line saying whom it waited for at which address; ranks that all come
meet as before."""

import os
import re
import signal
import subprocess
import sys
import threading

import pytest
from helpers import DEMO_CONFIG, ROOT, TINY_RUN_OVERRIDES, fresh_launch_env

from megatron_lns.runtime.distributed import free_port

# One rank's rendezvous and nothing else (torch's import, not megatron's training stack).
RANK = """
import sys
from megatron_lns.base.exit_status import exit_status
from megatron_lns.runtime.launcher_env import launcher_environment
from megatron_lns.runtime.rendezvous import rendezvous_store
sys.exit(exit_status(lambda: print("met", rendezvous_store(launcher_environment(), float(sys.argv[1])) is not None)))
"""


def _rank(rank: int, port: int, timeout_s: float, world: int = 2) -> subprocess.Popen:
    env = fresh_launch_env(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(timeout_s)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen, seconds: float = 120) -> tuple[str, str]:
    """Bounded: before the fix a rank waited 30 minutes and ignored SIGTERM."""
    timer = threading.Timer(seconds, process.kill)
    timer.start()
    try:
        return process.communicate()
    finally:
        timer.cancel()


@pytest.mark.slow
def test_a_rank_whose_peers_never_come_ends_after_the_timeout():
    """Rank 0 whose rank 1 never starts, and a rank 1 whose rank 0 never listens (at the
    same time, on two ports: each start costs torch's import)."""
    ports = [free_port(), free_port()]
    alone = [_rank(0, ports[0], timeout_s=2), _rank(1, ports[1], timeout_s=2)]
    whom = [
        f"rank 0 of 2 waited for the other 1 rank(s) at 127.0.0.1:{ports[0]}",
        f"rank 1 of 2 waited for rank 0's store at 127.0.0.1:{ports[1]}",
    ]
    for process, waited in zip(alone, whom, strict=True):
        _, stderr = _finish(process)
        assert process.returncode == 2, stderr
        assert re.match(
            re.escape(f"error: {waited} for ")
            + r"\d+ s and gave up \(trainer\.rendezvous_timeout_s=2; torch: .*\)\. Likely "
            + re.escape("cause: the launcher environment (RANK="),
            stderr,
        ), stderr
        assert stderr.count("\n") == 1  # torch's C++ stack trace held back


def test_sigterm_during_the_wait_ends_the_rank_at_once():
    port = free_port()
    rank0 = _rank(0, port, timeout_s=600)
    timer = threading.Timer(120, rank0.kill)
    timer.start()
    try:
        announced = rank0.stderr.readline()  # after 5 s of waiting
        rank0.send_signal(signal.SIGTERM)
        _, rest = rank0.communicate(timeout=30)
    finally:
        timer.cancel()
    assert announced.startswith(
        f"rank 0 of 2 is waiting for the other 1 rank(s) at 127.0.0.1:{port} (up to 600 s, "
        "trainer.rendezvous_timeout_s)"
    ), announced
    assert rank0.returncode == 2, rest
    assert rest.startswith("error: stopped by SIGTERM after "), rest
    assert f"s while rank 0 of 2 waited for the other 1 rank(s) at 127.0.0.1:{port}" in rest
    assert rest.count("\n") == 1


@pytest.mark.slow  # the multi-rank tests meet this way too (spawn_local)
def test_ranks_that_all_come_meet():
    port = free_port()
    ranks = [_rank(rank, port, timeout_s=60) for rank in (1, 0)]  # rank 1 first: it retries
    for process in ranks:
        stdout, stderr = _finish(process)
        assert process.returncode == 0, stderr
        assert stdout == "met True\n"


@pytest.mark.slow
@pytest.mark.usefixtures("private_corpus_cache")
def test_train_ends_after_trainer_rendezvous_timeout_s(tmp_path):
    """The setting reaches the trainer's rendezvous (rank 0 of 2, rank 1 never started)."""
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    train = subprocess.Popen(
        [
            sys.executable, "-m", "megatron_lns.cli", "train", str(DEMO_CONFIG),
            *TINY_RUN_OVERRIDES, f"exp_manager.exp_dir={tmp_path}", "trainer.devices=2",
            "trainer.rendezvous_timeout_s=2",
        ],
        cwd=ROOT,
        env=fresh_launch_env(
            MEGATRON_LNS_CACHE=os.environ["MEGATRON_LNS_CACHE"], MASTER_PORT=str(port), **env
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    _, stderr = _finish(train, 300)
    assert train.returncode == 2, stderr
    assert stderr.startswith(
        f"error: rank 0 of 2 waited for the other 1 rank(s) at 127.0.0.1:{port} for "
    ), stderr
    assert "(trainer.rendezvous_timeout_s=2; torch: " in stderr
    assert stderr.count("\n") == 1
