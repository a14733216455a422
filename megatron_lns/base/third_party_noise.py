"""Warnings and log lines of third-party code that say nothing about the user's run.

Every process of megatron-lns quiets them first: the command line, each SLURM task and
each local rank (spawned ranks start with fresh warning filters).
"""

from __future__ import annotations

import logging
import warnings

# Modules whose import-time and per-call warnings say nothing about the user's run:
# megatron-core (missing apex/TE, its own deprecations), Transformer Engine, apex, and
# the torch internals megatron drives. Warnings from anywhere else, the user's code
# included, are shown.
THIRD_PARTY_NOISE = r"(megatron|transformer_engine|apex|torch)(\..*)?$"

# torch's deprecation of its ShardedTensor, which megatron-core's torch_dist checkpoints
# still build on every load (resume, export, analyze). torch attributes the warning to
# its caller: megatron-core's own module on a GPU (quiet above), but on CPU the mode that
# redirects megatron's torch calls (``runtime/cpu.py``) makes the call, so it is named;
# this one warning, not everything said there.
SHARDED_TENSOR_DEPRECATION = r"Please use DTensor instead and we are deprecating ShardedTensor"
CPU_REDIRECT_MODULE = r"megatron_lns\.runtime\.cpu$"


def quiet_third_party_noise() -> None:
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY_NOISE)
    warnings.filterwarnings(
        "ignore",
        message=SHARDED_TENSOR_DEPRECATION,
        category=FutureWarning,
        module=CPU_REDIRECT_MODULE,
    )
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    # torch's extension loader logs "No CUDA runtime is found" on CPU-only hosts.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
