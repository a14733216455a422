"""The parallel arithmetic of a run: world size, data-parallel size, micro-batches per step.

Each rule lives here once, for the config checks (before any process starts), the
launchers and the trainer alike. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


def world_size(num_nodes: int, devices_per_node: int) -> int:
    """Processes in the run: one per device on every node."""
    return num_nodes * devices_per_node


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel sizes; data parallel is whatever the world size leaves
    (world = tensor x pipeline x context x data, megatron's rank order)."""

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    sequence_parallel: bool = False
    context: int = 1
    # NCCL SHARP for the data-parallel collectives (megatron's use_sharp; NCCL only).
    sharp: bool = False

    def data_parallel(self, world_size: int) -> int:
        model_parallel = self.tensor * self.pipeline * self.context
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor}) x pipeline_model_parallel_size ({self.pipeline}) x "
                f"context_parallel_size ({self.context})"
            )
        return world_size // model_parallel


def micro_batches_per_step(
    global_batch_size: int, micro_batch_size: int, data_parallel: int
) -> int:
    """Gradient accumulation: the micro-batches each data-parallel rank runs per step."""
    per_micro_batch = micro_batch_size * data_parallel
    if global_batch_size % per_micro_batch:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by micro batch size x "
            f"data-parallel size ({micro_batch_size} x {data_parallel})"
        )
    return global_batch_size // per_micro_batch
