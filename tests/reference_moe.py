"""An independent plain-PyTorch mixture-of-experts MLP and LLaMA-with-MoE, for checking
megatron-lns's MoE layers. No megatron imports: the definitions below are written from the
papers and from megatron-core's documented behaviour (its docstrings and formulas), not
from its code paths (no permutation, dispatcher or fused kernels here: every token is a
weighted sum over a dense routing matrix).

Routing of one token with router logits ``z = x @ W_r^T`` (``E`` experts, top ``k``):

* ``softmax`` (default): choose the ``k`` largest logits, weights = softmax over those ``k``
  logits only (renormalised among the chosen);
* ``softmax`` with ``pre_softmax``: ``p = softmax(z)`` over all experts, choose the ``k``
  largest ``p``, weights = those ``p`` as they are (they sum to less than 1);
* ``sigmoid``: ``s = sigmoid(z)``, choose the ``k`` largest ``s``, weights = the chosen ``s``
  divided by their sum when ``k > 1`` (DeepSeek-V3's normalisation), the bare ``s`` when
  ``k = 1``;
* then every weight times ``topk_scaling_factor`` if one is given.

megatron-core computes these scores in fp32 whatever the logits' dtype ("Logits are
converted to fp32 for score functions", ``moe_utils.topk_routing_with_score_function``), so
``score_dtype`` defaults to fp32; everything else here runs in the model's dtype.

MoE output: ``sum over chosen e of weight_e * SwiGLU_e(x)``, plus a shared expert
``SwiGLU_s(x)`` (times ``sigmoid(x @ g)`` with megatron's ``moe_shared_expert_gate``) when
configured. The router, the experts and the shared expert all read the same input: the
pre-MLP norm's output, which LNS scales by ``1/sqrt(l)``.

Losses (per MoE layer, over the ``T`` tokens of the batch):

* load balancing (Switch Transformer, megatron's ``aux_loss``):
  ``coeff * E * sum_i f_i * P_i`` with ``f_i`` the fraction of the ``T * k`` choices that
  went to expert ``i`` and ``P_i`` the mean over tokens of expert ``i``'s score, where the
  scores are ``softmax(z)`` (softmax router) or ``sigmoid(z)`` normalised over all ``E``
  experts (sigmoid router), in fp32, and the choices are the top ``k`` of those scores;
* z-loss (ST-MoE): ``coeff * mean over tokens of logsumexp(z)^2``, in the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from reference_llama import ReferenceLlama
from torch import nn


def moe_layer_pattern(moe_layer_freq: int | list[int], num_layers: int) -> list[bool]:
    """Which layers are MoE: every ``N``-th from the first for an int, else the 0/1 list."""
    if isinstance(moe_layer_freq, int):
        return [i % moe_layer_freq == 0 for i in range(num_layers)]
    assert len(moe_layer_freq) == num_layers
    return [bool(x) for x in moe_layer_freq]


def routing_weights(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    topk_scaling_factor: float | None = None,
    score_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[tokens, experts]`` combination weights: zero for experts a token did not choose."""
    z = logits.to(score_dtype)
    if score_function == "softmax" and not pre_softmax:
        chosen_logits, chosen = z.topk(topk, dim=-1)
        weights = chosen_logits.softmax(dim=-1)
    elif score_function == "softmax":
        weights, chosen = z.softmax(dim=-1).topk(topk, dim=-1)
    elif score_function == "sigmoid":
        weights, chosen = z.sigmoid().topk(topk, dim=-1)
        if topk > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"unknown score function {score_function!r}")
    if topk_scaling_factor:
        weights = weights * topk_scaling_factor
    dense = torch.zeros_like(z).scatter(-1, chosen, weights)
    return dense.to(logits.dtype)


