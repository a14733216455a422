"""Every field of an imported ``config.json`` accounted for, or the import refused.

``transformers`` keeps a field it does not know as an attribute, and an architecture
converter reads only the fields it knows, so a field that changes what the model
computes (a ``rope_scaling``, a ``sliding_window``, a ``qk_norm``) could be dropped
silently, and the imported run would be another model. Import therefore accounts for
every field of the file. A field is

* mapped by a declaration: the ``hf=`` field of a model setting
  (:func:`~megatron_lns.convert.hf_settings.mapped_hf_fields`);
* consumed by the architecture converter: a field it read while it built the
  architecture (:class:`FieldReads` records them, so a check added to a converter
  accounts for its field by being written), the fields ``transformers`` builds the RoPE
  settings from (``HF_ROPE_FIELDS``), or one the architecture declares inert
  (``Architecture.hf_inert_fields``, each with its reason);
* known-harmless metadata: :data:`HF_METADATA`, each entry with its reason, and the
  generation settings (``transformers.GenerationConfig``'s fields);
* or at the default of the ``transformers`` config class (null for a field the class
  does not have): the model computes what the class computes without it.

Anything else is refused in one line naming the fields and values: the imported model
would compute something else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.mapping import HF_ROPE_FIELDS

# Fields that say nothing about the function the model computes, and why.
HF_METADATA: dict[str, str] = {
    "architectures": "names the class; the registry picks the converter by it",
    "model_type": "names the transformers config class that read the file",
    "transformers_version": "the version that wrote the file",
    "_name_or_path": "where the model was loaded from",
    "_commit_hash": "the hub revision the model was loaded from",
    "torch_dtype": "the dtype of the stored weights; import reads each tensor's own",
    "dtype": "the dtype of the stored weights; import reads each tensor's own",
    "use_cache": "whether generation keeps a key/value cache; the logits are the same",
    "bos_token_id": "a special token of the tokenizer, which import copies",
    "eos_token_id": "a special token of the tokenizer, which import copies",
    "pad_token_id": "a special token of the tokenizer, which import copies",
    "sep_token_id": "a special token of the tokenizer, which import copies",
    "decoder_start_token_id": "a special token of the tokenizer, which import copies",
    "tokenizer_class": "names the tokenizer class; import copies the tokenizer files",
    "id2label": "the labels of a classification head, which a causal LM does not have",
    "label2id": "the labels of a classification head, which a causal LM does not have",
    "problem_type": "the loss of a classification head, which a causal LM does not have",
    "finetuning_task": "a note on how the model was fine-tuned",
    "task_specific_params": "generation settings per task",
    "return_dict": "what the forward call returns, not what it computes",
    "output_attentions": "what the forward call returns, not what it computes",
    "output_hidden_states": "what the forward call returns, not what it computes",
    "output_router_logits": (
        "whether the forward call returns the router logits (and their loss), not what the "
        "model computes"
    ),
}


class FieldReads:
    """A config that notes every field read from it (a ``transformers`` config's by the
    name it is stored under, through the class's ``attribute_map``): a converter's reads
    are the fields it consumed. The tests wrap a ``model:`` section in it too."""

    def __init__(self, config: Any) -> None:
        self._config = config
        self._aliases = dict(getattr(type(config), "attribute_map", None) or {})
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        # Called for the config's fields only: _config, _aliases and read are set above.
        self.read.add(self._aliases.get(name, name))
        return getattr(self._config, name)


def generation_fields() -> set[str]:
    """``transformers.GenerationConfig``'s fields, which older ``config.json`` files
    carry: how text is sampled from the model, not what it computes."""
    from transformers import GenerationConfig

    return set(GenerationConfig().to_dict())


def refuse_unaccounted_fields(
    hf_dir: Path, config: Any, accounted: set[str], hf_class: str
) -> None:
    """Refuse the fields of ``hf_dir/config.json`` outside ``accounted`` (mapped,
    consumed or inert) and :data:`HF_METADATA` whose value is not the default of
    ``config``'s class, naming them with their values."""
    raw = json.loads((hf_dir / "config.json").read_text())
    known = accounted | set(HF_METADATA) | set(HF_ROPE_FIELDS) | generation_fields()
    unknown = [field for field in raw if field not in known]
    if not unknown:
        return
    defaults = type(config)()
    changed = {
        field: raw[field]
        for field in unknown
        if not _at_default(getattr(config, field, raw[field]), getattr(defaults, field, _NONE))
    }
    if changed:
        shown = ", ".join(f"{field}={json.dumps(value)}" for field, value in changed.items())
        what = "a field" if len(changed) == 1 else "fields"
        default = "default" if len(changed) == 1 else "defaults"
        raise ConversionError(
            f"{hf_dir}/config.json: {shown}: {what} import-hf cannot map into a {hf_class}, "
            f"not at {type(config).__name__}'s {default}: the imported model would compute "
            "something else"
        )


_NONE = object()  # a field the config class does not have: no default to be at


def _at_default(value: Any, default: Any) -> bool:
    """Whether a field's loaded ``value`` is the class ``default``, compared as JSON has
    them (tuples as lists, dtypes as names); null is the default of a field the class
    does not have (the field is not set)."""
    if default is _NONE:
        return value is None
    return json.loads(json.dumps(value, default=str)) == json.loads(
        json.dumps(default, default=str)
    )
