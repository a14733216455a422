"""Model FLOPs per token and per step, and the time they take at a stated MFU.

FLOPs are Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py)
for a causal decoder with unpacked sequences, counted independently here and checked
against it (``tests/planning/test_throughput.py``). Per token, forward and backward:

    6 x [ attention sublayers x (h(q + 2kv) + q h)          QKV and output projections
        + dense MLPs x (glu + 1) h ffn                      fc1 (x2 with SwiGLU) and fc2
        + MoE sublayers x (glu + 1) h (topk expert_ffn + shared_ffn)
        + h vocab ]                                         the logits
    + 6 x attention sublayers x q s                         QK^T and attention x V, halved
                                                            by the causal mask

The 6 is 2 FLOPs per multiply-add times 3 GEMMs per weight (forward, data gradient,
weight gradient): the PaLM paper's 6N + attention rule (Chowdhery et al. 2022, appendix
B) with N the active GEMM weights. Model FLOPs: recomputation's extra forward is not
counted, as MFU defines it; nor are the router's GEMM (h x experts, small), the norms
and the elementwise work.

Time per step = FLOPs per step / (GPUs x dense BF16 peak x MFU). The default MFU is
Megatron-LM's published figure for its smallest model, measured on H100 in BF16: "MFU
increases from 41% for the smallest model considered [2B parameters] to 47-48% for the
largest" (Megatron-LM README, "Performance Benchmarking", weak scaling, sequence 4096).
Smaller models and MoE layers usually reach less: pass ``--mfu`` with a measured value.
FP8 runs are timed against the BF16 peak too (MFU is quoted against it).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.planning.gpus import GPU
from megatron_lns.planning.shape import ModelShape, total

DEFAULT_MFU = 0.41
MFU_SOURCE = (
    "Megatron-LM README, Performance Benchmarking: 41% MFU for its smallest (2B) GPT model "
    "on H100, BF16, seq 4096"
)


@dataclass(frozen=True)
class Throughput:
    flops_per_token: float
    flops_per_step: float
    mfu: float
    step_seconds: float
    tokens_per_second_per_gpu: float
    max_steps: int
    total_seconds: float
    gpu_hours: float


def flops_per_token(shape: ModelShape, seq_length: int) -> float:
    """Model FLOPs (forward + backward) per token of a full-length sequence."""
    h, q, kv = shape.hidden, shape.query, shape.key_value
    attention = shape.attention_units
    dense = total(shape.unit_counts, lambda u: u.dense_mlps)
    moe = total(shape.unit_counts, lambda u: u.moe_mlps)
    gemm = attention * (h * (q + 2 * kv) + q * h)
    gemm += dense * (shape.glu + 1) * h * shape.ffn
    gemm += moe * (shape.glu + 1) * h * (shape.moe_topk * shape.expert_ffn + shape.shared_ffn)
    gemm += h * shape.vocab
    return 6.0 * gemm + 6.0 * attention * q * seq_length


def throughput(
    cfg: ExperimentConfig, shape: ModelShape, gpu: GPU, gpus: int, mfu: float = DEFAULT_MFU
) -> Throughput:
    m = cfg.model
    tokens_per_step = m.global_batch_size * m.encoder_seq_length
    per_token = flops_per_token(shape, m.encoder_seq_length)
    per_step = per_token * tokens_per_step
    step_seconds = per_step / (gpus * gpu.bf16_tflops * 1e12 * mfu)
    total = step_seconds * cfg.trainer.max_steps
    return Throughput(
        flops_per_token=per_token,
        flops_per_step=per_step,
        mfu=mfu,
        step_seconds=step_seconds,
        tokens_per_second_per_gpu=tokens_per_step / step_seconds / gpus,
        max_steps=cfg.trainer.max_steps,
        total_seconds=total,
        gpu_hours=total * gpus / 3600,
    )
