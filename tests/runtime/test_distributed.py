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
