"""What an MoE run logs per step: megatron's router losses and how evenly tokens spread.

* The load-balancing loss(es) and the z-loss, without their coefficients, as megatron's
  routers record them in the process-global tracker (``get_moe_metrics_tracker``):
  reduced across ranks by the tracker's own ``report`` (pipeline stages summed, then its
  TP/CP sum, TP x DP x CP average, DP average), averaged over micro-batches (megatron's
  ``loss_scale = 1 / num_microbatches``) and over the MoE layers. Routers record only
  in training mode with gradients on, so validation adds nothing; the tracker is cleared
  at the start of every step all the same (logged or not), so a step reports only its own
  micro-batches.
* Expert load: tokens routed to each expert in a step, counted from the router's output
  ``routing_map`` (after capacity dropping, what the dispatcher sends), summed over the
  tensor x data x context parallel group (the group megatron's expert-bias update sums
  ``local_tokens_per_expert`` over; with TP, megatron requires sequence parallelism, so
  each rank's router sees its own tokens) and over pipeline stages. ``expert_load_max``
  is the largest count over the mean count per expert, in any MoE layer (1 when perfectly
  balanced, ``num_experts / topk`` at worst); ``expert_load_min`` the smallest (0 when an
  expert gets no token). Counted, like megatron's expert-bias counts, only in training
  mode with gradients on: validation and the no-grad first pass of recomputation add
  nothing. (``local_tokens_per_expert`` itself exists only with expert bias, and the
  optimizer step zeroes it before a logger could read it.)

With ``moe_per_layer_logging`` each value is also logged per MoE layer, keyed by its
global 1-based layer number (``moe/z_loss/layer_3``). In a hybrid model megatron numbers
the sublayers (its ``layer_number``, which indexes the counts and the tracker here); the
logged name is the paper's layer, the block (``hybrid_pattern.block_numbers``), so a
GPT-equivalent hybrid run logs the names its GPT run logs; a block with several MoE
sublayers names each by its sublayer too (``layer_2_sublayer_5``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lns.config import hybrid_pattern, model_derived
from megatron_lns.config.moe_layers import moe_layer_pattern
from megatron_lns.model.language_model import unwrap

# megatron's routers record each load-balancing type under its own name.
_AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def tracked_loss_names(config: TransformerConfig) -> list[str]:
    """The tracker names this config's routers record (the same on every rank)."""
    types = config.moe_router_load_balancing_type
    types = [types] if isinstance(types, str) else list(types)
    coeffs = config.moe_aux_loss_coeff
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    names = [
        _AUX_LOSS_NAMES[t] for t, c in zip(types, coeffs, strict=True) if t in _AUX_LOSS_NAMES and c
    ]
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


