"""A faithful CPU stand-in for Transformer Engine's ``LayerNormLinear`` as megatron uses it.

Like TE (read from its source, tags v2.8 and v2.10), it registers ``layer_norm_weight``
(and ``layer_norm_bias`` for LayerNorm), marks them ``sequence_parallel``, and on every
forward reads ``self.layer_norm_weight`` / ``self.layer_norm_bias`` and
``self.zero_centered_gamma`` by plain attribute access, casts the norm weight and bias to
the activation dtype (TE's ``cast_if_needed(ln_weight, activation_dtype)``), then
normalises in fp32, adding 1 to a zero-centred gamma in fp32 as TE's kernel does, and
writes the output in the activation dtype. The GEMM is megatron's
``ColumnParallelLinear``, so tensor parallelism and checkpoint sharding are real.

:class:`StandInTESpecProvider` hands these stand-ins to megatron's own TE layer spec.
"""

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes


class StandInLayerNormColumnParallelLinear(ColumnParallelLinear):
    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        gather_output,
        bias,
        skip_bias_add,
        is_expert=False,
        skip_weight_param_allocation=False,
        tp_comm_buffer_name=None,
        **kwargs,
    ):
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            gather_output=gather_output,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
        )
        self.normalization = config.normalization
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = config.layernorm_epsilon
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, dtype=config.params_dtype)
            )
        else:
            self.layer_norm_bias = None
        self._init_method = init_method
        self.reset_parameters(defer_init=self.weight.is_meta)  # TE's __init__ ends so

    def reset_parameters(self, defer_init=False):
        """TE's ``reset_parameters`` (base module + ``LayerNormLinear``, v2.8 to HEAD).

        Every parameter of this module is re-initialised in place (norm weight to
        ``float(not zero_centered_gamma)``, biases to 0, the GEMM weight by its init
        method) and re-wrapped as a fresh ``nn.Parameter``: ``requires_grad`` is True
        again and Python attributes are gone. Then the ``sequence_parallel`` and
        tensor-parallel attributes are set again. Megatron-FSDP's meta-device init calls it.
        """
        if defer_init:
            return
        with torch.no_grad():
            for name, param in list(self.named_parameters(recurse=False)):
                data = param.detach()
                if data.is_meta:
                    data = torch.empty_like(data, device="cpu")
                if name == "layer_norm_weight":
                    data.fill_(float(not self.zero_centered_gamma))
                elif name == "weight":
                    self._init_method(data)
                else:
                    data.zero_()
                setattr(self, name, torch.nn.Parameter(data))
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = self.sequence_parallel
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def forward(self, x):
        activation_dtype = x.dtype
        # Attribute reads and the cast to the activation dtype, like TE's LayerNormLinear.
        weight = self.layer_norm_weight.to(activation_dtype)
        bias = self.layer_norm_bias
        bias = None if bias is None else bias.to(activation_dtype).float()
        # The fused kernel: fp32 math, 1 added to a zero-centred gamma in fp32.
        gamma = weight.float() + 1 if self.zero_centered_gamma else weight.float()
        if self.normalization == "RMSNorm":
            normed = F.rms_norm(x.float(), x.shape[-1:], gamma, self.eps)
        else:
            normed = F.layer_norm(x.float(), x.shape[-1:], gamma, bias, self.eps)
        return super().forward(normed.to(activation_dtype))


class StandInTENorm(torch.nn.Module):
    """Where megatron's TE spec asks for ``TENorm``: fails if built, because megatron-lns
    must replace every TE norm it builds a layer with (an MoE layer's pre-MLP norm)."""

    def __init__(self, *args, **kwargs):
        raise AssertionError("megatron_lns left a TE norm (TENorm) in a layer spec")


class StandInTESpecProvider(LocalSpecProvider):
    """megatron's ``TESpecProvider`` answered with CPU stand-ins, so megatron's own
    ``get_gpt_layer_with_transformer_engine_submodules`` (dense and MoE) builds on CPU.

    As TE's provider does, it fuses the norm into the following linear
    (:class:`StandInLayerNormColumnParallelLinear`) and gives separate norms as ``TENorm``
    (:class:`StandInTENorm`). Linears without a norm are megatron's local column/row
    parallel linears and the experts megatron's ``SequentialMLP`` of them, which compute
    what TE's ``TEColumnParallelLinear`` / ``TERowParallelLinear`` (and, without grouped
    GEMM, TE's expert MLPs) compute; attention is megatron's local ``DotProductAttention``.
    """

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return StandInLayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return StandInTENorm
