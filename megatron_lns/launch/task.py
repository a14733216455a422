"""``python -m megatron_lns.launch.task CONFIG.yaml``: one srun task of a SLURM job.

The fixed path that batch scripts name (see :mod:`megatron_lns.launch`); the task itself
is :mod:`megatron_lns.cluster.slurm.task`.
"""

import sys

from megatron_lns.cluster.slurm.task import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
