"""The Hugging Face architectures conversion supports, one module each, by class name.

Each module defines one :class:`~.base.Architecture` subclass that says only how its
architecture differs from the shared mapping (:mod:`.base`, :mod:`.layout`).
``ARCHITECTURES`` lists them; every lookup goes through this registry:

* import: ``config.json``'s ``architectures`` entry -> the class registered under it;
* export: a dense model (no ``model.num_moe_experts``) goes to a dense architecture, an
  MoE model to an MoE one; among those, ``model.normalization`` picks the ones with that
  norm (``layernorm1p`` is a LayerNorm once the fold removes its zero-centring), and the
  first whose ``exports_model`` takes the model is chosen (an MoE model with experts in
  every layer, no shared expert and megatron's default routing is a Mixtral; any other
  is a Qwen2-MoE, whose dense layers are its ``mlp_only_layers`` and whose shared expert
  may be zero wide). A later dense architecture with the
  same norm is read by import and exported as the earlier one, which computes the same
  function.

Every model setting's role in export is declared with it (``hf=``, ``config.settings``):
the architectures map the ones they know; ``convert/hf_settings.py`` refuses, by name,
a non-default value of one no Hugging Face model holds.

A hybrid run (``model.architecture: hybrid``) exports as the GPT model it equals when its
pattern is the GPT-equivalent one (``*-`` / ``*E`` per block, or no pattern): the same
architecture, read from its sublayers' keys (``Architecture.hybrid``); any other pattern
is refused, since no stock architecture has it.

Adding an architecture is a new module here, its entry in ``ARCHITECTURES``, and its
parity tests (docs/conversion.md, "Adding a Hugging Face architecture").
"""

from __future__ import annotations

import dataclasses

from megatron_lns.config import hybrid_pattern, model_derived
from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.architectures.base import HF_NORM_OF, Architecture
from megatron_lns.convert.architectures.llama import Llama
from megatron_lns.convert.architectures.mixtral import Mixtral
from megatron_lns.convert.architectures.qwen2_moe import Qwen2Moe
from megatron_lns.convert.architectures.refusals import (
    listed,
    refuse_impossible_hf_counts,
    refuse_unshared_design,
)
from megatron_lns.convert.architectures.stablelm import StableLm
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.hf_settings import refuse_unexportable

ARCHITECTURES: tuple[type[Architecture], ...] = (Llama, StableLm, Mixtral, Qwen2Moe)


def _by_hf_class() -> dict[str, type[Architecture]]:
    """The registry by class name; two architectures under one name would be a choice
    import cannot make."""
    table: dict[str, type[Architecture]] = {}
    for arch in ARCHITECTURES:
        if arch.hf_class in table:
            raise TypeError(
                f"{arch.__name__} and {table[arch.hf_class].__name__} are both "
                f"registered as {arch.hf_class}"
            )
        table[arch.hf_class] = arch
    return table


BY_HF_CLASS = _by_hf_class()


def architecture_for_hf_config(config, lns: bool) -> Architecture:
    """The architecture of a Hugging Face ``config.json``; ``lns``: its pre-norm weights
    carry folded LNS factors."""
    architectures = list(getattr(config, "architectures", None) or [])
    arch = BY_HF_CLASS.get(architectures[0]) if len(architectures) == 1 else None
    if arch is None:
        raise ConversionError(
            f"config.json: architectures={architectures} is not supported; import reads "
            f"{listed(BY_HF_CLASS)}"
        )
    refuse_impossible_hf_counts(config)
    return arch.from_hf_config(config, lns)


def architecture_for_model_config(m: ModelConfig) -> Architecture:
    """The architecture a megatron-lns ``model:`` section exports as; refuses what no
    registered architecture computes exactly, naming the setting."""
    hybrid = m.architecture == "hybrid"
    m = gpt_model_of(m)
    refuse_unshared_design(m, [arch.name for arch in ARCHITECTURES])
    moe = model_derived.has_experts(m)
    kind = [arch for arch in ARCHITECTURES if arch.moe == moe]
    norm = HF_NORM_OF.get(m.normalization)
    candidates = [arch for arch in kind if arch.norm == norm]
    if not candidates:
        norms = dict.fromkeys(other.norm for other in kind)
        what = "mixture-of-experts architectures" if moe else "architectures"
        raise ConversionError(
            f"model.normalization={m.normalization} cannot be exported: the supported "
            f"{what} ({listed(arch.name for arch in kind)}) have {listed(norms, ' or ')}"
        )
    arch = next((arch for arch in candidates if arch.exports_model(m)), candidates[0])
    exported = dataclasses.replace(arch.from_model_config(m), hybrid=hybrid)
    refuse_unexportable(m)
    return exported


def gpt_model_of(m: ModelConfig) -> ModelConfig:
    """The GPT ``model:`` section that computes what ``m`` does: ``m`` itself for a GPT run
    or a hybrid run without a pattern (the GPT twin: ``num_layers`` blocks,
    ``moe_layer_freq``); for a hybrid pattern, one GPT layer per block (the paper's
    ``l``, :func:`~megatron_lns.config.hybrid_pattern.block_numbers`), MoE where the block's MLP
    is. Refuses a pattern that is not attention + one MLP or MoE per block."""
    pattern = m.hybrid_layer_pattern
    if m.architecture != "hybrid" or not pattern:
        return m
    if not hybrid_pattern.is_gpt_equivalent(pattern):
        raise ConversionError(
            f"model.hybrid_layer_pattern={pattern!r} cannot be exported: Hugging Face has no "
            f"such architecture ({listed(arch.name for arch in ARCHITECTURES)} are one "
            "attention and one MLP or MoE per block, '*-' or '*E' repeated)"
        )
    body = hybrid_pattern.sublayers(pattern)
    moe = [0] * hybrid_pattern.num_blocks(body)
    for symbol, block in zip(body, hybrid_pattern.block_numbers(body), strict=True):
        if symbol == hybrid_pattern.MOE:
            moe[block - 1] = 1
    return dataclasses.replace(
        m,
        architecture="gpt",
        hybrid_layer_pattern=None,
        num_layers=len(moe),
        moe_layer_freq=moe if any(moe) else m.moe_layer_freq,
    )


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "architecture_for_hf_config",
    "architecture_for_model_config",
    "gpt_model_of",
]
