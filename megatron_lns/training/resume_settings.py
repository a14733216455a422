"""The settings a resume compares with the checkpoint's ``config.yaml`` before it loads
anything: those whose declaration says what a resume does with another value (the
``resume`` fact, ``config/settings.py``).

A value is compared as megatron-core gets it (through the key's ``translate``):
``fused_adam`` and ``adamw`` are one optimizer, ``bf16`` and ``bf16-mixed`` one precision.
A key the checkpoint's config does not hold (written by an older version) is not
compared. Torch-free.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lns.config import ConfigError, ExperimentConfig, to_yaml
from megatron_lns.config.loader import read_yaml_config
from megatron_lns.config.settings import Declared, Resume, keys_on_resume, section
from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.training import provenance
from megatron_lns.training.checkpoint_dirs import CheckpointError


def _as_built(cfg: ExperimentConfig, item: Declared, value: Any) -> Any:
    """What megatron-core gets of ``value`` for ``item``: its translation, made with
    ``cfg`` holding that value (a translation may read its own key)."""
    translate = item.setting.translate
    if translate is None:
        return value
    variant = copy.deepcopy(cfg)
    setattr(section(variant, item.key), item.name, value)
    try:
        return translate(value, variant)
    except (KeyError, TypeError, ValueError):  # a value this version no longer knows
        return value


@dataclass(frozen=True)
class SavedSettings:
    """The config a checkpoint was written with beside this run's, each read and
    flattened once (``provenance.flat_config``): a resume compares the pair for the
    model, the optimizer state and the samples before it loads anything, and again to
    name a load that failed. ``saved`` is None where the checkpoint keeps no config
    (nothing is compared then)."""

    cfg: ExperimentConfig
    saved: dict[str, object] | None
    current: dict[str, object]

    @classmethod
    def read(cls, path: Path, cfg: ExperimentConfig) -> SavedSettings:
        """The settings of checkpoint ``path`` (its ``config.yaml``) and of ``cfg``. A
        ``config.yaml`` that is not a YAML mapping makes the checkpoint damaged: nothing
        could be compared with it."""
        stored = path / RUN_CONFIG
        if not stored.is_file():
            return cls(cfg, None, {})
        try:
            read_yaml_config(stored, holding="the settings the checkpoint was written with")
        except ConfigError as err:
            raise CheckpointError(f"checkpoint {path} is damaged: {err}") from None
        saved = provenance.flat_config(stored.read_text())
        return cls(cfg, saved, provenance.flat_config(to_yaml(cfg)))

    def changed(self, resume: Resume) -> list[str]:
        """``key: saved -> current`` for each key declared ``resume`` whose value differs
        as megatron-core gets it (:func:`_as_built`)."""
        if self.saved is None:
            return []
        cfg = self.cfg
        keys = keys_on_resume(type(cfg), resume)
        items = {item.key: item for item in keys if item.key in self.saved}

        def same(key: str, old: Any, new: Any) -> bool:
            return old == new or _as_built(cfg, items[key], old) == _as_built(cfg, items[key], new)

        return provenance.changed_values(self.saved, self.current, list(items), same)

    def changed_values(self, keys: Sequence[str]) -> list[str]:
        """``key: saved -> current`` for each of ``keys`` whose value differs as written."""
        if self.saved is None:
            return []
        return provenance.changed_values(self.saved, self.current, keys)
