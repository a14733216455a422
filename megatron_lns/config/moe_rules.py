"""The rules that relate the mixture-of-experts keys to each other and to the layout.

Each mirrors a check megatron-core makes once the process groups or the model exist
(``TransformerConfig.__post_init__``, ``parallel_state.initialize_model_parallel``, the
MoE layer's constructor), so a bad YAML fails before any process starts, naming its key.
"""

from __future__ import annotations

from omegaconf import ListConfig

from megatron_lns.config import model_derived
from megatron_lns.config.layout import ParallelLayout
from megatron_lns.config.loader import ConfigError
from megatron_lns.config.moe_layers import MoELayerFreqError, moe_layer_count
from megatron_lns.config.settings import declared_settings


def moe_only_keys() -> dict[str, object]:
    """Every key of the schema's ``moe`` group but ``num_moe_experts``, with its default:
    each means something only where a layer has experts."""
    from megatron_lns.config.schema import ModelConfig

    return {
        d.key: d.default
        for d in declared_settings(ModelConfig)
        if d.setting.group == "moe" and d.key != "num_moe_experts"
    }


def _refuse_moe_keys_set(m, why: str) -> None:
    """Refuse, by name, the first MoE key set away from its default; ``why`` says why no
    layer has experts."""
    for name, unused in moe_only_keys().items():
        value = getattr(m, name)
        if value != unused:
            shown = list(value) if isinstance(value, ListConfig) else value
            raise ConfigError(f"model.{name}={shown!r} has no effect: {why}")


def check_moe(m, world: int) -> None:
    """Every cross-key MoE rule; ``m`` is the ``model:`` section, ``world`` the ranks."""
    experts = m.num_moe_experts
    if not model_derived.has_experts(m):
        _refuse_moe_keys_set(
            m, "it needs a mixture-of-experts model (model.num_moe_experts is not set)"
        )
        if m.recompute_modules and {"moe", "moe_act", "shared_experts"} & set(m.recompute_modules):
            raise ConfigError(
                f"model.recompute_modules={list(m.recompute_modules)} names MoE modules but the "
                "model has no experts (model.num_moe_experts)"
            )
        return
    try:
        moe_layers = moe_layer_count(m.moe_layer_freq, m.num_layers)
    except MoELayerFreqError as err:
        raise ConfigError(f"model.{err}") from None
    if not moe_layers:  # (a hybrid pattern keeps moe_layer_freq 1: check_hybrid)
        freq = (
            list(m.moe_layer_freq) if isinstance(m.moe_layer_freq, ListConfig) else m.moe_layer_freq
        )
        raise ConfigError(
            f"model.moe_layer_freq={freq!r} places no MoE layer, so "
            f"model.num_moe_experts={experts} would build no expert: mark at least one layer "
            "1, or drop model.num_moe_experts for a dense model"
        )
    if m.moe_router_topk > experts:
        raise ConfigError(
            f"model.moe_router_topk ({m.moe_router_topk}) exceeds model.num_moe_experts ({experts})"
        )
    ep = m.expert_model_parallel_size
    if experts % ep:
        raise ConfigError(
            f"model.num_moe_experts ({experts}) is not divisible by "
            f"model.expert_model_parallel_size ({ep})"
        )
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    layout = ParallelLayout(
        tensor=m.tensor_model_parallel_size,
        pipeline=m.pipeline_model_parallel_size,
        context=m.context_parallel_size,
        expert=ep,
        expert_tensor=etp,
    )
    try:
        layout.expert_data_parallel(world)
    except ValueError as err:
        raise ConfigError(f"{err} (trainer.num_nodes x trainer.devices)") from None
    expert_ffn = model_derived.expert_ffn_hidden_size(m)
    if expert_ffn % etp:
        raise ConfigError(
            f"the experts' MLP width (model.moe_ffn_hidden_size, else model.ffn_hidden_size: "
            f"{expert_ffn}) is not divisible by the expert tensor-parallel size ({etp})"
        )
    if m.bias and etp != 1:
        raise ConfigError(
            "model.bias=true with experts needs model.expert_tensor_parallel_size=1 "
            "(megatron-core's MoE layers have biases only with whole experts)"
        )
    if m.moe_token_dispatcher_type == "flex":
        raise ConfigError(
            "model.moe_token_dispatcher_type=flex is not supported: it runs DeepEP / HybridEP "
            "CUDA kernels not tested here; use alltoall (same function)"
        )
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "model.moe_router_enable_expert_bias=true needs "
            "model.moe_router_score_function=sigmoid (megatron-core's aux-loss-free balancing)"
        )
    if m.moe_router_load_balancing_type == "sinkhorn" and m.moe_router_topk != 1:
        raise ConfigError(
            "model.moe_router_load_balancing_type=sinkhorn routes each token to one expert: "
            f"set model.moe_router_topk=1 (got {m.moe_router_topk})"
        )
    if (
        m.moe_router_topk == 1
        and m.moe_router_score_function == "softmax"
        and not m.moe_router_pre_softmax
        and m.moe_router_load_balancing_type != "sinkhorn"
    ):
        raise ConfigError(
            "model.moe_router_topk=1 with a softmax router needs model.moe_router_pre_softmax="
            "true (a softmax over one chosen logit is 1: the router would get no gradient)"
        )
    if m.moe_router_load_balancing_type == "sinkhorn" and m.moe_aux_loss_coeff:
        raise ConfigError(
            "model.moe_router_load_balancing_type=sinkhorn balances without an aux loss: set "
            f"model.moe_aux_loss_coeff=0 (got {m.moe_aux_loss_coeff})"
        )
    if m.moe_expert_capacity_factor is not None and m.moe_router_load_balancing_type == "sinkhorn":
        raise ConfigError(
            "model.moe_expert_capacity_factor does not work with "
            "model.moe_router_load_balancing_type=sinkhorn (megatron-core)"
        )
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError(
            "model.moe_pad_expert_input_to_capacity=true needs model.moe_expert_capacity_factor"
        )
    if m.moe_shared_expert_overlap:
        if m.moe_shared_expert_intermediate_size is None:
            raise ConfigError(
                "model.moe_shared_expert_overlap=true needs a shared expert "
                "(model.moe_shared_expert_intermediate_size)"
            )
        if m.moe_token_dispatcher_type != "alltoall":
            raise ConfigError(
                "model.moe_shared_expert_overlap=true needs model.moe_token_dispatcher_type="
                "alltoall (megatron-core overlaps the shared expert with its all-to-all)"
            )
    if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size is None:
        raise ConfigError(
            "model.moe_shared_expert_gate=true needs a shared expert "
            "(model.moe_shared_expert_intermediate_size)"
        )
    modules = set(m.recompute_modules or ())
    if "moe_act" in modules and (not m.transformer_engine or m.moe_grouped_gemm is False):
        raise ConfigError(
            "model.recompute_modules: moe_act needs the experts' grouped GEMM "
            "(model.transformer_engine=true, model.moe_grouped_gemm not false)"
        )
    if "shared_experts" in modules and m.moe_shared_expert_overlap:
        raise ConfigError(
            "model.recompute_modules: shared_experts cannot be recomputed with "
            "model.moe_shared_expert_overlap=true (megatron-core)"
        )
