"""Transformer Engine's userbuffers, for tensor-parallel communication overlap.

With ``tp_comm_overlap`` megatron-core's Transformer Engine linears overlap the
sequence-parallel all-gather before a GEMM and the reduce-scatter after it with the GEMM
itself. The communication runs through buffers ("userbuffers") that Transformer Engine
allocates once per process, for one activation shape, before any layer is built:
Megatron-LM does it in ``_initialize_tp_communicators``, NeMo in ``initialize_ub_func``,
and megatron-lns's trainer through :func:`initialize_userbuffers`.

The buffer holds a whole (sequence x micro-batch / context-parallel size, hidden)
activation of one tensor-parallel group; the per-GEMM settings (overlap method, SMs, splits)
are Transformer Engine's ``ub_cfgs``. Transformer Engine silently skips a GEMM name it does
not know, so :func:`read_userbuffer_settings` checks the names first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from megatron_lns.base.errors import UserError
from megatron_lns.base.path_kind import not_a_file

if TYPE_CHECKING:
    import torch

# The GEMMs Transformer Engine overlaps (keys of initialize_ub's ub_cfgs): the QKV, attention
# output projection, FC1 and FC2 linears, forward (fprop) and both backward GEMMs, as
# Transformer Engine 2.8-2.18 name them.
GEMM_NAMES = (
    "qkv_fprop",
    "qkv_dgrad",
    "qkv_wgrad",
    "proj_fprop",
    "proj_dgrad",
    "fc1_fprop",
    "fc1_dgrad",
    "fc1_wgrad",
    "fc2_fprop",
    "fc2_dgrad",
    "proj_wgrad",
    "fc2_wgrad",
)


class UserbufferSettingsError(UserError, ValueError):
    """Userbuffer settings that cannot be read or name a GEMM Transformer Engine lacks."""


def read_userbuffer_settings(source: str | Path | Mapping | None, key: str) -> dict | None:
    """Per-GEMM userbuffer settings from a YAML file or a mapping (``None``: TE's defaults).

    ``key`` names the setting in errors (the config key the source came from).
    """
    if source is None:
        return None
    if isinstance(source, str | Path):
        path = Path(source)
        if problem := not_a_file(path):
            raise UserbufferSettingsError(f"{key}: {path} {problem}")
        try:
            settings = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        except (YAMLError, OmegaConfBaseException) as err:
            problem = str(err).splitlines()[0]
            raise UserbufferSettingsError(f"{key}: {path} is not valid YAML ({problem})") from None
        where = f"{key} ({path})"
    else:
        settings, where = source, key
    if not isinstance(settings, Mapping):
        raise UserbufferSettingsError(f"{where} must map GEMM names to their settings")
    unknown = [name for name in settings if name not in GEMM_NAMES]
    if unknown:
        raise UserbufferSettingsError(
            f"{where}: unknown GEMM names {unknown} (Transformer Engine would ignore them); "
            f"known: {', '.join(GEMM_NAMES)}"
        )
    not_mappings = [name for name, value in settings.items() if not isinstance(value, Mapping)]
    if not_mappings:
        raise UserbufferSettingsError(
            f"{where}: the settings of {not_mappings} must be mappings (method, num_sm, ...)"
        )
    return {name: dict(value) for name, value in settings.items()}


@dataclass(frozen=True)
class UserbufferLayout:
    """What sizes the buffers: one micro-batch of activations of one tensor-parallel group."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    tensor_parallel: int
    context_parallel: int = 1

    def shape(self) -> list[int]:
        """(tokens per micro-batch on this context-parallel rank, hidden), as TE takes it."""
        return [self.seq_length * self.micro_batch_size // self.context_parallel, self.hidden_size]


def initialize_userbuffers(
    layout: UserbufferLayout,
    dtype: torch.dtype,
    fp8: bool,
    settings: dict | None,
    bootstrap_backend: str,
) -> None:
    """Allocate Transformer Engine's userbuffers; every rank calls it, before the model is
    built (TE creates process groups here)."""
    from transformer_engine.pytorch.module import base as te_base

    # TE >= 2.8 (te.TE_MIN_VERSION) takes one quantization mode per set of communicators.
    modes = te_base.UserBufferQuantizationMode
    te_base.initialize_ub(
        shape=layout.shape(),
        tp_size=layout.tensor_parallel,
        quantization_modes=[modes.FP8 if fp8 else modes.NONE],
        dtype=dtype,
        ub_cfgs=settings,
        bootstrap_backend=bootstrap_backend,
    )
