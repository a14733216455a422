"""The GPUs ``plan`` knows: memory and dense (no 2:4 sparsity) tensor-core peaks.

NVIDIA's datasheets print the tensor-core peaks *with* 2:4 structured sparsity and mark
them with an asterisk ("Shown with sparsity. Specifications are one-half lower without
sparsity"); every peak below is the dense figure, half the printed one. Memory is the
datasheet's capacity in GB (10^9 bytes), which is what the memory estimate counts in.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lns.base.errors import UserError


class UnknownGPUError(UserError):
    pass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bf16_tflops: float  # dense BF16 tensor-core peak
    fp8_tflops: float | None  # dense FP8 tensor-core peak; None: no FP8 tensor cores
    nvlink_gb_per_s: float  # NVLink bandwidth one way (half the bidirectional figure)


# Where each value was read: the NVIDIA datasheets themselves were not reachable from the
# machine this table was written on, so each comment names the copy of the datasheet's
# figures that was read, and the datasheet it reproduces. NVLink (one way): H100/H200
# NVLink 4, 900 GB/s bidirectional (the same H100 page; the H200 pages above); B200
# NVLink 5, 2 x 900 GB/s (glennklockwood.com B200 page); A100 NVLink 3, 300 + 300 GB/s
# (glennklockwood.com A100 page).
GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column, as reproduced (with its
    # footnote "Shown with sparsity. Specifications 1/2 lower without sparsity") at
    # archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html: GPU memory 80 GB, BF16 Tensor
    # Core 1,979* TFLOPS, FP8 Tensor Core 3,958* TFLOPS; dense 989.5 and 1,979 (also
    # glennklockwood.com/garden/processors/h100, citing the datasheet: 989.4 / 3,957.8
    # sparse FP8).
    "H100": GPU("H100 80GB SXM", 80, 989.5, 1979, 450),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM": GPU memory 141 GB HBM3e, FP8
    # Tensor Core 3,958* TFLOPS (with sparsity), the H100 SXM's compute (same GH100 die),
    # as reproduced at lzwjava.github.io/nvidia-h200-gpu-specs-en and
    # ai-hpc.github.io (8x-H200 page: 141 GB, ~1,979 BF16 / ~3,958 FP8 with sparsity).
    # Dense 989.5 BF16 and 1,979 FP8.
    "H200": GPU("H200 141GB SXM", 141, 989.5, 1979, 450),
    # NVIDIA HGX B200 (8 GPUs at 1,000 W): per GPU FP8 9 PFLOPS and BF16 4.5 PFLOPS with
    # sparsity, dense 4,500 and 2,250, as tabulated at glennklockwood.com/garden/processors/
    # B200 ("HGX variant", citing NVIDIA's Blackwell datasheet); docs.vultr.com's HGX B200
    # overview gives "FP8 Compute ~4.5 PFLOPS" (dense) and nvidia-smi's 179 GB. Memory 180 GB:
    # NVIDIA quotes 1,440 GB for an 8-GPU HGX/DGX B200 board; that board figure was NOT read
    # from an NVIDIA page here (third-party pages quote 180, 179 or 192 GB): check it.
    "B200": GPU("B200 180GB (HGX)", 180, 2250, 4500, 900),
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web
    # .pdf), as tabulated at glennklockwood.com/garden/processors/A100 and
    # upb-pc2.atlassian.net (A100 40GB): BF16 Tensor Core 312 TFLOPS dense (624 sparse),
    # 40 GB HBM2 / 80 GB HBM2e. No FP8 tensor cores (Ampere; Transformer Engine's FP8
    # needs compute capability 8.9+, its support matrix at nvidia.github.io/TransformerEngine).
    "A100-40GB": GPU("A100 40GB SXM", 40, 312, None, 300),
    "A100-80GB": GPU("A100 80GB SXM", 80, 312, None, 300),
}
DEFAULT_GPU = "H100"
ALIASES = {"A100": "A100-80GB", "A100-80": "A100-80GB", "A100-40": "A100-40GB"}


def gpu_named(name: str) -> GPU:
    """The table's entry for ``name`` (case-insensitive; ``A100`` is the 80 GB one)."""
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        known = ", ".join(GPUS)
        raise UnknownGPUError(f"--gpu {name}: not in the GPU table (one of {known})")
    return GPUS[key]
