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
from pathlib import Path
from typing import Any

from megatron_lns.config import ExperimentConfig, to_yaml
from megatron_lns.config.settings import Declared, Resume, keys_on_resume, section
from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.training import provenance


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


def changed_settings(path: Path, cfg: ExperimentConfig, resume: Resume) -> list[str]:
    """``key: saved -> current`` for each key declared ``resume`` whose value differs
    from the one checkpoint ``path`` was written with; none when it keeps no config."""
    stored = path / RUN_CONFIG
    if not stored.is_file():
        return []
    saved_yaml = stored.read_text()
    saved = provenance.flat_config(saved_yaml)
    items = {item.key: item for item in keys_on_resume(type(cfg), resume) if item.key in saved}

    def same(key: str, old: Any, new: Any) -> bool:
        return old == new or _as_built(cfg, items[key], old) == _as_built(cfg, items[key], new)

    return provenance.changed_values(saved_yaml, to_yaml(cfg), list(items), same)
