"""Load a NeMo-style YAML, apply ``key=value`` overrides, and type-check it.

Order: overrides are applied to the raw YAML (Hydra syntax: ``key=value`` for keys
that exist, ``+key=value`` to add one, ``++key=value`` to set one whether it exists or
not, ``~key`` to delete one, ``~key=value`` to delete it only at that value; a value may be
a ``${...}`` interpolation); every key is then
classified as honoured (in the schema), a NeMo key (``nemo_compat.NEMO_KEYS``: inert,
fixed, conditional or translated) or unknown (an error with a did-you-mean); OmegaConf
merges the schema keys onto the typed schema, checking types and resolving
interpolations; finally the NeMo keys are honoured or refused against the typed config,
and the inert ones named in one warning.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from megatron_lns.base.errors import UserError
from megatron_lns.base.path_kind import not_a_file
from megatron_lns.config import value_kinds
from megatron_lns.config.env_values import spell_env_values
from megatron_lns.config.nemo_compat import (
    ALIASES,
    NEMO_KEYS,
    Inert,
    NemoSettingError,
    apply_nemo_settings,
    has_nemo_keys_below,
    nemo_rule,
    normalize_nemo_spellings,
    register_nemo_resolvers,
)
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.config.settings import declaration


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
            paths[path] = isinstance(default, dict) or declaration(f).free_form
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


def _did_you_mean(path: str, overridden: DictConfig | None = None) -> str:
    """The key nearest ``path``, named as it is accepted: for a plain ``key=value``
    override of ``overridden`` (the config it applies to), a NeMo key that is neither in
    that config nor an alias is named with the '+' that adds it."""
    candidates = [
        c
        for c in [*SCHEMA_PATHS, *sorted(k for k in NEMO_KEYS if not k.endswith("*"))]
        if c != path  # a NeMo key not in the file is added with '+': no hint to itself
    ]
    close = difflib.get_close_matches(path, candidates, n=1, cutoff=0.75)
    if not close:
        leaf = path.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in SCHEMA_PATHS}
        near = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        close = [by_leaf[near[0]]] if near else []
    if not close:
        return ""
    name = close[0]
    if (
        overridden is not None
        and name in NEMO_KEYS
        and name not in ALIASES
        and name not in _all_paths(overridden)
    ):
        name = f"+{name}"
    return f" (did you mean '{name}'?)"


_ANY_VALUE = object()


def _delete(cfg: DictConfig, path: str, wanted: Any = _ANY_VALUE, override: str = "") -> None:
    """Delete ``path``; with ``wanted`` (the override ``~key=value``) only when that is its
    value (as written, unresolved), as Hydra does, and refuse otherwise."""
    parent_path, _, leaf = path.rpartition(".")
    parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent.keys():  # noqa: SIM118 - `in` skips ???
        raise ConfigError(f"override '~{path}': no such key to delete")
    if wanted is not _ANY_VALUE:
        node = parent._get_node(leaf)
        value = node._value() if _kind_of_node(node) == _VALUE else OmegaConf.to_container(node)
        if value != wanted:
            raise ConfigError(
                f"override '{override}': {path} is {value!r}, not {wanted!r} (~{path}=VALUE "
                f"deletes the key only at that value, as Hydra does; ~{path} deletes it "
                "whatever it is)"
            )
    del parent[leaf]


def _named_inside_a_list(cfg: DictConfig, defaults: DictConfig, key: str) -> str | None:
    """Why a dotted ``key`` cannot be set when a part of it names, not numbers, an element
    of a list (``model.data.data_prefix.train``); None when none does. OmegaConf raised
    'Index ... is not an int' with its traceback."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        above, name = ".".join(parts[:i]), parts[i]
        if name.isdigit():
            continue
        for source in (cfg, defaults):
            try:
                node = OmegaConf.select(source, above, default=None, throw_on_missing=False)
            except OmegaConfBaseException:
                node = None
            if isinstance(node, ListConfig):
                if (above, _MAPPING) in _UNSUPPORTED_FORMS:
                    return _UNSUPPORTED_FORMS[above, _MAPPING]
                return (
                    f"{above} is a list: '{name}' is no element of it (number one, "
                    f"{above}.0=..., or give the whole list, {above}=[...])"
                )
    return None


