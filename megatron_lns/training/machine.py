"""What this machine offers a run, checked before any rank starts.

The config layer's rules hold on any machine (``config/validate.py``); these depend on the
one that runs: CUDA, Transformer Engine and its version, FP8 support, Apex's kernels, the
megatron-core model classes. The launcher runs :func:`check_environment` after
``validate``; every rank builds its model with :func:`fast_paths_here`.
"""

from __future__ import annotations

import importlib.util

from megatron_lns.config.fast_paths import (
    SOFTMAX_EXTENSIONS,
    WGRAD_EXTENSION,
    FastPaths,
    MachineFacts,
)
from megatron_lns.config.loader import ConfigError
from megatron_lns.config.performance import check_performance_environment, resolved_fast_paths
from megatron_lns.config.schema import ExperimentConfig

# Minimum CUDA compute capability per FP8 recipe (Ada/Hopper for FP8, Blackwell for MXFP8).
FP8_MIN_CAPABILITY = {
    "delayed": (8, 9),
    "tensorwise": (8, 9),
    "blockwise": (9, 0),
    "mxfp8": (10, 0),
}
# Minimum CUDA version PyTorch is built with, per FP8 recipe (Transformer Engine's
# check_fp8_block_scaling_support: block-scaled GEMMs need cuBLAS from CUDA 12.9).
FP8_MIN_CUDA = {"blockwise": (12, 9)}


def detect_machine(cuda: bool) -> MachineFacts:
    """The facts of this machine, for a run on CUDA (``cuda``) or on CPU."""

    from megatron_lns.model import te

    def importable(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return MachineFacts(
        cuda=cuda,
        transformer_engine=cuda and te.te_available(),
        softmax_kernels=cuda and all(importable(name) for name in SOFTMAX_EXTENSIONS),
        wgrad_accumulation_kernel=cuda and importable(WGRAD_EXTENSION),
    )


def fast_paths_here(cfg: ExperimentConfig, cuda: bool) -> FastPaths:
    """The fast paths of this config on this machine, running on CUDA or not: what the
    launcher checks before any rank starts and what every rank builds its model with."""
    return resolved_fast_paths(cfg, detect_machine(cuda=cuda))


def check_environment(cfg: ExperimentConfig) -> None:
    """What the machine must offer for this config (CUDA, Transformer Engine, FP8 support,
    megatron-core's ``GPTModel`` for ``model.architecture=gpt``).

    Separate from :func:`validate` so a config can be checked on any machine; the
    launcher runs both before any process starts.
    """
    import torch

    from megatron_lns.model import language_model, te

    m = cfg.model
    if m.architecture == "gpt":
        language_model.gpt_model_class()  # megatron-core without GPTModel: one line naming the fix
    cuda = torch.cuda.is_available()
    if cfg.trainer.accelerator == "gpu" and not cuda:
        raise ConfigError("trainer.accelerator=gpu but CUDA is not available on this machine")
    if m.transformer_engine:
        if not cuda:
            raise ConfigError("model.transformer_engine=true needs a CUDA GPU")
        if not te.te_available():
            raise ConfigError(f"model.transformer_engine=true: {te.INSTALL_HINT}")
        from megatron.core.utils import get_te_version, is_te_min_version

        if not is_te_min_version(te.TE_MIN_VERSION):
            raise ConfigError(
                f"model.transformer_engine=true needs Transformer Engine >= {te.TE_MIN_VERSION} "
                f"(installed: {get_te_version()}): install megatron-lns[te]"
            )
    if m.optim.name == "distributed_fused_adam":
        from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

        if not HAVE_APEX_OR_TE:
            # megatron-core's DistributedOptimizer cannot rebuild its state for a
            # checkpoint load with plain torch optimizers (empty-state assertion).
            raise ConfigError(
                "model.optim.name=distributed_fused_adam needs Transformer Engine or Apex "
                "(megatron's distributed optimizer cannot resume from a checkpoint without "
                "them); use fused_adam, or install Transformer Engine on a CUDA machine"
            )
    if m.fp8 is not None:
        needed = FP8_MIN_CAPABILITY[m.fp8]
        capability = torch.cuda.get_device_capability() if cuda else None
        if capability is None or tuple(capability) < needed:
            if capability is None:
                have = "no CUDA GPU"
            else:
                major, minor = capability
                have = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"
            raise ConfigError(
                f"model.fp8={m.fp8} needs compute capability >= {needed[0]}.{needed[1]}, "
                f"this machine has {have}"
            )
        needed_cuda = FP8_MIN_CUDA.get(m.fp8)
        built = torch.version.cuda
        if needed_cuda and (built is None or _version_tuple(built) < needed_cuda):
            have = f"built with CUDA {built}" if built else "not built with CUDA"
            raise ConfigError(
                f"model.fp8={m.fp8} needs CUDA >= {needed_cuda[0]}.{needed_cuda[1]}, "
                f"this PyTorch is {have}"
            )
    check_performance_environment(cfg, cuda)
    # Fusions and overlaps the user set must run on this machine.
    fast_paths_here(cfg, cuda=cuda and cfg.trainer.accelerator != "cpu")


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"12.8"`` -> ``(12, 8)`` (compared as numbers, so 12.10 > 12.9)."""
    return tuple(int(part) for part in version.split(".") if part.isdigit())
