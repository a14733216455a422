"""What wrote a checkpoint, and what changed since (issue 21: checkpoints that say where
they came from).

Every checkpoint records, in its common state under :data:`PROVENANCE`, the versions of
the packages that shape its numbers (megatron-lns, megatron-core, torch, Transformer
Engine or ``None``), the backend of its layers (``te`` or ``local``) and a hash of the
run's config. The parallel layout is recorded beside it (``parallel_layout``,
``checkpoint.py``). A resume compares all of it with the running one and reports the
differences in one line (:func:`changes_since`); it refuses nothing.

The hash covers the ``model`` and ``trainer`` sections of the resolved config (what the
model computes and how it is trained), not ``exp_manager`` or ``cluster`` (where and how a
run is kept and submitted) nor ``name``: sha256 of their canonical JSON (sorted keys).
Each checkpoint also keeps its full ``config.yaml``, which names the changed keys.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import yaml

from megatron_lns.config.sources import RUN_CONFIG

PROVENANCE = "provenance"
HASHED_SECTIONS = ("model", "trainer")
PACKAGES = ("megatron-lns", "megatron-core", "torch", "transformer-engine")
# How many changed config keys a report names before it counts the rest.
_NAMED_KEYS = 8


def package_versions() -> dict[str, str | None]:
    """The versions of :data:`PACKAGES` in this process; ``None`` for one not installed."""
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.package_info import VERSION

    te = None
    if HAVE_TE:
        from megatron.core.utils import get_te_version

        te = str(get_te_version())
    return {
        # The package this code runs from (its parent is always imported first).
        "megatron-lns": sys.modules["megatron_lns"].__version__,
        # Not package_info.__version__: that appends the commit of whatever git work
        # tree megatron-core is installed in (a virtualenv inside a project's clone).
        "megatron-core": ".".join(map(str, VERSION[:3])) + "".join(map(str, VERSION[3:])),
        "torch": torch.__version__,
        "transformer-engine": te,
    }


def model_backend(model: Sequence[torch.nn.Module]) -> str:
    """``te`` when any layer of ``model`` is a Transformer Engine module, else ``local``."""
    for chunk in model:
        for module in chunk.modules():
            if any(cls.__module__.startswith("transformer_engine") for cls in type(module).__mro__):
                return "te"
    return "local"


def _hashed_part(config_yaml: str) -> dict:
    config = yaml.safe_load(config_yaml) or {}
    if not isinstance(config, dict):
        return {}
    return {section: config.get(section) for section in HASHED_SECTIONS}


@functools.lru_cache(maxsize=4)
def config_hash(config_yaml: str) -> str:
    """sha256 of the canonical JSON of the config's :data:`HASHED_SECTIONS`."""
    canonical = json.dumps(_hashed_part(config_yaml), sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def provenance_record(model: Sequence[torch.nn.Module], config_yaml: str | None) -> dict:
    """What a checkpoint of ``model`` written by this process records; ``config_yaml``
    (the resolved run config) None where there is none (plain weight exports)."""
    return {
        "versions": package_versions(),
        "backend": model_backend(model),
        "config_hash": config_hash(config_yaml) if config_yaml is not None else None,
        "config_hash_covers": list(HASHED_SECTIONS),
    }


def saved_provenance(common: dict) -> dict | None:
    """A checkpoint's record; None for one written before checkpoints recorded it."""
    saved = common.get(PROVENANCE) if isinstance(common, dict) else None
    return saved if isinstance(saved, dict) else None


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict) and value:
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def flat_config(config_yaml: str) -> dict[str, object]:
    """The values of the config's :data:`HASHED_SECTIONS` by dotted key."""
    return _flatten(_hashed_part(config_yaml))


def changed_values(
    saved: str | Mapping[str, object],
    current: str | Mapping[str, object],
    keys: Sequence[str],
    same: Callable[[str, object, object], bool] = lambda key, saved, current: saved == current,
) -> list[str]:
    """``key: saved -> current`` for each of the dotted ``keys`` whose values differ
    (``same(key, saved, current)`` false). ``saved`` and ``current``: each config's YAML,
    or its :func:`flat_config` where the caller compares the pair more than once."""
    saved, current = (flat_config(c) if isinstance(c, str) else c for c in (saved, current))
    return [
        f"{key}: {_shown(saved, key)} -> {_shown(current, key)}"
        for key in keys
        if not same(key, saved.get(key), current.get(key))
    ]


def _shown(flat: Mapping[str, object], key: str) -> str:
    """A config value as the YAML says it: ``null``, or ``unset`` where the key is absent
    (a config of an older version)."""
    if key not in flat:
        return "unset"
    return "null" if flat[key] is None else str(flat[key])


def changed_config_keys(saved_yaml: str, current_yaml: str) -> list[str]:
    """The dotted keys of the hashed sections whose values differ, sorted."""
    saved, current = _flatten(_hashed_part(saved_yaml)), _flatten(_hashed_part(current_yaml))
    return sorted(
        key for key in saved.keys() | current.keys() if saved.get(key) != current.get(key)
    )


def _version_changes(saved: dict, current: dict) -> list[str]:
    return [
        f"{name} {saved.get(name) or 'none'}, this run has {current.get(name) or 'none'}"
        for name in PACKAGES
        if saved.get(name) != current.get(name)
    ]


def _config_change(saved_hash: str | None, checkpoint: Path, config_yaml: str) -> str | None:
    if saved_hash is None or saved_hash == config_hash(config_yaml):
        return None
    stored = checkpoint / RUN_CONFIG
    if not stored.is_file():
        return (
            f"with another config (hash {saved_hash[7:19]}; the checkpoint keeps no {RUN_CONFIG})"
        )
    keys = changed_config_keys(stored.read_text(), config_yaml)
    named = ", ".join(keys[:_NAMED_KEYS]) + (
        f" and {len(keys) - _NAMED_KEYS} more" if len(keys) > _NAMED_KEYS else ""
    )
    return f"with another config ({named or 'same values, other form'})"


def _layout_change(saved: dict | None, current: dict) -> str | None:
    if not isinstance(saved, dict) or saved == current:
        return None
    saved_text, current_text = _show_layout(saved), _show_layout(current)
    return (
        f"at another parallel layout ({saved_text}, now {current_text}: RNG restarts from the seed)"
    )


def _show_layout(layout: dict) -> str:
    return " ".join(f"{name}={size}" for name, size in layout.items())


def changes_since(
    checkpoint: Path,
    common: dict,
    config_yaml: str,
    layout: dict[str, int],
    versions: dict[str, str | None] | None = None,
) -> str | None:
    """One line saying what differs between the run that wrote ``checkpoint`` (its common
    state ``common``) and this one; None when nothing does."""
    record = saved_provenance(common)
    if record is None:
        return (
            f"checkpoint {checkpoint.name} records no provenance (written before checkpoints "
            "did): versions and config not compared"
        )
    versions = package_versions() if versions is None else versions
    changes = _version_changes(record.get("versions") or {}, versions)
    if changes:
        changes[0] = "with " + changes[0]
    changes += [
        change
        for change in (
            _config_change(record.get("config_hash"), checkpoint, config_yaml),
            _layout_change(common.get("parallel_layout"), layout),
        )
        if change is not None
    ]
    if not changes:
        return None
    return f"checkpoint {checkpoint.name} was written " + "; ".join(changes)
