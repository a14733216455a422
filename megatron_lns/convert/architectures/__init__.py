"""The Hugging Face architectures conversion supports, one module each, by class name.

Each module defines one :class:`~.base.Architecture` subclass that says only how its
architecture differs from the shared mapping in :mod:`.base`. ``ARCHITECTURES`` lists
them; every lookup goes through this registry:

* import: ``config.json``'s ``architectures`` entry -> the class registered under it;
* export: a dense model (no ``model.num_moe_experts``) goes to a dense architecture, an
  MoE model to an MoE one; among those, ``model.normalization`` picks the ones with that
  norm (``layernorm1p`` is a LayerNorm once the fold removes its zero-centring), and the
  first whose ``exports_model`` takes the model is chosen (an MoE model with a shared
  expert is a Qwen2-MoE, one without a Mixtral). A later dense architecture with the
  same norm is read by import and exported as the earlier one, which computes the same
  function.

Adding an architecture is a new module here, its entry in ``ARCHITECTURES``, and its
parity tests (docs/conversion.md, "Adding a Hugging Face architecture").
"""

from __future__ import annotations

from megatron_lns.config.schema import ModelConfig
from megatron_lns.convert.architectures.base import (
    HF_NORM_OF,
    Architecture,
    listed,
    refuse_unshared_design,
)
from megatron_lns.convert.architectures.llama import Llama
from megatron_lns.convert.architectures.mixtral import Mixtral
from megatron_lns.convert.architectures.qwen2_moe import Qwen2Moe
from megatron_lns.convert.architectures.stablelm import StableLm
from megatron_lns.convert.errors import ConversionError

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
    return arch.from_hf_config(config, lns)


def architecture_for_model_config(m: ModelConfig) -> Architecture:
    """The architecture a megatron-lns ``model:`` section exports as; refuses what no
    registered architecture computes exactly, naming the setting."""
    refuse_unshared_design(m, [arch.name for arch in ARCHITECTURES])
    moe = bool(m.num_moe_experts)
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
    return arch.from_model_config(m)


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "architecture_for_hf_config",
    "architecture_for_model_config",
]
