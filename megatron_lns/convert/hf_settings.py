"""What the declarations say about Hugging Face export and import, for every model setting.

Each model setting declares its role (``hf=`` of ``config.settings.setting``): the
``config.json`` field it maps to, ``HF_REFUSE`` (export refuses a value other than the
default) or ``HF_CONVERTER`` (``convert/architectures`` maps or refuses it value by value).
The architectures write and read the fields they know; this module applies the
declarations to the rest, so that a model setting declared tomorrow is exported, imported
or refused by its declaration alone:

* export refuses a non-default value of a setting declared ``HF_REFUSE``, naming the key
  (and why, where its ``hf_refusal`` says), and one mapped to a field the architecture's
  ``config.json`` does not have;
* export writes a mapped field the architecture left at another value;
* import reads a mapped field that the architecture did not already turn into a setting,
  counts every mapped field as accounted for (``mapped_hf_fields``), and gives an
  imported MoE model the defaults of the MoE settings declared ``HF_REFUSE``.

Nothing here imports torch.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from megatron_lns.config.settings import HF_CONVERTER, HF_REFUSE, Declared, declared_settings
from megatron_lns.convert.errors import ConversionError


def _with_hf_role(model_cls: type) -> Iterator[Declared]:
    """The model section's own keys (not its subsections') with an ``hf`` role."""
    for item in declared_settings(model_cls):
        if "." not in item.key and item.setting.hf is not None:
            yield item


def _mapped(m: Any) -> Iterator[tuple[Declared, Any]]:
    """:func:`_with_hf_role`'s settings of the section ``m``, with their values."""
    for item in _with_hf_role(type(m)):
        yield item, getattr(m, item.name)


def _means_the_default(item: Declared, value: Any) -> bool:
    """Whether ``value`` is the default, or what a null default means where the
    declaration says it in a literal (``null_means="1"``: a factor of 1 is no factor)."""
    if value == item.default:
        return True
    if item.default is not None or item.setting.null_means is None:
        return False
    try:
        return ast.literal_eval(item.setting.null_means) == value
    except (ValueError, SyntaxError):  # a phrase ("dense MLPs"), not a value
        return False


def refuse_unexportable(m: Any) -> None:
    """Refuse a setting whose declaration says no Hugging Face model holds a value other
    than its default (``hf=HF_REFUSE``), naming it and, where declared, why."""
    for item, value in _mapped(m):
        if item.setting.hf == HF_REFUSE and not _means_the_default(item, value):
            why = item.setting.hf_refusal or (
                f"no Hugging Face config.json field holds it (only the default, "
                f"{item.default}, exports)"
            )
            raise ConversionError(f"model.{item.key}={value} cannot be exported: {why}")


def mapped_hf_fields(model_cls: type) -> set[str]:
    """The ``config.json`` fields the model settings are declared with: import maps each."""
    fields = {item.setting.hf for item in _with_hf_role(model_cls)}
    return {field for field in fields if field not in (HF_REFUSE, HF_CONVERTER)}


def refused_moe_defaults(model_cls: type) -> dict[str, Any]:
    """The MoE settings declared ``HF_REFUSE``, by key, at their defaults: the only values
    a stock Hugging Face MoE class holds, so an imported MoE model's."""
    return {
        item.key: item.default
        for item in _with_hf_role(model_cls)
        if item.setting.hf == HF_REFUSE and item.setting.group == "moe"
    }


def apply_to_hf_config(m: Any, config: Any, hf_class: str) -> None:
    """Write every setting declared with a ``config.json`` field into ``config`` (the
    ``transformers`` config the architecture made) where the value is not the default;
    refuse one whose field ``hf_class`` does not have."""
    for item, value in _mapped(m):
        field = item.setting.hf
        if field in (HF_REFUSE, HF_CONVERTER) or value == item.default:
            continue
        if not hasattr(config, field):
            raise ConversionError(
                f"model.{item.key}={value} cannot be exported: {hf_class}'s config.json has "
                f"no field {field}"
            )
        setattr(config, field, value)


def settings_from_hf_config(config: Any, model_cls: type, taken: set[str]) -> dict[str, Any]:
    """The model settings declared with a ``config.json`` field that ``config`` holds, by
    key, except those in ``taken`` (the architecture's own)."""
    fields = config.to_dict()
    settings = {}
    for item in _with_hf_role(model_cls):
        field = item.setting.hf
        if item.key not in taken and field not in (HF_REFUSE, HF_CONVERTER) and field in fields:
            settings[item.key] = getattr(config, field)
    return settings
