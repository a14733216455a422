"""A faithful CPU stand-in for Transformer Engine's ``LayerNormLinear`` as megatron uses it.

Like TE (read from its source, tags v2.8 and v2.10), it registers ``layer_norm_weight``
(and ``layer_norm_bias`` for LayerNorm), marks them ``sequence_parallel``, and on every
forward reads ``self.layer_norm_weight`` / ``self.layer_norm_bias`` and
``self.zero_centered_gamma`` by plain attribute access, casts the norm weight and bias to
the activation dtype (TE's ``cast_if_needed(ln_weight, activation_dtype)``), then
normalises in fp32, adding 1 to a zero-centred gamma in fp32 as TE's kernel does, and
writes the output in the activation dtype. The GEMM is megatron's
``ColumnParallelLinear``, so tensor parallelism and checkpoint sharding are real.
"""

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear


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
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = config.sequence_parallel  # as TE does

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
