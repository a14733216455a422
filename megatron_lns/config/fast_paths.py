"""Which of megatron-core's fused kernels and communication overlaps a run uses.

One decision, in one function: :func:`resolve_fast_paths` takes what the user asked for
(:class:`FastPathRequest`, ``None`` = "not set") and what the machine offers
(:class:`MachineFacts`) and returns the settings megatron-core is given
(:class:`FastPaths`). An unset switch is on where megatron-core and the installed kernels
can run it (on CUDA) and off elsewhere (on CPU); a switch the user set always wins, and
one that cannot run on this machine is refused with a message naming its key. Tests
simulate a CUDA machine by passing facts, so the GPU defaults are checked on CPU.

What each switch needs is read from megatron-core 0.19:

* ``bias_activation_fusion``, ``bias_dropout_fusion``, ``cross_entropy_loss_fusion``
  (``native``): TorchScript-fused elementwise code, which runs on CPU and CUDA alike;
  megatron-core refuses bias-activation fusion for GELU without a bias.
* ``masked_softmax_fusion``: the local backend's ``FusedScaleMaskSoftmax`` calls the
  ``scaled_*_masked_softmax_cuda`` extensions (Apex) for half-precision CUDA inputs and
  fails with an ImportError when they are missing; Transformer Engine's attention fuses
  its own softmax and does not read the switch.
* ``apply_rope_fusion``: Transformer Engine's fused RoPE (megatron-core refuses the
  switch without it).
* ``gradient_accumulation_fusion``: the ``fused_weight_gradient_mlp_cuda`` extension
  (Apex), which megatron-core's ``ColumnParallelLinear`` (the output layer, on both
  backends) requires once the switch is on.
* ``attention_backend``: Transformer Engine's flash / cuDNN fused attention.
* ``overlap_grad_reduce`` / ``overlap_param_gather``: megatron DDP's bucketed
  asynchronous collectives; the parameter all-gather only exists with the distributed
  optimizer.
* ``batch_p2p_comm``: batched pipeline send/receive, wrong on gloo (``runtime.uses_gloo``)
  once there is a pipeline; without one there is nothing to send.
* ``moe_grouped_gemm``: Transformer Engine's grouped GEMM for the experts
  (``TEGroupedMLP``); megatron-core's local backend ignores the switch.
* ``moe_permute_fusion``: Transformer Engine's fused token permutation (TE >= 2.1, below
  the ``te`` extra's floor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from megatron_lns.base.errors import UserError

AttentionBackend = Literal["auto", "flash", "fused"]
# The Apex CUDA extensions megatron-core imports by these names.
SOFTMAX_EXTENSIONS = (
    "scaled_upper_triang_masked_softmax_cuda",
    "scaled_masked_softmax_cuda",
    "scaled_softmax_cuda",
)
WGRAD_EXTENSION = "fused_weight_gradient_mlp_cuda"
# The MoE switches, each Transformer Engine's kernel for the experts.
MOE_KERNELS = {
    "moe_grouped_gemm": "grouped GEMM, TEGroupedMLP",
    "moe_permute_fusion": "fused token permutation",
}


class FastPathError(UserError, ValueError):
    """A requested kernel or overlap that this machine or configuration cannot run."""


@dataclass(frozen=True)
class MachineFacts:
    """What the machine offers: CUDA, Transformer Engine, Apex's fused CUDA kernels."""

    cuda: bool
    transformer_engine: bool = False
    softmax_kernels: bool = False
    wgrad_accumulation_kernel: bool = False


@dataclass(frozen=True)
class FastPathRequest:
    """The user's switches (``None``: not set) and the model facts they depend on."""

    bias_activation_fusion: bool | None = None
    bias_dropout_add_fusion: bool | None = None
    masked_softmax_fusion: bool | None = None
    apply_rope_fusion: bool | None = None
    gradient_accumulation_fusion: bool | None = None
    cross_entropy_loss_fusion: bool | None = None
    use_flash_attention: bool | None = None
    overlap_grad_sync: bool | None = None
    overlap_param_sync: bool | None = None
    bucket_cap_mb: float | None = None
    batch_p2p_comm: bool | None = None
    overlap_p2p_comm: bool = False
    moe_grouped_gemm: bool | None = None
    moe_permute_fusion: bool | None = None
    # The model and run the switches apply to.
    pipeline_parallel: bool = False
    transformer_engine: bool = False
    rope: bool = True
    gelu_without_bias: bool = False
    distributed_optimizer: bool = False
    moe: bool = False


@dataclass(frozen=True)
class FastPaths:
    """The resolved settings, named as megatron-core names them."""

    bias_activation_fusion: bool
    bias_dropout_fusion: bool
    masked_softmax_fusion: bool
    apply_rope_fusion: bool
    gradient_accumulation_fusion: bool
    cross_entropy_loss_fusion: bool
    attention_backend: AttentionBackend
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    batch_p2p_comm: bool
    overlap_p2p_comm: bool
    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False

    def model_fields(self) -> dict:
        """The settings that are fields of the model config (``GPTModelConfig`` and
        megatron's ``TransformerConfig`` alike): all but the overlaps of DDP, and
        ``overlap_p2p_comm``, which is the user's setting as the model has it already."""
        not_model = ("overlap_grad_reduce", "overlap_param_gather", "overlap_p2p_comm")
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in not_model}


