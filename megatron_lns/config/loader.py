"""Load a NeMo-style YAML, apply ``key=value`` overrides, and type-check it.

Order: overrides are applied to the raw YAML (Hydra syntax: ``key=value`` for keys
that exist, ``+key=value`` to add one, ``~key`` to delete one); every key is then
classified as honoured (in the schema), a NeMo key without meaning here (collected
into one warning), or unknown (an error with a did-you-mean); finally OmegaConf
merges the YAML onto the typed schema, checking types and resolving interpolations.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from megatron_lns.config.nemo_compat import (
    NEMO_KEYS_WITHOUT_MEANING_HERE,
    is_nemo_key_without_meaning,
    register_nemo_resolvers,
)
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem; the message is one line that names the key."""


class NemoKeysIgnoredWarning(UserWarning):
    pass


def _schema_paths(cls: type = ExperimentConfig, prefix: str = "") -> dict[str, bool]:
    """Every schema key path -> whether it is a free-form dict (any sub-key allowed)."""
    paths: dict[str, bool] = {}
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for name, f in hints.items():
        path = f"{prefix}{name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            paths[path] = False
            paths.update(_schema_paths(type(default), path + "."))
        else:
            paths[path] = isinstance(default, dict)
    return paths


SCHEMA_PATHS = _schema_paths()


def _all_paths(node: Any, prefix: str = "") -> list[str]:
    """Every key path in a raw config, each section before its keys."""
    if isinstance(node, DictConfig):
        paths = []
        for key in node:
            child = node._get_node(key)
            path = f"{prefix}{key}"
            if (
                isinstance(child, DictConfig)
                and not child._is_none()
                and not child._is_interpolation()
            ):
                paths.append(path)
                paths.extend(_all_paths(child, path + "."))
            else:
                paths.append(path)
        return paths
    return []


def _is_known(path: str) -> bool:
    if path in SCHEMA_PATHS:
        return True
    parts = path.split(".")
    return any(SCHEMA_PATHS.get(".".join(parts[:i])) for i in range(1, len(parts)))


def _did_you_mean(path: str) -> str:
    candidates = list(SCHEMA_PATHS) + sorted(NEMO_KEYS_WITHOUT_MEANING_HERE)
    close = difflib.get_close_matches(path, candidates, n=1, cutoff=0.75)
    if not close:
        leaf = path.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in SCHEMA_PATHS}
        near = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        close = [by_leaf[near[0]]] if near else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def _delete(cfg: DictConfig, path: str) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        raise ConfigError(f"override '~{path}': no such key to delete")
    del parent[leaf]


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Hydra-style overrides, in order, onto a raw (unvalidated) config."""
    defaults = OmegaConf.structured(ExperimentConfig)
    for override in overrides:
        if override.startswith("~"):
            _delete(cfg, override[1:].split("=", 1)[0])
            continue
        add = override.startswith("+")
        text = override[1:] if add else override
        if "=" not in text:
            raise ConfigError(f"override '{override}' is not key=value")
        key = text.split("=", 1)[0].strip()
        exists = OmegaConf.select(cfg, key, default="__missing__") != "__missing__" or (
            OmegaConf.select(defaults, key, default="__missing__") != "__missing__"
        )
        if not add and not exists:
            raise ConfigError(
                f"override '{override}': no key '{key}'{_did_you_mean(key)}; use +{key}=... to add"
            )
        try:
            parsed = OmegaConf.from_dotlist([text])
        except OmegaConfBaseException as err:
            raise ConfigError(
                f"override '{override}': {err.msg if hasattr(err, 'msg') else err}"
            ) from None
        OmegaConf.update(cfg, key, OmegaConf.select(parsed, key), merge=False, force_add=True)


def _drop_nemo_keys(cfg: DictConfig) -> list[str]:
    """Remove NeMo keys with no meaning here; error on unknown keys. Returns what was dropped."""
    dropped: list[str] = []
    for path in _all_paths(cfg):
        if any(path.startswith(d + ".") for d in dropped):
            continue  # inside a NeMo section that is dropped as a whole
        if _is_known(path):
            parent_path, _, leaf = path.rpartition(".")
            parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
            if OmegaConf.is_missing(parent, leaf):
                raise ConfigError(f"'{path}' is required but not set (???)")
            continue
        if not is_nemo_key_without_meaning(path):
            raise ConfigError(f"unknown config key '{path}'{_did_you_mean(path)}")
        dropped.append(path)
    for path in dropped:
        _delete(cfg, path)
    return dropped


def load_config(
    source: str | Path | DictConfig | dict, overrides: list[str] | None = None
) -> ExperimentConfig:
    """The typed, resolved experiment config (not yet checked for consistency)."""
    register_nemo_resolvers()
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        raw = OmegaConf.load(path)
    else:
        raw = OmegaConf.create(source) if isinstance(source, dict) else source.copy()
    if not isinstance(raw, DictConfig):
        raise ConfigError("the config must be a mapping with trainer/exp_manager/model sections")
    apply_overrides(raw, overrides or [])
    dropped = _drop_nemo_keys(raw)
    if dropped:
        warnings.warn(
            "NeMo config keys with no meaning in megatron-lns (ignored): " + ", ".join(dropped),
            NemoKeysIgnoredWarning,
            stacklevel=2,
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), raw)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as err:
        raise ConfigError(f"'{err.full_key}' is required but not set (???)") from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        message = str(err).splitlines()[0]
        raise ConfigError(f"'{key}': {message}") from None


def to_yaml(cfg: ExperimentConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: ExperimentConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))