def _split_prefix(override: str) -> tuple[str, str]:
    """Hydra's prefix (``~``, ``++``, ``+`` or none) and the ``key[=value]`` after it."""
    for prefix in ("~", "++", "+"):
        if override.startswith(prefix):
            return prefix, override[len(prefix) :]
    return "", override


def override_key(override: str) -> str:
    """The key a Hydra-style override names (``+model.x=1`` -> ``model.x``)."""
    return _split_prefix(override)[1].split("=", 1)[0].strip()


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Hydra-style overrides, in order, onto a raw (unvalidated) config."""
    defaults = OmegaConf.structured(ExperimentConfig)
    for override in overrides:
        prefix, text = _split_prefix(override)
        key = override_key(override)
        if prefix == "~":
            if "=" in text:
                _delete(cfg, key, _value_of(override, text, key), override)
            else:
                _delete(cfg, key)
            continue
        if "=" not in text:
            raise ConfigError(f"override '{override}' is not key=value")
        if problem := _named_inside_a_list(cfg, defaults, key):
            raise ConfigError(f"override '{override}': {problem}")
        # An alias is set as the key it names, which the defaults hold.
        exists = (
            OmegaConf.select(cfg, key, default="__missing__") != "__missing__"
            or OmegaConf.select(defaults, key, default="__missing__") != "__missing__"
            or key in ALIASES
        )
        if not prefix and not exists:
            raise ConfigError(
                f"override '{override}': no key '{key}'{_did_you_mean(key, cfg)}; use "
                f"+{key}=... to add"
            )
        # An interpolation stays one (``${model.encoder_seq_length}``) and is resolved
        # with the whole config, after every override.
        OmegaConf.update(cfg, key, _value_of(override, text, key), merge=False, force_add=True)


def _value_of(override: str, text: str, key: str) -> Any:
    """The value ``text`` (``key=value``, from ``override``) gives ``key``, as YAML reads
    it; an interpolation is kept as its text."""
    raw_value = text.split("=", 1)[1]
    if raw_value.startswith("*"):
        # YAML reads a leading '*' as an alias, which one override cannot define: such a
        # value is text (a hybrid layer pattern, ``model.hybrid_layer_pattern=*-*E``).
        return raw_value
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([text]), resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"override '{override}': {_one_line(err, position=False)}") from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise ConfigError(f"override of '{key}': {_too_long_to_read(err)}") from None
    value = parsed
    try:
        for part in key.split("."):
            value = value[part]
    except (KeyError, TypeError):
        raise ConfigError(f"override '{override}' is not key=value") from None
    if _comment_dropped(raw_value, value):
        raise ConfigError(
            f"override '{override}': YAML reads ' #' as the start of a comment, which "
            f"cuts the value to {value!r}; to keep the '#', quote the value for YAML "
            f"(\"{key}='{raw_value}'\")"
        )
    return value


_YAML_COMMENT = re.compile(r"(?:^|\s)#")


def _comment_dropped(raw_value: str, value: Any) -> bool:
    """Whether YAML read part of a command-line value as a comment (``acc #x`` is
    ``acc``): in a file a comment is visible, on a command line it silently cuts."""
    return len(_YAML_COMMENT.findall(raw_value)) > len(_YAML_COMMENT.findall(str(value)))


def _interpolation_overrides(overrides: list[str]) -> dict[str, str]:
    """key -> override, for overrides whose value contains ``${...}``."""
    found = {}
    for override in overrides:
        prefix, text = _split_prefix(override)
        if prefix != "~" and "=" in text and "${" in text.split("=", 1)[1]:
            found[override_key(override)] = override
    return found


def check_override_interpolations(cfg: DictConfig, overrides: list[str]) -> None:
    """Resolve, in ``cfg`` (the config the ``overrides`` were applied to), each override's
    ``${...}``: one that does not resolve is a ConfigError naming the override as typed,
    not the key it set, which the user may not recognise as theirs. A list or mapping is
    resolved through (``cluster.srun_args=['--x=${nope}']``)."""
    for key, override in _interpolation_overrides(overrides).items():
        try:
            value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
            if isinstance(value, (DictConfig, ListConfig)):
                OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException as err:
            raise ConfigError(f"override '{override}': {_one_line(err)}") from None


def _one_line(err: Exception, position: bool = True) -> str:
    """The first line of an OmegaConf error; for YAML syntax, the problem and where."""
    if isinstance(err, yaml.MarkedYAMLError):
        text = err.problem or str(err).splitlines()[0]
        if err.context:
            started = err.context_mark
            line = f" from line {started.line + 1}" if position and started else ""
            text += f" ({err.context}{line})"
        mark = err.problem_mark
        if position and mark:
            text = f"line {mark.line + 1}, column {mark.column + 1}: {text}"
        return text
    text = getattr(err, "msg", None) or str(err)
    return str(text).strip().splitlines()[0]


def _too_long_to_read(err: ValueError) -> str:
    """Python's refusal to convert a number of more than ``sys.get_int_max_str_digits()``
    digits, without its advice to the programmer (``use sys.set_int_max_str_digits()``)."""
    return str(err).split(";")[0]


def what_yaml_holds(path: Path) -> str:
    """What the YAML file ``path`` holds at its root: ``a mapping``, ``a list``, ``a single
    value`` or ``nothing``. Asked before ``OmegaConf.load``, which would read a file of one
    string (e.g. not YAML at all) as a mapping with the whole text as its one key.

    Composed, not constructed: PyYAML's own loader reads values OmegaConf's does not
    (2024-13-45 is a date to it, and an invalid one, but a string to OmegaConf). Raises
    what reading and parsing the file raise (``OSError``, ``UnicodeDecodeError``,
    ``yaml.YAMLError``)."""
    with path.open(encoding="utf-8") as f:
        root = yaml.compose(f, Loader=yaml.SafeLoader)
    if root is None or root.tag == "tag:yaml.org,2002:null":
        return "nothing"
    if isinstance(root, yaml.MappingNode):
        return "a mapping"
    return "a list" if isinstance(root, yaml.SequenceNode) else "a single value"


def read_yaml_config(path: Path, holding: str = "trainer/exp_manager/model sections") -> DictConfig:
    """The YAML file ``path`` as OmegaConf reads it (unresolved); a ConfigError naming the
    file, and that it must be a mapping ``holding`` what the reader needs, otherwise."""
    try:
        raw = OmegaConf.load(path) if what_yaml_holds(path) == "a mapping" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path}: {_one_line(err)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror or err}") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"config file {path}: {_one_line(err)}") from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise ConfigError(f"config file {path}: {_too_long_to_read(err)}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"config file {path} must be a mapping with {holding}")
    return raw


def _resolved(cfg: DictConfig, path: str) -> Any:
    try:
        value = OmegaConf.select(cfg, path, throw_on_resolution_failure=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"'{path}': {_one_line(err)}") from None
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _take_nemo_keys(cfg: DictConfig) -> tuple[dict[str, Any], list[str]]:
    """Remove the NeMo keys from a raw config; error on unknown keys.

    Returns the values of the keys to honour or refuse (resolved before removal, as
    they may interpolate each other) and the inert keys, for the warning.
    """
    to_judge: dict[str, Any] = {}
    inert: list[str] = []
    taken: list[str] = []  # NeMo keys, each with everything below it
    sections: list[str] = []  # NeMo sections judged key by key (model.nsys_profile)
    for path in _all_paths(cfg):
        if any(path.startswith(t + ".") for t in taken):
            continue
        if _is_known(path):
            parent_path, _, leaf = path.rpartition(".")
            parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
            if OmegaConf.is_missing(parent, leaf):
                raise ConfigError(f"'{path}' is required but not set (???)")
            continue
        rule = nemo_rule(path)
        if rule is None:
            if not has_nemo_keys_below(path):
                raise ConfigError(f"unknown config key '{path}'{_did_you_mean(path)}")
            sections.append(path)
            continue
        if isinstance(rule, Inert):
            inert.append(path)
        else:
            to_judge[path] = _resolved(cfg, path)
        taken.append(path)
    removed = sections + taken
    _resolve_references_to(cfg, removed)
    for path in removed:
        if not any(path.startswith(r + ".") for r in removed):
            _delete(cfg, path)
    return to_judge, inert


_REFERENCE = re.compile(r"\$\{\s*([\w.]+)\s*\}")


def _resolve_references_to(cfg: DictConfig, removed: list[str]) -> None:
    """Resolve, in place, every kept value that interpolates a key about to be removed
    (NeMo's ``exp_manager.resume_from_checkpoint: ${model.resume_from_checkpoint}``)."""
    for path in _all_paths(cfg):
        if not _is_known(path):
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
        node = parent._get_node(leaf) if isinstance(parent, DictConfig) else None
        if node is None or not node._is_interpolation():
            continue
        refs = _REFERENCE.findall(str(node._value()))
        if any(ref == r or ref.startswith(r + ".") for ref in refs for r in removed):
            parent[leaf] = _resolved(cfg, path)


# What a schema key holds, as a user reads it.
_SECTION, _MAPPING, _LIST, _VALUE = (
    "a section of keys",
    "a mapping (key: value)",
    "a list",
    "a single value",
)
_GOT = {_MAPPING: "a mapping", _LIST: "a list", _VALUE: "a single value"}
# Forms of a key that other tools accept and megatron-lns does not: said by name.
_UNSUPPORTED_FORMS = {
    ("model.data.data_prefix", _MAPPING): (
        "NeMo's per-split form of model.data.data_prefix (train/validation/test) is not "
        "supported: give one list of prefixes (with weights if blended) and split it with "
        "model.data.splits_string"
    ),
}


def _kind_of_hint(hint: Any) -> tuple[str | None, Any]:
    """What a field of type ``hint`` must hold (None: anything) and the type of its
    elements (for a mapping or list)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _kind_of_hint(options[0]) if len(options) == 1 else (None, None)
    if dataclasses.is_dataclass(hint):
        return _SECTION, hint
    origin = typing.get_origin(hint) or hint
    if origin is dict:
        return _MAPPING, (typing.get_args(hint) or (None, Any))[1]
    if origin is list:
        return _LIST, (typing.get_args(hint) or (Any,))[0]
    if hint in (str, int, float, bool):
        return _VALUE, None
    return None, None


def _kind_of_node(node: Any) -> str:
    if isinstance(node, DictConfig):
        return _MAPPING
    return _LIST if isinstance(node, ListConfig) else _VALUE


def _check_kinds(node: Any, hint: Any, path: str) -> None:
    """Refuse, naming the key, a list or a single value where the schema has a mapping,
    or any other such mix (OmegaConf's merge ends in a TypeError, or names no key); a
    number for a bool; an integer too large for the int64 or float that holds it (where
    the merge would raise OverflowError converting it to a float; ``_typed`` checks what
    it converts)."""
    if node is None or node._is_none() or node._is_interpolation() or node._is_missing():
        return
    want, element = _kind_of_hint(hint)
    if want is None:
        return
    got = _kind_of_node(node)
    if got != (_MAPPING if want == _SECTION else want):
        if (path, got) in _UNSUPPORTED_FORMS:
            raise ConfigError(_UNSUPPORTED_FORMS[path, got])
        shown = OmegaConf.to_container(node) if got != _VALUE else node._value()
        raise ConfigError(f"'{path}' must be {want}, not {_GOT[got]} ({shown})")
    if want == _VALUE:
        value, kinds = node._value(), value_kinds.kinds_of_hint(hint)
        # OmegaConf reads any number as a bool (2 is true); its strings ('false', 'no')
        # it reads as what they say, or refuses.
        if kinds == (bool,) and not isinstance(value, str):
            problem = value_kinds.kind_problem(value, kinds)
        else:
            problem = value_kinds.range_problem(value, kinds)
        if problem:
            raise ConfigError(f"'{path}' {problem}, got {value_kinds.shown(value)}")
    elif want == _SECTION:
        fields = typing.get_type_hints(element)
        for key in node:
            if key in fields:
                _check_kinds(node._get_node(key), fields[key], f"{path}.{key}")
    elif want == _MAPPING:
        for key in node:
            _check_kinds(node._get_node(key), element, f"{path}.{key}")
    elif want == _LIST:
        for index in range(len(node)):
            _check_kinds(node._get_node(index), element, f"{path}[{index}]")


def _check_sections(raw: DictConfig) -> None:
    fields = typing.get_type_hints(ExperimentConfig)
    for key in raw:
        if key in fields:
            _check_kinds(raw._get_node(key), fields[key], str(key))


def _fill_unset(raw: DictConfig, placeholders: dict[str, Any]) -> None:
    """Set each key of ``placeholders`` that the config leaves unset (``???``) to its
    value there; a key the config sets, or whose section is not a mapping, is left as
    it is (the section's own check reports the latter)."""
    for key, value in placeholders.items():
        parent_path, _, leaf = key.rpartition(".")
        try:
            parent = OmegaConf.select(raw, parent_path, default=None) if parent_path else raw
        except OmegaConfBaseException:
            continue
        if isinstance(parent, DictConfig) and OmegaConf.is_missing(parent, leaf):
            parent[leaf] = value


def load_config(
    source: str | Path | DictConfig | dict,
    overrides: list[str] | None = None,
    placeholders: dict[str, Any] | None = None,
) -> ExperimentConfig:
    """The typed, resolved experiment config (not yet checked for consistency).

    ``placeholders`` give values to keys the config leaves unset (``???``), before the
    overrides: ``plan`` plans a config whose inputs do not exist yet, and reads it
    otherwise exactly as ``train`` does."""
    register_nemo_resolvers()
    overrides = overrides or []
    if isinstance(source, (str, Path)):
        path = Path(source)
        if problem := not_a_file(path):
            raise ConfigError(f"config file {path} {problem}")
        raw = read_yaml_config(path)
    else:
        raw = OmegaConf.create(source) if isinstance(source, dict) else source.copy()
        if not isinstance(raw, DictConfig):
            raise ConfigError(
                "the config must be a mapping with trainer/exp_manager/model sections"
            )
    _fill_unset(raw, placeholders or {})
    apply_overrides(raw, overrides)
    try:
        spell_env_values(raw)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        normalize_nemo_spellings(raw)
        _check_sections(raw)
        to_judge, inert = _take_nemo_keys(raw)
        cfg = _typed(raw, overrides)
        apply_nemo_settings(cfg, to_judge)
    except NemoSettingError as err:
        raise ConfigError(str(err)) from None
    if inert:
        warnings.warn(
            "NeMo config keys with no effect in megatron-lns (ignored): " + ", ".join(inert),
            NemoKeysIgnoredWarning,
            stacklevel=2,
        )
    return cfg


def _typed(raw: DictConfig, overrides: list[str]) -> ExperimentConfig:
    """``raw`` (``overrides`` applied) merged onto the schema: types checked,
    interpolations resolved."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), raw)
    except OmegaConfBaseException as err:
        raise ConfigError(f"'{getattr(err, 'full_key', None) or '?'}': {_one_line(err)}") from None
    check_override_interpolations(merged, overrides)
    try:
        typed = OmegaConf.to_object(merged)
    except MissingMandatoryValue as err:
        raise ConfigError(f"'{err.full_key}' is required but not set (???)") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"'{getattr(err, 'full_key', None) or '?'}': {_one_line(err)}") from None
    if found := value_kinds.out_of_range(typed):
        key, problem, value = found
        raise ConfigError(f"'{key}' {problem}, got {value_kinds.shown(value)}")
    return typed


def to_yaml(cfg: ExperimentConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: ExperimentConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))
