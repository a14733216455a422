"""megatron-core's hybrid layer pattern and the paper's block index: arithmetic shared by
the config checks (no torch here), the hybrid stack spec, the FLOPs count and conversion.

``HybridModel`` builds its decoder from a string with one symbol per *sublayer*: ``*``
attention, ``-`` MLP, ``E`` mixture-of-experts MLP (and ``M`` Mamba, ``G`` gated delta
net, ``D`` DeepSeek sparse attention, ``+`` multi-latent attention, which megatron-lns
refuses: their kernels are CUDA-only and LNS on them has not been checked on a GPU).
``|`` splits the pattern into pipeline segments (one per pipeline stage and virtual
chunk, in megatron's order ``vp_stage * pp_size + pp_rank``); ``/`` would start
multi-token-prediction layers, which megatron-lns does not run.

megatron numbers the sublayers 1..N (``layer_number``), so an attention and the MLP after
it have different numbers. LNS's depth is the paper's *block* index instead
(:func:`block_numbers`): an attention (mixer) sublayer starts a new block, and every MLP or
MoE sublayer belongs to the block of the last mixer before it. MLPs before the first
mixer belong to block 1; a mixer straight after another starts a block of its own (the
earlier block then has no MLP). So ``*-*-...`` (:func:`gpt_equivalent_pattern`) scales
attention and MLP of block ``l`` by ``1/sqrt(l)``, exactly as the GPT model does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

ATTENTION, MLP, MOE, PIPE, MTP = "*", "-", "E", "|", "/"
MIXERS = (ATTENTION,)
SUPPORTED = {ATTENTION: "attention", MLP: "MLP", MOE: "mixture-of-experts MLP"}
# megatron-core's other sublayers: known, refused by name until a GPU check covers them.
REFUSED = {
    "M": "a Mamba layer",
    "G": "a gated delta net layer",
    "D": "a DeepSeek sparse attention layer",
    "+": "a multi-latent attention layer",
}


class HybridPatternError(ValueError):
    pass


def sublayers(pattern: str) -> str:
    """The pattern's sublayer symbols, pipeline separators removed."""
    return pattern.replace(PIPE, "")


def block_numbers(pattern: str) -> tuple[int, ...]:
    """The paper's 1-based block index of each sublayer of ``pattern`` (module doc)."""
    numbers, block = [], 0
    for symbol in sublayers(pattern):
        if symbol in MIXERS:
            block += 1
        numbers.append(max(block, 1))
    return tuple(numbers)


def num_blocks(pattern: str) -> int:
    return max(block_numbers(pattern), default=0)


def layers_per_segment(layers: int, segments: int) -> int:
    """The layers of each of ``segments`` pipeline segments: the GPT model's even split
    of ``layers``, refused when it does not divide."""
    if segments < 1 or layers % segments:
        raise HybridPatternError(
            f"{layers} layers do not split evenly into {segments} pipeline segments"
        )
    return layers // segments


def gpt_equivalent_pattern(moe_layers: Sequence[int], segments: int = 1) -> str:
    """The pattern of the GPT model whose layer ``i`` is MoE when ``moe_layers[i]``: one
    attention and one MLP (``-``) or MoE (``E``) per layer, split into ``segments``
    pipeline segments of equal numbers of layers (the GPT model's even split)."""
    layers = len(moe_layers)
    per_segment = layers_per_segment(layers, segments)
    blocks = [ATTENTION + (MOE if is_moe else MLP) for is_moe in moe_layers]
    return PIPE.join(
        "".join(blocks[start : start + per_segment]) for start in range(0, layers, per_segment)
    )


def is_gpt_equivalent(pattern: str) -> bool:
    """Whether ``pattern`` (pipes aside) is attention followed by one MLP or MoE, repeated."""
    body = sublayers(pattern)
    return (
        len(body) > 0
        and len(body) % 2 == 0
        and all(body[i] == ATTENTION and body[i + 1] in (MLP, MOE) for i in range(0, len(body), 2))
    )


