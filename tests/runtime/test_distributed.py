"""Process groups: initialising again (layout after layout in one process) replaces
megatron's groups instead of leaving the old ones alive beside the new."""

from torch.distributed import distributed_c10d

from megatron_lns.runtime import ParallelLayout, init_distributed


def test_initializing_again_replaces_the_groups(megatron_world1):
    init_distributed(ParallelLayout(), device="cpu")
    groups = len(distributed_c10d._world.pg_map)
    assert groups > 1  # the default group and megatron's
    init_distributed(ParallelLayout(), device="cpu")
    assert len(distributed_c10d._world.pg_map) == groups


_WORLD_OF_ONE = """
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