def _choose(
    key: str, requested: bool | None, default: bool, runs: bool = True, why_not: str = ""
) -> bool:
    """``requested`` if set (refused by ``key`` when it cannot ``run`` here), else
    ``default`` (which is only ever on where it runs)."""
    if requested is None:
        return default and runs
    if requested and not runs:
        raise FastPathError(f"{key}=true {why_not}")
    return requested


def resolve_fast_paths(request: FastPathRequest, facts: MachineFacts) -> FastPaths:
    """megatron-core's fusion, attention and overlap settings for this run (module doc)."""
    r, cuda = request, facts.cuda
    if r.bias_activation_fusion and r.gelu_without_bias:
        raise FastPathError(
            "model.bias_activation_fusion=true needs model.bias=true with "
            "model.activation=gelu (megatron-core fuses the bias into GELU)"
        )
    bias_activation = _choose(
        "model.bias_activation_fusion", r.bias_activation_fusion, cuda and not r.gelu_without_bias
    )
    if r.transformer_engine:
        # TE's attention fuses its own softmax; megatron-core's switch is not read there.
        softmax = bool(r.masked_softmax_fusion)
    else:
        softmax = _choose(
            "model.masked_softmax_fusion",
            r.masked_softmax_fusion,
            default=True,
            runs=facts.softmax_kernels,
            why_not="needs Apex's fused softmax CUDA kernels (scaled_masked_softmax_cuda) "
            "on a CUDA GPU",
        )
    te_here = facts.transformer_engine and r.transformer_engine
    if r.apply_rope_fusion and not r.rope:
        raise FastPathError("model.apply_rope_fusion=true needs model.position_embedding_type=rope")
    rope = _choose(
        "model.apply_rope_fusion",
        r.apply_rope_fusion,
        default=r.rope,
        runs=te_here,
        why_not="needs Transformer Engine's fused RoPE (model.transformer_engine=true on CUDA)",
    )
    wgrad = _choose(
        "model.gradient_accumulation_fusion",
        r.gradient_accumulation_fusion,
        default=True,
        runs=facts.wgrad_accumulation_kernel,
        why_not="needs Apex's fused_weight_gradient_mlp_cuda kernel on a CUDA GPU "
        "(megatron-core's output layer calls it on either backend)",
    )
    if r.use_flash_attention and not te_here:
        raise FastPathError(
            "model.use_flash_attention=true needs model.transformer_engine=true on CUDA: the "
            "local backend's attention is megatron-core's unfused DotProductAttention"
        )
    attention: AttentionBackend = "auto"
    if r.transformer_engine and r.use_flash_attention is not None:
        attention = "flash" if r.use_flash_attention else "fused"
    overlap_grad = _choose("model.optim.overlap_grad_sync", r.overlap_grad_sync, cuda)
    if r.overlap_param_sync and not r.distributed_optimizer:
        raise FastPathError(
            "model.optim.overlap_param_sync=true needs model.optim.name=distributed_fused_adam "
            "(only the distributed optimizer all-gathers parameters)"
        )
    overlap_param = _choose(
        "model.optim.overlap_param_sync",
        r.overlap_param_sync,
        cuda and r.distributed_optimizer and overlap_grad,
    )
    if overlap_param and not overlap_grad:
        raise FastPathError(
            "model.optim.overlap_param_sync=true needs model.optim.overlap_grad_sync=true "
            "(megatron DDP overlaps the all-gather with the bucketed reduce-scatter)"
        )
    if r.bucket_cap_mb is not None and not overlap_grad:
        raise FastPathError(
            f"model.optim.bucket_cap_mb={r.bucket_cap_mb} needs "
            "model.optim.overlap_grad_sync=true: without overlap megatron DDP reduces all "
            "gradients in one bucket"
        )
    if r.batch_p2p_comm and r.overlap_p2p_comm:
        raise FastPathError(
            "model.batch_p2p_comm=true and model.overlap_p2p_comm=true cannot both be on "
            "(megatron-core overlaps unbatched pipeline send/receive only)"
        )
    batch_p2p = _choose(
        "model.batch_p2p_comm",
        r.batch_p2p_comm,
        default=not r.overlap_p2p_comm,
        runs=cuda or not r.pipeline_parallel,
        why_not="is wrong on gloo (CPU): batched sends and receives between the same two "
        "ranks can be matched out of order",
    )
    moe_kernels = {}
    for key, kernel in MOE_KERNELS.items():
        if getattr(r, key) and not r.moe:
            raise FastPathError(
                f"model.{key}=true needs a mixture-of-experts model (model.num_moe_experts)"
            )
        moe_kernels[key] = _choose(
            f"model.{key}",
            getattr(r, key),
            default=r.moe,
            runs=te_here,
            why_not=f"needs model.transformer_engine=true on CUDA (Transformer Engine's {kernel})",
        )
    return FastPaths(
        bias_activation_fusion=bias_activation,
        bias_dropout_fusion=_choose(
            "model.bias_dropout_add_fusion", r.bias_dropout_add_fusion, cuda
        ),
        masked_softmax_fusion=softmax,
        apply_rope_fusion=rope,
        gradient_accumulation_fusion=wgrad,
        cross_entropy_loss_fusion=_choose(
            "model.cross_entropy_loss_fusion", r.cross_entropy_loss_fusion, cuda
        ),
        attention_backend=attention,
        overlap_grad_reduce=overlap_grad,
        overlap_param_gather=overlap_param,
        batch_p2p_comm=batch_p2p,
        overlap_p2p_comm=r.overlap_p2p_comm,
        **moe_kernels,
    )
