"""The inits of the residual output projections (``model.output_layer_init``: attention's
``linear_proj`` and the MLP's ``linear_fc2``), registered once with their math, their
``compare`` suffix and where they can be built, without importing torch.

Each init is ``N(0, std)`` with ``std`` a function of ``init_method_std``, the model's depth
``N`` (the paper's blocks) and, for a per-layer init, the layer's global number ``l``. The
model reads ``std`` from the entry (``GPTModelConfig.transformer_config``,
``model/variants/depth_scaled_init.py``); an init is the same function of the weights in
every export, so none has a Hugging Face role. Code reads the entry, never the init's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron_lns.config.norm_scalings import norm_scaling_info

# std(init_method_std, num_blocks, layer_number) -> the projections' standard deviation;
# layer_number is None for the model-wide init (a per-layer init's placeholder).
Std = Callable[[float, int, int | None], float]


def depth_scaled_std(std: float, layer_number: int) -> float:
    """Depth-scaled init of layer ``l``'s output projections: ``std / sqrt(2 l)``."""
    return std / math.sqrt(2.0 * layer_number)


@dataclass(frozen=True)
class OutputInitInfo:
    """One output init's facts for the config layer, the model and ``compare``."""

    name: str
    std: Std
    math: str  # for the key's row in docs/configuration.md
    label: str  # ``compare``'s arm suffix ``+<name>_init`` labels its arm "... + <label>"
    # True: each layer needs its own std (its global number decides), so the layer is built
    # by megatron-lns's local layer class (not Transformer Engine's, not the hybrid stack's).
    per_layer: bool = False
    # NeMo's ``use_scaled_init_method`` value that means this init; None: NeMo has none.
    nemo_use_scaled_init_method: bool | None = None

    @property
    def compare_suffix(self) -> str:
        return f"{self.name}_init"


REGISTRY: dict[str, OutputInitInfo] = {
    info.name: info
    for info in (
        OutputInitInfo(
            "normal",
            lambda std, blocks, layer: std,
            math="N(0, init_method_std) (the LNS paper's advice with LNS)",
            label="normal init",
            nemo_use_scaled_init_method=False,
        ),
        OutputInitInfo(
            "scaled",
            # Exactly megatron's scaled_init_method_normal(std, N): std / sqrt(2.0 * N).
            lambda std, blocks, layer: std / math.sqrt(2.0 * blocks),
            math="megatron's N(0, std/sqrt(2L))",
            label="scaled init",
            nemo_use_scaled_init_method=True,
        ),
        OutputInitInfo(
            "depth_scaled",
            lambda std, blocks, layer: std if layer is None else depth_scaled_std(std, layer),
            math="N(0, std/sqrt(2l)) in layer l (local backend)",
            label="depth-scaled init",
            per_layer=True,
        ),
    )
}

OUTPUT_INITS: tuple[str, ...] = tuple(REGISTRY)


def output_init_info(name: str) -> OutputInitInfo:
    """The registered init ``name``; an unknown name is refused with the known ones."""
    if name not in REGISTRY:
        raise ValueError(f"output_layer_init must be one of {OUTPUT_INITS}, got {name!r}")
    return REGISTRY[name]


def resolved_output_init(output_layer_init: str | None, norm_scaling: str) -> OutputInitInfo:
    """The init a model uses: the configured one, else its norm scaling rule's default."""
    if output_layer_init is None:
        output_layer_init = norm_scaling_info(norm_scaling).default_output_init
    return output_init_info(output_layer_init)
