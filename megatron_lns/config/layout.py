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
    # Mixture-of-experts layers: experts split over `expert` ranks, each expert's weights
    # over `expert_tensor` ranks (None: the tensor-parallel size, megatron's default).
    # megatron folds expert x expert_tensor x data_parallel over tensor x data x context.
    expert: int = 1
    expert_tensor: int | None = None

    def megatron_sizes(self) -> dict[str, int | None]:
        """The sizes under megatron-core's names, which ``initialize_model_parallel`` and
        ``TransformerConfig`` both take."""
        return {
            "tensor_model_parallel_size": self.tensor,
            "pipeline_model_parallel_size": self.pipeline,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline,
            "context_parallel_size": self.context,
            "expert_model_parallel_size": self.expert,
            "expert_tensor_parallel_size": self.expert_tensor,
        }

    def data_parallel(self, world_size: int) -> int:
        model_parallel = self.tensor * self.pipeline * self.context
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor}) x pipeline_model_parallel_size ({self.pipeline}) x "
                f"context_parallel_size ({self.context})"
            )
        return world_size // model_parallel

    def expert_data_parallel(self, world_size: int) -> int:
        """Replicas of each expert: megatron lays the expert groups out as
        pipeline x expert_tensor x expert x expert-data over the same ranks."""
        expert_tensor = self.tensor if self.expert_tensor is None else self.expert_tensor
        expert_model = self.pipeline * expert_tensor * self.expert
        if world_size % expert_model:
            raise ValueError(
                f"world size {world_size} is not divisible by pipeline_model_parallel_size "
                f"({self.pipeline}) x expert_tensor_parallel_size ({expert_tensor}) x "
                f"expert_model_parallel_size ({self.expert})"
            )
        return world_size // expert_model


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
