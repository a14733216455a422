"""``model``'s mixture-of-experts keys: experts, router, dispatcher, shared experts,
capacity and the experts' parallel split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_lns.config.choices import (
    MOE_DISPATCHERS,
    MOE_DROP_POLICIES,
    MOE_LOAD_BALANCING,
    MOE_ROUTER_DTYPES,
    MOE_SCORE_FUNCTIONS,
)
from megatron_lns.config.moe_layers import parse_moe_layer_freq
from megatron_lns.config.rules import (
    moe_layer_frequency,
    non_negative,
    one_of,
    positive,
)
from megatron_lns.config.settings import HF_CONVERTER, listed_in, passed_to, setting


def _moe_layer_freq(value: Any, cfg: Any) -> dict[str, Any]:
    """Plain Python for megatron-core: the int, or the list (an expression evaluated)."""
    return {"moe_layer_freq": parse_moe_layer_freq(value)}


@listed_in("moe")
@passed_to("TransformerConfig")
@dataclass
class MoeSettings:
    """``model``'s MoE keys (the ``moe`` table), megatron-core's ``TransformerConfig`` fields
    of the same names but for the experts' parallel split."""

    num_moe_experts: int | None = setting(
        None, positive, null_means="dense MLPs", shapes=True, hf=HF_CONVERTER
    )
    """`num_moe_experts`: routed experts per MoE layer. Each MoE layer is megatron-core's `MoELayer`
    (router, token dispatcher, experts, optional shared expert) behind the layer's pre-MLP norm,
    which LNS scales by 1/sqrt(l) like a dense layer's, so the router and the experts both see the
    scaled input"""

    moe_layer_freq: Any = setting(
        1, moe_layer_frequency, translate=_moe_layer_freq, shapes=True, hf=HF_CONVERTER
    )
    """which layers are MoE: an int N (layers 1, N+1, 2N+1, ... counted from 1; 1 = all), a list of
    0 (dense) / 1 (MoE) per layer, or megatron-lm's list expression such as `'[0]*1+[1]*15'`. Every
    layer keeps its global number l for LNS"""

    moe_ffn_hidden_size: int | None = setting(
        None, positive, null_means="= ffn_hidden_size", shapes=True, hf=HF_CONVERTER
    )
    """`moe_ffn_hidden_size`: each routed expert's MLP width (per gate/up half with SwiGLU)"""

    moe_router_topk: int = setting(2, positive, hf=HF_CONVERTER)
    """`moe_router_topk`: experts each token is sent to; at most `num_moe_experts`"""

    moe_router_score_function: str = setting(
        "softmax",
        one_of(MOE_SCORE_FUNCTIONS),
        hf_refusal="the stock MoE routers (Mixtral, Qwen2-MoE) take a softmax over the experts",
    )
    """`moe_router_score_function`: `softmax` (Mixtral, OLMoE, Qwen-MoE) or `sigmoid` (DeepSeek-V3;
    the top-k scores are renormalised to sum to 1 when k > 1)"""

    moe_router_pre_softmax: bool = setting(False, hf=HF_CONVERTER)
    """`moe_router_pre_softmax`: softmax over all experts before top-k (the chosen probabilities
    then do not sum to 1, as in OLMoE); false: softmax over the top-k logits (Mixtral's renormalised
    probabilities)"""

    moe_router_topk_scaling_factor: float | None = setting(
        None,
        positive,
        null_means="1",
        hf_refusal="the stock MoE routers do not scale the routing weights",
    )
    """`moe_router_topk_scaling_factor`: multiplies the routing weights (DeepSeek-V3's 2.5)"""

    moe_router_enable_expert_bias: bool = setting(
        False,
        shapes=True,
        hf_refusal="the stock MoE routers have no expert bias (aux-loss-free load balancing)",
    )
    """`moe_router_enable_expert_bias`: DeepSeek-V3's aux-loss-free balancing, a per-expert bias
    added to the scores for selection only, updated after each step from the tokens each expert
    received; needs `moe_router_score_function: sigmoid`"""

    moe_router_bias_update_rate: float = setting(1e-3, positive, training_only=True)
    """`moe_router_bias_update_rate`: the expert-bias step size"""

    moe_router_dtype: str | None = setting(
        None, one_of(MOE_ROUTER_DTYPES), null_means="the activations' dtype"
    )
    """`moe_router_dtype`: the router's GEMM and scores in `fp32` or `fp64`"""

    moe_router_load_balancing_type: str = setting(
        "aux_loss", one_of(MOE_LOAD_BALANCING), training_only=True, hf=HF_CONVERTER
    )
    """`moe_router_load_balancing_type`: `aux_loss` (GShard/Switch, over the micro-batch),
    `seq_aux_loss` (per sequence), `global_aux_loss` (over the data-parallel group), `sinkhorn`
    (S-BASE routing, top-1 only), `none`"""

    moe_aux_loss_coeff: float = setting(0.0, non_negative, training_only=True, hf=HF_CONVERTER)
    """`moe_aux_loss_coeff`: weight of the load-balancing loss (1e-2 is common)"""

    moe_z_loss_coeff: float | None = setting(
        None, non_negative, training_only=True, null_means="off"
    )
    """`moe_z_loss_coeff`: weight of the router z-loss (ST-MoE; 1e-3 is common)"""

    moe_per_layer_logging: bool = setting(False, training_only=True)
    """log the load-balancing and z losses and the expert load of every MoE layer too"""

    moe_token_dispatcher_type: str = setting("allgather", one_of(MOE_DISPATCHERS))
    """`moe_token_dispatcher_type`: `allgather` (megatron-core's default) or `alltoall` (the usual
    choice with expert parallelism); same function, different communication. `flex` (DeepEP /
    HybridEP kernels) is refused: it needs CUDA-only kernels not tested here"""

    moe_grouped_gemm: bool | None = setting(None, policy="machine")
    """`moe_grouped_gemm`: the experts of a rank as one grouped GEMM (Transformer Engine's
    `TEGroupedMLP`) instead of one GEMM per expert (`SequentialMLP`). Needs `transformer_engine:
    true` on CUDA (megatron-core's local backend would silently run `SequentialMLP`). null: on with
    Transformer Engine on CUDA"""

    moe_permute_fusion: bool | None = setting(None, policy="machine", training_only=True)
    """`moe_permute_fusion`: Transformer Engine's fused token permute/unpermute in the dispatcher.
    Needs Transformer Engine on CUDA. null: on with Transformer Engine on CUDA"""

    moe_shared_expert_intermediate_size: int | None = setting(
        None, positive, null_means="no shared expert", shapes=True, hf=HF_CONVERTER
    )
    """`moe_shared_expert_intermediate_size`: width of the shared expert every token passes through
    (all shared experts together, as in Qwen-MoE and DeepSeek)"""

    moe_shared_expert_gate: bool = setting(False, shapes=True, hf=HF_CONVERTER)
    """`moe_shared_expert_gate`: a sigmoid gate on the shared expert's output (Qwen2-MoE)"""

    moe_shared_expert_overlap: bool = setting(False, training_only=True)
    """`moe_shared_expert_overlap`: compute the shared expert while the dispatcher communicates;
    needs a shared expert and `moe_token_dispatcher_type: alltoall`"""

    moe_expert_capacity_factor: float | None = setting(
        None,
        positive,
        null_means="no token dropping",
        hf_refusal=(
            "the stock MoE blocks never drop tokens, megatron drops those over an expert's capacity"
        ),
    )
    """`moe_expert_capacity_factor`: each expert takes at most factor x its even share of the
    tokens; the rest are dropped (their MoE output is 0, the residual carries them)"""

    moe_token_drop_policy: str = setting("probs", one_of(MOE_DROP_POLICIES))
    """`moe_token_drop_policy`: over capacity, drop the least likely or the last tokens"""

    moe_pad_expert_input_to_capacity: bool = setting(False)
    """`moe_pad_expert_input_to_capacity`: pad every expert's input to its capacity (static shapes);
    needs `moe_expert_capacity_factor`"""

    expert_model_parallel_size: int = setting(1, positive, target="ParallelLayout.expert")
    """`expert_model_parallel_size` (EP): the experts of each MoE layer are split over EP ranks,
    which come out of the data-parallel ranks (megatron-core's expert groups: world = PP x ETP x EP
    x expert-DP). Must divide `num_moe_experts`"""

    expert_tensor_parallel_size: int | None = setting(
        None, positive, target="ParallelLayout.expert_tensor", null_means="= TP"
    )
    """`expert_tensor_parallel_size` (ETP): each expert's weights split over ETP ranks; 1 keeps
    experts whole while attention runs at TP"""