class _TokenCounter:
    """Forward hook on a router: adds its ``routing_map``'s tokens per expert to a row."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def __call__(self, router: torch.nn.Module, _inputs, outputs) -> None:
        if router.training and torch.is_grad_enabled():
            _probs, routing_map = outputs
            self.row += routing_map.sum(dim=0).to(self.row.dtype)


class MoEMetrics:
    """Step metrics of an MoE model's routers (``for_model`` gives None for a dense one).

    Every rank calls :meth:`start_step` before each training step and :meth:`report` at
    the steps that are logged (it runs collectives).
    """

    def __init__(self, model: Sequence[torch.nn.Module], config: TransformerConfig) -> None:
        self.config = config
        self.moe_pattern, self.layer_names = moe_layers_of(model, config)
        # megatron's layer_number (1-based) of each MoE layer or sublayer
        self.moe_layers = [i + 1 for i, is_moe in enumerate(self.moe_pattern) if is_moe]
        self.loss_names = tracked_loss_names(config)
        self.per_layer = bool(config.moe_per_layer_logging)
        self.device = next(model[0].parameters()).device
        self.counts = torch.zeros(
            config.num_layers, config.num_moe_experts, dtype=torch.int64, device=self.device
        )
        self.hooks = []
        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    counter = _TokenCounter(self.counts[module.layer_number - 1])
                    self.hooks.append(module.register_forward_hook(counter))

    @classmethod
    def for_model(
        cls, model: Sequence[torch.nn.Module], config: TransformerConfig
    ) -> MoEMetrics | None:
        return cls(model, config) if model_derived.has_experts(config) else None

    def start_step(self) -> None:
        """Forget whatever was recorded since the last step (on every rank)."""
        get_moe_metrics_tracker().clear()
        self.counts.zero_()

    def report(self, num_microbatches: int) -> tuple[dict[str, float], dict[str, float]]:
        """(means over the MoE layers, per-layer values or {}) of this step, on every rank."""
        per_layer = _Collector()
        losses: dict[str, torch.Tensor] = {}
        get_moe_metrics_tracker().report(
            loss_scale=1.0 / num_microbatches,
            iteration=0,
            writer=per_layer,
            per_layer_logging=self.per_layer,
            force_initialize=True,  # a pipeline stage without MoE layers joins the sums
            track_names=self.loss_names,
            num_layers=self.config.num_layers,
            moe_layer_freq=self.moe_pattern,
            total_loss_dict=losses,
        )
        summary = {f"moe/{name}": float(losses[name]) for name in self.loss_names}
        layers = {}
        if self.per_layer:  # megatron's names: 0-based index over all layers
            for name in self.loss_names:
                for layer in self.moe_layers:
                    value = per_layer.values[f"moe/{name}_layer_{layer - 1}"]
                    layers[f"moe/{name}/{self.layer_names[layer]}"] = value
        summary.update(self._expert_load(layers))
        return summary, (layers if self.per_layer else {})

    def _expert_load(self, layers: dict[str, float]) -> dict[str, float]:
        counts = self.counts.clone()
        dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(
            counts,
            group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True),
        )
        counts = counts[[layer - 1 for layer in self.moe_layers]].double()
        mean = counts.mean(dim=1).clamp(min=1e-12)
        highest, lowest = counts.max(dim=1).values / mean, counts.min(dim=1).values / mean
        for layer, high, low in zip(
            self.moe_layers, highest.tolist(), lowest.tolist(), strict=True
        ):
            layers[f"moe/expert_load_max/{self.layer_names[layer]}"] = high
            layers[f"moe/expert_load_min/{self.layer_names[layer]}"] = low
        return {
            "moe/expert_load_max": float(highest.max()),
            "moe/expert_load_min": float(lowest.min()),
        }

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def moe_layers_of(
    model: Sequence[torch.nn.Module], config: TransformerConfig
) -> tuple[list[int], dict[int, str]]:
    """(1 for each MoE layer and 0 for each other, by megatron's ``layer_number``; the
    logged name of each MoE layer by that number). A hybrid model's pattern (kept by
    ``HybridModel``, the same on every rank) says which sublayers are MoE, and its
    ``moe_layer_freq`` is not set."""
    pattern = getattr(unwrap(model[0]), "hybrid_layer_pattern", None)
    if not pattern:
        flags = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
        return flags, {i + 1: f"layer_{i + 1}" for i, is_moe in enumerate(flags) if is_moe}
    body = hybrid_pattern.sublayers(pattern.split(hybrid_pattern.MTP)[0])
    flags = [int(symbol == hybrid_pattern.MOE) for symbol in body]
    blocks = hybrid_pattern.block_numbers(body)
    moe_blocks = [block for block, is_moe in zip(blocks, flags, strict=True) if is_moe]
    names = {}
    for number, (block, is_moe) in enumerate(zip(blocks, flags, strict=True), start=1):
        if is_moe:
            shared = moe_blocks.count(block) > 1
            names[number] = f"layer_{block}" + (f"_sublayer_{number}" if shared else "")
    return flags, names


class _Collector:
    """Stands in for the TensorBoard writer megatron's tracker writes per-layer values to."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add_scalar(self, name: str, value, _step: int) -> None:
        self.values[name] = float(value)
