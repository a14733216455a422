"""The rules that relate ``model.architecture`` / ``model.hybrid_layer_pattern`` to the
other keys: the pattern's symbols, its length against ``num_layers``, its pipeline
segments against the layout (``hybrid_pattern.pattern_errors``, megatron-core's rules made
strict), and the settings that mean something only to one architecture."""

from __future__ import annotations

from megatron_lns.config import hybrid_pattern, model_derived
from megatron_lns.config.layer_variants import variant_info
from megatron_lns.config.loader import ConfigError
from megatron_lns.config.output_inits import resolved_output_init

KEY = "model.hybrid_layer_pattern"


def check_hybrid(m) -> None:
    """Every cross-key rule of the hybrid architecture; ``m`` is the ``model:`` section."""
    pattern = m.hybrid_layer_pattern
    if m.architecture != "hybrid":
        if pattern is not None:
            raise ConfigError(
                f"{KEY} is read by the hybrid architecture only: set model.architecture=hybrid "
                "(or drop the pattern)"
            )
        return
    if variant_info(m.layer_variant).changes_layer:
        raise ConfigError(
            f"model.layer_variant={m.layer_variant} is built for model.architecture=gpt only; "
            "the hybrid stack has Pre-LN sublayers, with or without LNS"
        )
    init = resolved_output_init(m.output_layer_init, m.norm_scaling)
    if init.per_layer:
        raise ConfigError(
            f"model.output_layer_init={init.name} is built for model.architecture=gpt only"
        )
    if m.cpu_offloading:
        raise ConfigError(
            "model.cpu_offloading=true is built for model.architecture=gpt only: megatron-core's "
            "HybridStack has no activation offloading, so it would offload nothing"
        )
    if pattern is None:
        return
    errors = hybrid_pattern.pattern_errors(
        pattern,
        m.num_layers,
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
    )
    if errors:
        raise ConfigError(f"{KEY}={pattern!r}: {errors[0]}")
    has_moe = hybrid_pattern.MOE in pattern
    if has_moe and not model_derived.has_experts(m):
        position = pattern.index(hybrid_pattern.MOE) + 1
        raise ConfigError(
            f"{KEY}={pattern!r}: 'E' at position {position} is an MoE sublayer, which needs "
            "model.num_moe_experts"
        )
    if model_derived.has_experts(m) and not has_moe:
        raise ConfigError(
            f"model.num_moe_experts={m.num_moe_experts} but {KEY}={pattern!r} has no 'E' "
            "(MoE) sublayer to put experts in"
        )
    if str(m.moe_layer_freq) != "1":
        raise ConfigError(
            f"model.moe_layer_freq={m.moe_layer_freq!r} is not read when {KEY} is set: the "
            "pattern's 'E's are the MoE layers; drop moe_layer_freq"
        )
    _check_recompute_segments(m)


def hybrid_segments(m) -> list[str]:
    """The pattern's ``|``-separated pipeline segments; empty without a pattern or ``|``."""
    pattern = m.hybrid_layer_pattern
    if m.architecture != "hybrid" or not pattern or hybrid_pattern.PIPE not in pattern:
        return []
    return pattern.split(hybrid_pattern.PIPE)


def _check_recompute_segments(m) -> None:
    """With a pattern, ``activations_checkpoint_num_layers`` counts sublayers of one
    pipeline segment (megatron-core recomputes per model chunk); more than the longest
    segment holds recomputes nothing more, so it is a mistake in the count."""
    recomputed = m.activations_checkpoint_num_layers
    segments = hybrid_segments(m)
    if m.activations_checkpoint_granularity != "full" or not recomputed or not segments:
        return
    longest = max(len(segment) for segment in segments)
    if recomputed > longest:
        raise ConfigError(
            f"model.activations_checkpoint_num_layers ({recomputed}) exceeds the sublayers of "
            f"the longest pipeline segment of {KEY} ({longest}): with a pattern it counts "
            "sublayers per segment, as megatron-core does"
        )