def load_balancing_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    score_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Switch Transformer's ``E * sum_i f_i * P_i`` (without the coefficient)."""
    tokens, experts = logits.shape
    z = logits.to(score_dtype)
    if score_function == "softmax":
        scores = z.softmax(dim=-1)
    else:
        scores = z.sigmoid()
        scores = scores / scores.sum(dim=-1, keepdim=True)
    chosen = scores.topk(topk, dim=-1).indices
    choices_per_expert = F.one_hot(chosen, experts).sum(dim=(0, 1)).to(scores.dtype)
    fraction_of_choices = choices_per_expert / (tokens * topk)
    mean_score = scores.mean(dim=0)
    return experts * (fraction_of_choices * mean_score).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (without the coefficient)."""
    return logits.logsumexp(dim=-1).square().mean()


class ReferenceMoELlama(ReferenceLlama):
    """:class:`ReferenceLlama` whose MLP is an MoE in the layers ``moe_layer_freq`` picks.

    Parameters carry megatron's names (``mlp.router.weight``,
    ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``,
    ``mlp.shared_experts.linear_fc{1,2}.weight``, ``mlp.shared_experts.gate_weight``) so a
    megatron state dict loads by name. After a forward, ``load_balancing_losses`` and
    ``z_losses`` hold each MoE layer's losses without coefficients (keyed by the global
    1-based layer number) and ``aux_loss`` their sum with the coefficients: the term
    megatron adds to the gradient of the main loss.
    """

    def __init__(
        self,
        *args,
        num_experts: int,
        moe_layer_freq: int | list[int] = 1,
        topk: int = 2,
        moe_ffn_hidden_size: int | None = None,
        shared_expert_size: int | None = None,
        shared_expert_gate: bool = False,
        score_function: str = "softmax",
        pre_softmax: bool = False,
        topk_scaling_factor: float | None = None,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float | None = None,
        **kwargs,
    ):
        num_layers = kwargs.get("num_layers", args[0] if args else None)
        self.is_moe = moe_layer_pattern(moe_layer_freq, num_layers)
        self.num_experts, self.topk = num_experts, topk
        self.moe_ffn_hidden_size = moe_ffn_hidden_size
        self.shared_expert_size, self.shared_expert_gate = shared_expert_size, shared_expert_gate
        self.score_function, self.pre_softmax = score_function, pre_softmax
        self.topk_scaling_factor = topk_scaling_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        super().__init__(*args, **kwargs)

    def _mlp_parameters(self, i: int, hidden_size: int, ffn_hidden_size: int) -> dict:
        if not self.is_moe[i]:
            return super()._mlp_parameters(i, hidden_size, ffn_hidden_size)
        pre = f"decoder.layers.{i}.mlp."
        expert_ffn = self.moe_ffn_hidden_size or ffn_hidden_size
        p = {pre + "router.weight": nn.Parameter(torch.empty(self.num_experts, hidden_size))}
        for e in range(self.num_experts):
            expert = pre + f"experts.local_experts.{e}."
            p[expert + "linear_fc1.weight"] = nn.Parameter(torch.empty(2 * expert_ffn, hidden_size))
            p[expert + "linear_fc2.weight"] = nn.Parameter(torch.empty(hidden_size, expert_ffn))
        if self.shared_expert_size:
            shared, size = pre + "shared_experts.", self.shared_expert_size
            p[shared + "linear_fc1.weight"] = nn.Parameter(torch.empty(2 * size, hidden_size))
            p[shared + "linear_fc2.weight"] = nn.Parameter(torch.empty(hidden_size, size))
            if self.shared_expert_gate:
                p[shared + "gate_weight"] = nn.Parameter(torch.empty(1, hidden_size))
        return p

    def _mlp(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if not self.is_moe[i]:
            return super()._mlp(x, i)
        pre = f"decoder.layers.{i}.mlp."
        tokens = x.reshape(-1, x.shape[-1])
        logits = tokens @ self.p[pre + "router.weight"].T
        self.router_logits[i + 1] = logits
        self.load_balancing_losses[i + 1] = load_balancing_loss(
            logits, self.topk, self.score_function
        )
        self.z_losses[i + 1] = z_loss(logits)
        weights = routing_weights(
            logits, self.topk, self.score_function, self.pre_softmax, self.topk_scaling_factor
        )
        out = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            expert = self._swiglu(tokens, pre + f"experts.local_experts.{e}.")
            out = out + weights[:, e : e + 1] * expert
        if self.shared_expert_size:
            shared = self._swiglu(tokens, pre + "shared_experts.")
            if self.shared_expert_gate:
                shared = shared * torch.sigmoid(
                    tokens @ self.p[pre + "shared_experts.gate_weight"].T
                )
            out = out + shared
        return out.view_as(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.router_logits: dict[int, torch.Tensor] = {}
        self.load_balancing_losses: dict[int, torch.Tensor] = {}
        self.z_losses: dict[int, torch.Tensor] = {}
        logits = super().forward(tokens)
        aux = sum(self.load_balancing_losses.values()) * self.aux_loss_coeff
        if self.z_loss_coeff is not None:
            aux = aux + sum(self.z_losses.values()) * self.z_loss_coeff
        self.aux_loss = aux
        return logits
