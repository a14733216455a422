"""The NeMo-style experiment config as typed dataclasses, one declaration per key.

Section and key names follow NeMo 1.x's ``megatron_gpt_config.yaml`` (``trainer``,
``exp_manager``, ``model`` with ``model.optim``, ``model.data``, ``model.tokenizer``),
so a NeMo user's YAML reads the same here. Every key is declared once, with
``settings.setting``: its default, the rule its value must meet beyond its type, where
it goes in megatron-core, how its null default is decided and what it means. Validation,
the megatron-core configs (``build.py``), the NeMo aliases (``nemo_compat.py``) and the key
tables of docs/configuration.md are derived from these declarations. OmegaConf checks
types against the annotations.

The declarations live in ``config/sections/``, one file per section; ``model``'s keys are
flat in the YAML, so ``ModelConfig`` inherits them from one dataclass per topic
(parallelism, architecture, LNS, MoE, ...), in the order the key tables list them. A
value that needs translating names a small function next to its declaration. This module
assembles the sections and re-exports what the rest of the package imports from here.

Nothing here imports torch or megatron-core (``tests/config/test_light_imports.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lns.config.sections.architecture import NORMALIZATIONS, ArchitectureSettings
from megatron_lns.config.sections.cluster import ClusterConfig
from megatron_lns.config.sections.data import DataConfig, TokenizerConfig
from megatron_lns.config.sections.exp_manager import CheckpointCallbackParams, ExpManagerConfig
from megatron_lns.config.sections.lns import LnsSettings
from megatron_lns.config.sections.moe import MoeSettings
from megatron_lns.config.sections.operations import (
    TIMER_LOG_OPTIONS,
    MegatronTimerKwargs,
    NsysProfileConfig,
    OperationsSettings,
)
from megatron_lns.config.sections.optim import (
    GRAD_SYNC_DTYPES,
    OPTIMIZERS,
    SCHEDULES,
    OptimConfig,
    SchedConfig,
    uses_distributed_optimizer,
)
from megatron_lns.config.sections.parallelism import ParallelismSettings
from megatron_lns.config.sections.performance import (
    UB_BOOTSTRAP_BACKENDS,
    PerformanceSettings,
    RecomputationSettings,
    cpu_offloading_num_layers,
)
from megatron_lns.config.sections.trainer import ACCELERATORS, PRECISIONS, TrainerConfig
from megatron_lns.config.sections.transformer_engine import (
    FP8_AMAX_COMPUTE_ALGOS,
    FP8_FORMATS,
    FP8_RECIPES,
    TransformerEngineSettings,
)
from megatron_lns.config.settings import setting, to

__all__ = [
    "ACCELERATORS",
    "FP8_AMAX_COMPUTE_ALGOS",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "GRAD_SYNC_DTYPES",
    "NORMALIZATIONS",
    "OPTIMIZERS",
    "PRECISIONS",
    "SCHEDULES",
    "TIMER_LOG_OPTIONS",
    "UB_BOOTSTRAP_BACKENDS",
    "CheckpointCallbackParams",
    "ClusterConfig",
    "DataConfig",
    "ExpManagerConfig",
    "ExperimentConfig",
    "MegatronTimerKwargs",
    "ModelConfig",
    "NsysProfileConfig",
    "OptimConfig",
    "SchedConfig",
    "TokenizerConfig",
    "TrainerConfig",
    "cpu_offloading_num_layers",
    "to",
    "uses_distributed_optimizer",
]


# A dataclass's fields are its bases' in reverse order of the bases, then its own: the
# last base listed comes first in the YAML and in the key tables.
@dataclass
class ModelConfig(
    TransformerEngineSettings,
    PerformanceSettings,
    MoeSettings,
    LnsSettings,
    OperationsSettings,
    RecomputationSettings,
    ArchitectureSettings,
    ParallelismSettings,
):
    """``model``: every key of the model section (flat in the YAML), then its subsections."""

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class ExperimentConfig:
    name: str = setting("megatron_gpt")
    """a label for the run (plots, logs)"""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
