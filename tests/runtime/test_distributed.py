"""Process groups: initialising again (layout after layout in one process) replaces
megatron's groups instead of leaving the old ones alive beside the new; local ranks' rendezvous
port."""

import socket

from torch.distributed import distributed_c10d

from megatron_lns.runtime import ParallelLayout, init_distributed


def test_initializing_again_replaces_the_groups(megatron_world1):
    init_distributed(ParallelLayout(), device="cpu")
    groups = len(distributed_c10d._world.pg_map)
    assert groups > 1  # the default group and megatron's
    init_distributed(ParallelLayout(), device="cpu")
    assert len(distributed_c10d._world.pg_map) == groups


_WORLD_OF_ONE = """
import socket
import os, sys
from megatron_lns.runtime import ParallelLayout, init_distributed
import torch.distributed as dist

init_distributed(ParallelLayout(), device="cpu")
dist.barrier()
from megatron_lns.runtime.launcher_env import ADDRESS_VARIABLES, RANK_VARIABLES
print(dist.get_world_size(), sorted(set(os.environ) & {*RANK_VARIABLES, *ADDRESS_VARIABLES}))
"""


def test_a_world_of_one_writes_no_launcher_variables_into_the_environment():
    """Left in os.environ, RANK and MASTER_PORT would make every subprocess started later
    try to join this world (a fresh interpreter: this one's world is initialised)."""
    import subprocess
    import sys

    from helpers import ROOT, fresh_launch_env

    out = subprocess.run(
        [sys.executable, "-c", _WORLD_OF_ONE],
        cwd=ROOT,
        env=fresh_launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "1 []"


def test_local_ranks_get_a_free_port_below_the_ephemeral_range():
    """An outgoing connection of any process can take a port of the ephemeral range between
    the draw and rank 0's listen; a port below it is taken only by a listener."""
    from megatron_lns.runtime.distributed import _ephemeral_port_floor, free_port

    floor = _ephemeral_port_floor()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < floor for port in ports)
    assert len(ports) > 1  # drawn, not one fixed port
    held = socket.socket()
    held.bind(("127.0.0.1", ports.pop()))
    held.listen()
    try:
        assert held.getsockname()[1] not in {free_port() for _ in range(50)}
    finally:
        held.close()
