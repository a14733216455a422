"""One declaration per setting: what a config key means and where it goes.

Every field of the schema (``schema.py``) is declared with :func:`setting`::

    @listed_in("architecture")
    @dataclass
    class ArchitectureSettings:
        hidden_dropout: float = setting(
            0.0, probability, target="TransformerConfig", hf=HF_CONVERTER
        )
        "dropout after attention and MLP, before the residual add"

The declaration, with the docstring under it, carries everything the rest of the package
derives from it:

* ``check``: the rule the value must meet beyond its type (``rules.value_errors``);
* ``target``: where the value goes, as ``Class.field``, or ``Class`` for its field of the
  key's own name (``hidden_dropout`` above goes to ``TransformerConfig.hidden_dropout``): a
  megatron-core class
  (``TransformerConfig``, ``GPTModel``, ``OptimizerConfig``, ``DistributedDataParallelConfig``,
  ``GPTDatasetConfig``, ...) or megatron-lns's own ``layer_spec`` (the arguments of
  ``specs.get_lns_block_spec``), ``layer_variant`` (a layer variant's own setting,
  :data:`VARIANT_TARGETS`) and ``ParallelLayout``. For the classes in
  :data:`MODEL_TARGETS`, :data:`OPTIMIZER_TARGETS` and :data:`DDP_TARGETS` it is also how
  the value gets there: ``build.py`` hands every declared value to the field it names
  (:func:`target_values`), so a pass-through setting needs no code beyond its
  declaration. A value that must be translated names the small function that does it
  (``translate``), kept next to the declaration, or :func:`to` where it only changes
  its name or is looked up in a table of meanings. Other targets are read by the code
  named in the key's doc. A section whose keys all go to one class says it once
  (:func:`passed_to`; a key may still name its own);
* ``aliases``: other names accepted for the same key (megatron-core's own), which set it
  (``nemo_compat.py`` derives their rules from here);
* ``policy``: ``"fixed"`` (the default is the default) or ``"machine"`` (null is decided per
  machine by ``fast_paths.resolve_fast_paths``: on where CUDA and the kernels run it);
* ``training_only``: the value reaches megatron-core only in a training run; a model built
  to analyse or convert weights computes the same function without it;
* ``group``, ``doc``, ``null_means``: the key's row in the tables of docs/configuration.md
  (``config/reference.py`` renders them; a test keeps the committed tables current). The
  group is usually said once for a whole section (:func:`listed_in`), else the key's
  section names its table. The doc is the docstring written under the field (PEP 257's
  attribute docstring, as torchtitan's job config writes its help); ``doc=`` gives it where
  it is computed (a registry's rows) or the class has no source (``make_dataclass``).

:func:`declared_settings` completes each declaration with what its class knows (the key's
name for a ``Class`` target, the docstring); :func:`declaration` gives it as written.

A model setting also says what a checkpoint and a Hugging Face model make of it:

* ``shapes``: the value decides which parameters the model has or their shapes, so a
  checkpoint written under another value is another model. Resume names the shaping keys
  that changed when a checkpoint does not load (:func:`shaping_keys`);
* ``resume``: what a resume does with a value other than the one in the checkpoint's
  ``config.yaml``, before anything is loaded (:func:`keys_on_resume`, the value compared
  as megatron-core gets it: ``fused_adam`` and ``adam`` are one optimizer).
  :data:`RESUME_MODEL` (what a ``shapes`` key does unless it says otherwise): refused,
  naming the key, whether or not the tensors happen to fit (another ``num_attention_heads``
  splits the same weights otherwise); :data:`RESUME_OPTIMIZER`: refused likewise, the
  optimizer's state (its tensors, its param groups) is another one; :data:`RESUME_DATA`:
  the samples after the resume are not those the run would have read, refused as changed
  data is unless ``exp_manager.resume_with_changed_data``; :data:`RESUME_TENSORS`: a
  ``shapes`` key whose change the checkpoint's tensors and architecture record show
  (``num_layers``) or that is no change of the model (a tokenizer file at another path):
  it loads where the tensors fit. Any other key loads and is reported with the other
  config changes;
* ``hf``: its role in Hugging Face export and import. A ``config.json`` field name: the
  field it becomes on export and is read from on import (written and read by the
  architecture where it names the field, else as it is: ``convert/hf_settings.py``);
  :data:`HF_REFUSE`: export refuses a value other than the default (or what a null
  default means, ``null_means``), naming the key; an imported MoE model routes with the
  defaults of the MoE settings declared so. ``hf_refusal`` says why no Hugging Face model
  holds another value, and is itself the refusal (``hf`` need not say it again);
  :data:`HF_CONVERTER`: the converters map it value by value, or refuse a value by name
  (``convert/architectures``: the norm picks the class, the MoE fields differ per class).
  A setting that shapes parameters must say one;
* ``params``: how ``plan`` counts the parameters the setting adds to each layer (held whole
  by every tensor-parallel rank), where ``planning/shape.py``'s own count of the decoder
  does not already (``params(model_section) -> int``).

Nothing here imports torch or megatron-core: the config layer stays light.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from megatron_lns.config.rules import Check

SETTING = "setting"
# The targets build.py fills from declarations: the model (GPTModelConfig, whose fields
# are named as TransformerConfig's and GPTModel's; a TransformerConfig field it lacks is
# passed on to megatron-core as it is), the optimizer (OptimSettings) and megatron DDP.
MODEL_TARGETS = ("TransformerConfig", "GPTModel", "HybridModel", "layer_spec")
OPTIMIZER_TARGETS = ("OptimizerConfig", "OptimizerParamScheduler", "get_megatron_optimizer")
DDP_TARGETS = ("DistributedDataParallelConfig",)
# A layer variant's own settings (``config/layer_variants.py``), declared in the variant's
# registration: build.py hands them to the model as ``GPTModelConfig.variant_options``.
VARIANT_TARGETS = ("layer_variant",)

# translate(value, cfg) -> {field: value}, cfg being the whole ExperimentConfig.
Translate = Callable[[Any, Any], dict[str, Any]]
# params(model section) -> the parameters the setting adds to each layer (module doc).
Params = Callable[[Any], int]
# The roles in Hugging Face export/import that are not a config.json field (module doc).
HF_REFUSE = "refuse"
HF_CONVERTER = "converter"
# What a resume does with a changed value (module doc).
RESUME_MODEL = "model"
RESUME_OPTIMIZER = "optimizer"
RESUME_DATA = "data"
RESUME_TENSORS = "tensors"
Resume = Literal["model", "optimizer", "data", "tensors"]


@dataclass(frozen=True)
class Setting:
    """The declaration of one config key (module doc)."""

    # In the module doc's order: the value, where it goes, its docs row, the model's facts.
    check: Check | None = None
    target: str | None = None
    translate: Translate | None = None
    aliases: tuple[str, ...] = ()
    policy: Literal["fixed", "machine"] = "fixed"
    training_only: bool = False
    # The value may be a mapping with keys of its own, checked by the key's own rules.
    free_form: bool = False
    # The table the key is listed in; None: its section's (``model.optim``, ``cluster``, ...).
    group: str | None = None
    # None as written when the docstring under the field says it (declared_settings reads it).
    doc: str | None = None
    null_means: str | None = None
    shapes: bool = False
    # None: RESUME_MODEL for a shapes key, else reported (module doc).
    resume: Resume | None = None
    hf: str | None = None
    # Why no Hugging Face model holds a value other than the default (hf=HF_REFUSE only).
    hf_refusal: str | None = None
    params: Params | None = None

    @property
    def target_class(self) -> str | None:
        return self.target.split(".", 1)[0] if self.target else None

    @property
    def target_field(self) -> str | None:
        """None also for a ``Class`` target as written (:func:`declared_settings` completes
        it with the key's name)."""
        return self.target.split(".", 1)[1] if self.target and "." in self.target else None


def to(target_field: str, meaning: Mapping[str, Any] | None = None) -> Translate:
    """The value under the name its target uses (``bias`` -> ``add_bias_linear`` is
    GPTModelConfig's ``bias``, which sets both of megatron-core's bias switches): as it is,
    or what ``meaning`` maps it to (NeMo's ``bf16-mixed`` is megatron's ``bf16``; the key is
    the value as text, YAML reads ``32`` as a number)."""
    if meaning is None:
        return lambda value, cfg: {target_field: value}
    return lambda value, cfg: {target_field: meaning[str(value)]}


def setting(
    default: Any = dataclasses.MISSING,
    check: Check | None = None,
    *,
    doc: str | None = None,
    group: str | None = None,
    target: str | None = None,
    translate: Translate | None = None,
    aliases: tuple[str, ...] = (),
    policy: Literal["fixed", "machine"] = "fixed",
    training_only: bool = False,
    null_means: str | None = None,
    free_form: bool = False,
    shapes: bool = False,
    resume: Resume | None = None,
    hf: str | None = None,
    hf_refusal: str | None = None,
    params: Params | None = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A schema field with its declaration (module doc)."""
    if target is not None and not all(part.isidentifier() for part in target.split(".", 1)):
        raise ValueError(f"target={target!r} must be 'Class' or 'Class.field'")
    if hf_refusal is not None:
        if hf not in (None, HF_REFUSE):
            raise ValueError(f"hf_refusal says why export refuses: it cannot go with hf={hf!r}")
        hf = HF_REFUSE
    if shapes and hf is None:
        raise ValueError(
            f"a setting that shapes parameters says its Hugging Face role: hf='<config.json "
            f"field>', {HF_REFUSE!r} or {HF_CONVERTER!r}"
        )
    if hf is not None and not hf.isidentifier():
        raise ValueError(f"hf={hf!r} is not a config.json field name")
    if params is not None and not shapes:
        raise ValueError("a setting whose parameters plan counts shapes them")
    declared = Setting(
        doc=doc,
        group=group,
        check=check,
        target=target,
        translate=translate,
        aliases=aliases,
        policy=policy,
        training_only=training_only,
        null_means=null_means,
        free_form=free_form,
        shapes=shapes,
        resume=resume,
        hf=hf,
        hf_refusal=hf_refusal,
        params=params,
    )
    kwargs: dict[str, Any] = {"metadata": {SETTING: declared}}
    if default_factory is not None:
        kwargs["default_factory"] = default_factory
    else:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def _fill_unsaid(cls: type, fact: str, value: str) -> type:
    """Give the declarations of ``cls`` that leave ``fact`` unsaid (None) ``value``."""
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(SETTING)  # a subsection's field has none
        if declared is not None and getattr(declared, fact) is None:
            declared = dataclasses.replace(declared, **{fact: value})
            f.metadata = MappingProxyType({**f.metadata, SETTING: declared})
    return cls


def listed_in(group: str) -> Callable[[type], type]:
    """A class decorator (above ``@dataclass``): the keys of a schema section that name no
    group of their own are listed in the docs table ``group`` (its subsections' keys are
    theirs to place). The mixin sections of
    ``model`` (architecture, MoE, performance, ...) are flat in the YAML, so their table is
    not their section's name."""
    return functools.partial(_fill_unsaid, fact="group", value=group)


def passed_to(target: str) -> Callable[[type], type]:
    """A class decorator (above ``@dataclass``): the keys of a section that name no target
    of their own go to ``target``, a class whose fields are named as the keys (megatron-core
    declares the MoE keys as ``TransformerConfig`` fields of the same names)."""
    return functools.partial(_fill_unsaid, fact="target", value=target)


def declaration(f: dataclasses.Field) -> Setting:
    """The declaration of schema field ``f`` as written (:func:`declared_settings` completes
    its doc and target)."""
    return f.metadata[SETTING]


@functools.cache
def field_docs(cls: type) -> MappingProxyType[str, str]:
    """The docstrings written under the fields of ``cls``, each on one line."""
    (class_def,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    docs = {}
    for field_stmt, after in itertools.pairwise(class_def.body):
        if (
            isinstance(field_stmt, ast.AnnAssign)
            and isinstance(field_stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field_stmt.target.id] = " ".join(after.value.value.split())
    return MappingProxyType(docs)


@functools.cache
def _completed(cls: type, f: dataclasses.Field) -> Setting:
    """``f``'s declaration with its doc and the target field its name implies."""
    declared = declaration(f)
    if declared.translate is not None and declared.target is None:
        raise ValueError(f"{f.name}: a translated setting names where it goes (target=...)")
    if declared.target is not None and "." not in declared.target:
        declared = dataclasses.replace(declared, target=f"{declared.target}.{f.name}")
    if declared.doc is None:
        # The class that writes the field: a mixin section of ``model`` for most model keys.
        owner = next(c for c in cls.__mro__ if f.name in inspect.get_annotations(c))
        doc = field_docs(owner).get(f.name)
        if doc is None:
            raise ValueError(f"{owner.__name__}.{f.name} has no docstring under it and no doc=")
        declared = dataclasses.replace(declared, doc=doc)
    return declared


@dataclass(frozen=True)
class Declared:
    """A declared key: its dotted name, default and declaration."""

    key: str
    name: str
    default: Any
    setting: Setting


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def declared_settings(cls: type, prefix: str = "") -> Iterator[Declared]:
    """Every declared key below the schema dataclass ``cls``, in field order, depth first."""
    for f in dataclasses.fields(cls):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            yield from declared_settings(type(default), f"{prefix}{f.name}.")
        else:
            yield Declared(f"{prefix}{f.name}", f.name, default, _completed(cls, f))


def section(cfg: Any, key: str) -> Any:
    """The dataclass that holds ``key`` (``model.optim.lr`` -> ``cfg.model.optim``)."""
    node = cfg
    for part in key.split(".")[:-1]:
        node = getattr(node, part)
    return node


def target_values(cfg: Any, classes: tuple[str, ...], training: bool) -> dict[str, Any]:
    """The fields of the target ``classes`` that the declarations of ``cfg`` fill.

    A pass-through key gives its value to the field it names; a translated one gives
    whatever its function returns. Machine-policy keys are left out (their values come
    from ``fast_paths``), and so are training-only keys unless ``training``.
    """
    values: dict[str, Any] = {}
    for item in declared_settings(type(cfg)):
        s = item.setting
        if s.target_class not in classes:
            continue
        if s.policy == "machine" or (s.training_only and not training):
            continue
        value = getattr(section(cfg, item.key), item.name)
        if s.translate is not None:
            values.update(s.translate(value, cfg))
        else:
            values[s.target_field] = value
    return values


def value_errors(cfg: Any) -> Iterator[str]:
    """Messages for every declared rule ``cfg`` breaks, in field order, depth first."""
    for item in declared_settings(type(cfg)):
        check = item.setting.check
        if check is not None:
            message = check.error(item.key, getattr(section(cfg, item.key), item.name))
            if message:
                yield message


def shaping_keys(cls: type) -> tuple[str, ...]:
    """The dotted keys below the schema dataclass ``cls`` whose values shape parameters:
    what resume names when a checkpoint does not load."""
    return tuple(item.key for item in declared_settings(cls) if item.setting.shapes)


def keys_on_resume(cls: type, resume: Resume) -> tuple[Declared, ...]:
    """The declared keys below ``cls`` that a resume treats as ``resume`` says (module
    doc): a ``shapes`` key is :data:`RESUME_MODEL` unless it says otherwise."""
    return tuple(
        item
        for item in declared_settings(cls)
        if (item.setting.resume or (RESUME_MODEL if item.setting.shapes else None)) == resume
    )
