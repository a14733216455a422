"""What each srun task of a megatron-lns SLURM job runs.

``python -m megatron_lns.launch.task CONFIG.yaml`` sets the torch.distributed variables
from SLURM's (one task per GPU, so the SLURM task is the rank) and then trains as
``megatron-lns train CONFIG.yaml`` does, through the same entry point
(:func:`megatron_lns.training.entry_point.train`): the same loading, checks and training,
in the SLURM job's environment (:mod:`.environment`).
"""

from __future__ import annotations

import os
import sys

from megatron_lns.base.third_party_noise import quiet_third_party_noise
from megatron_lns.cluster.slurm.environment import SlurmEnvironment
from megatron_lns.cluster.slurm.rank_env import SlurmEnvironmentError, rank_environment


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m megatron_lns.launch.task CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        os.environ.update(rank_environment(os.environ))
        # Not SLURM's: a value inherited from the submitting shell would contradict these.
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    except SlurmEnvironmentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    quiet_third_party_noise()
    from megatron_lns.base.exit_status import exit_status
    from megatron_lns.training.entry_point import train

    job = SlurmEnvironment.of_this_process()  # rank_environment required SLURM_JOB_ID
    return exit_status(lambda: train(args[0], [], job=job))


if __name__ == "__main__":
    sys.exit(main())