def pattern_errors(
    pattern: str, num_layers: int, pipeline: int = 1, virtual_pipeline: int | None = None
) -> list[str]:
    """What is wrong with ``pattern`` for ``num_layers`` sublayers at this pipeline layout,
    each as one sentence naming the symbol and its 1-based position in ``pattern``.

    The layout rules are megatron-core's (``select_pipeline_segment``), made strict where
    megatron would silently build less than the pattern: ``|`` must give exactly one
    segment per pipeline stage and virtual chunk."""
    if not pattern:
        return ["is empty"]
    errors = []
    for position, symbol in enumerate(pattern, start=1):
        if symbol in SUPPORTED or symbol == PIPE:
            continue
        if symbol in REFUSED:
            errors.append(
                f"{symbol!r} at position {position} is {REFUSED[symbol]}, whose kernels run only "
                "on CUDA and have not been checked with LNS on a GPU; megatron-lns builds "
                f"{_supported_list()}"
            )
        elif symbol == MTP:
            errors.append(
                f"{symbol!r} at position {position} starts multi-token-prediction layers, "
                "which megatron-lns does not run"
            )
        else:
            errors.append(
                f"{symbol!r} at position {position} is not a layer symbol; megatron-lns builds "
                f"{_supported_list()}, with '|' between pipeline segments"
            )
    if errors:
        return errors
    segments = pattern.split(PIPE)
    start = 0  # of each segment in pattern, 0-based
    for index, segment in enumerate(segments):
        if not segment:  # named by the '|' before it (the first segment: the one after it)
            where = start if index else 1
            errors.append(f"'|' at position {where} leaves an empty pipeline segment")
        start += len(segment) + 1
    count = len(sublayers(pattern))
    if count != num_layers:
        errors.append(
            f"has {count} sublayers but model.num_layers is {num_layers}: with a pattern, "
            "num_layers counts sublayers as megatron-core does (an attention and an MLP are "
            f"two), so set model.num_layers={count}"
        )
    stages = pipeline * (virtual_pipeline or 1)
    if len(segments) > 1 and len(segments) != stages:
        errors.append(
            f"has {len(segments)} pipeline segments ('|'-separated) but the layout has "
            f"{stages} (pipeline_model_parallel_size {pipeline} x virtual chunks "
            f"{virtual_pipeline or 1}); give one segment per stage and chunk"
        )
    elif len(segments) == 1 and virtual_pipeline:
        errors.append(
            "has no '|' separators, which a virtual pipeline needs: give "
            f"{stages} segments, one per stage and virtual chunk"
        )
    elif len(segments) == 1 and count % pipeline:
        errors.append(
            f"has {count} sublayers, not divisible by pipeline_model_parallel_size "
            f"{pipeline}; split it with '|' (one segment per stage)"
        )
    return errors


def _supported_list() -> str:
    return ", ".join(f"{symbol} ({name})" for symbol, name in SUPPORTED.items())


# A GPT layer's modules, by the sublayer of the GPT twin (``*-`` per layer) they live in.
ATTENTION_MODULES = ("input_layernorm.", "self_attention.", "self_attn_bda.")
GPT_FINAL_NORM, HYBRID_FINAL_NORM = "decoder.final_layernorm.", "decoder.final_norm."
_LAYER_KEY = re.compile(r"(?:^|(?<=\.))decoder\.layers\.(\d+)\.")


def gpt_key_to_hybrid(key: str) -> str:
    """The name in the GPT twin (``*-`` or ``*E`` per layer) of a GPT model's parameter or
    checkpoint key: layer ``i``'s attention moves to sublayer ``2i``, its MLP to ``2i+1``,
    and the final norm is ``final_norm``. Keys outside the decoder are unchanged."""
    key = key.replace(GPT_FINAL_NORM, HYBRID_FINAL_NORM)
    match = _LAYER_KEY.search(key)
    if match is None:
        return key
    rest = key[match.end() :]
    sublayer = 2 * int(match.group(1)) + (0 if rest.startswith(ATTENTION_MODULES) else 1)
    return f"{key[: match.start()]}decoder.layers.{sublayer}.{rest}"


def hybrid_key_to_gpt(key: str) -> str:
    """The inverse of :func:`gpt_key_to_hybrid`, for a GPT-equivalent pattern."""
    key = key.replace(HYBRID_FINAL_NORM, GPT_FINAL_NORM)
    match = _LAYER_KEY.search(key)
    if match is None:
        return key
    return f"{key[: match.start()]}decoder.layers.{int(match.group(1)) // 2}.{key[match.end() :]}"
