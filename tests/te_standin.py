"""A faithful CPU stand-in for Transformer Engine's ``LayerNormLinear`` as megatron uses it.

Like TE, it registers ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm),
marks them ``sequence_parallel`` as TE does, honours ``zero_centered_gamma``
(``x_hat * (1 + g)``), and reads ``self.layer_norm_weight`` / ``self.layer_norm_bias``
by plain attribute access on every forward. The GEMM is megatron's
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
        weight = self.layer_norm_weight  # attribute read, like TE's LayerNormLinear
        gamma = weight + 1 if self.zero_centered_gamma else weight
        if self.normalization == "RMSNorm":
            normed = F.rms_norm(x, x.shape[-1:], gamma, self.eps)
        else:
            normed = F.layer_norm(x, x.shape[-1:], gamma, self.layer_norm_bias, self.eps)
        return super().forward(normed)
