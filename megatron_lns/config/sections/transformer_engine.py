"""``model``'s Transformer Engine and FP8 keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lns.config.rules import (
    non_negative,
    one_of,
    positive,
)
from megatron_lns.config.settings import HF_REFUSE, listed_in, setting, to

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _backend(value: bool, cfg: Any) -> dict[str, Any]:
    return {"backend": "te" if value else "local"}


def _fp8_format(value: str | None, cfg: Any) -> dict[str, Any]:
    return {"fp8_format": value or "hybrid"}


@listed_in("transformer_engine")
@dataclass
class TransformerEngineSettings:
    """``model``'s Transformer Engine keys (the ``transformer_engine`` table)."""

    transformer_engine: bool = setting(False, target="layer_spec.backend", translate=_backend)
    """Transformer Engine layer spec (fused norm + linear; LNS folded into the fused norm)"""

    fp8: str | None = setting(
        None, one_of(FP8_RECIPES), target="TransformerConfig.fp8_recipe", translate=to("fp8")
    )
    """NeMo's `false` = null; `TransformerConfig.fp8_recipe` (needs `transformer_engine` and
    `trainer.precision: bf16-mixed`): `delayed` (amax history, compute capability >= 8.9),
    `tensorwise` (current scaling, >= 8.9), `blockwise` (>= 9.0), `mxfp8` (Blackwell, >= 10.0);
    checked against the GPU at launch"""

    fp8_format: str | None = setting(
        None,
        one_of(FP8_FORMATS),
        target="TransformerConfig.fp8",
        translate=_fp8_format,
        null_means="`hybrid`",
    )
    """`TransformerConfig.fp8`: `hybrid` (E4M3 forward, E5M2 gradients) or `e4m3`. NeMo's `fp8_e4m3:
    true` sets `e4m3` (and contradicts an explicit `hybrid`); NeMo's `fp8_hybrid` is accepted either
    way (true is the default; as in NeMo, `fp8_e4m3` wins when both are true)"""

    fp8_param: bool = setting(False, target="TransformerConfig", hf=HF_REFUSE)
    """`fp8_param`: keep the weights themselves in FP8; false keeps bf16 weights with fp32 main
    weights in the optimizer"""

    fp8_margin: int = setting(0, non_negative, target="TransformerConfig")
    """`TransformerConfig.fp8_margin`"""

    fp8_amax_history_len: int = setting(1024, positive, target="TransformerConfig")
    """`fp8_amax_history_len` (delayed scaling)"""

    fp8_amax_compute_algo: str = setting(
        "max", one_of(FP8_AMAX_COMPUTE_ALGOS), target="TransformerConfig"
    )
    """`fp8_amax_compute_algo` (`max` or `most_recent`)"""
