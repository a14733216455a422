"""Memory per GPU of a config, by arithmetic (not measured): the comment block that
``nemo_configs/olmo_7b_lns_20b.yaml`` and ``olmoe_1b_7b_lns.yaml`` quote.

    .venv/bin/python benchmarks/memory_per_gpu.py nemo_configs/olmo_7b_lns_20b.yaml \
        --vocab-size 50280

A thin caller of ``megatron_lns.planning`` (what ``megatron-lns plan`` prints in full; the
model of memory is documented in ``megatron_lns/planning/memory.py``).
``tests/config/test_performance.py`` and ``tests/test_memory_per_gpu.py`` check that the
YAMLs carry this output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lns.planning.memory import GB, MemoryEstimate, heaviest, stage_estimates
from megatron_lns.planning.shape import model_shape, parameter_counts

__all__ = ["GB", "MemoryEstimate", "comment_block", "estimate", "load_for_estimate", "main"]


def estimate(cfg, vocab_size: int) -> MemoryEstimate:
    """One GPU of the pipeline stage that holds the most, for the run ``cfg``."""
    return heaviest(stage_estimates(cfg, model_shape(cfg, vocab_size)))


def comment_block(cfg, vocab_size: int) -> str:
    """The YAML comment lines quoting :func:`estimate` for ``cfg``."""
    e = estimate(cfg, vocab_size)
    m = cfg.model
    moe_lines = _moe_lines(cfg, vocab_size, e)
    lines = [
        f"Memory per GPU, pipeline stage {e.stage} of {m.pipeline_model_parallel_size} "
        "(the most; megatron-lns plan, arithmetic):",
        *moe_lines[:1],
        f"  parameters on this GPU       {e.parameters / 1e9:6.2f} B",
        *moe_lines[1:],
        f"  weights                      {e.weights_gb:6.1f} GB",
        f"  gradient buffer              {e.grads_gb:6.1f} GB",
        f"  optimizer state (shard)      {e.optimizer_gb:6.1f} GB",
        f"  FP8 weight copies            {e.fp8_weight_copies_gb:6.1f} GB",
        f"  activations ({e.layer_microbatches} layer x micro-batches, mbs {m.micro_batch_size}, "
        f"seq {m.encoder_seq_length})",
        f"                               {e.activations_gb:6.1f} GB",
        f"  total                        {e.total_gb:6.1f} GB",
    ]
    return "\n".join("# " + line for line in lines)


def _moe_lines(cfg, vocab_size: int, e: MemoryEstimate) -> list[str]:
    """For MoE configs: the model's total vs active parameters, the experts' share here."""
    m = cfg.model
    if not m.num_moe_experts:
        return []
    counts = parameter_counts(model_shape(cfg, vocab_size), m.tensor_model_parallel_size)
    ep = m.expert_model_parallel_size
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    return [
        f"  model: {counts.total / 1e9:.2f} B parameters, "
        f"{counts.active / 1e9:.2f} B active per token",
        f"    of which routed experts    {e.expert_parameters / 1e9:6.2f} B "
        f"({m.num_moe_experts // ep} of {m.num_moe_experts} per layer: EP {ep}, ETP {etp})",
    ]


def load_for_estimate(path: Path, overrides: list[str] | None = None):
    """The config with its data and tokenizer placeholders filled (they cost no memory)."""
    from megatron_lns.planning import load_for_plan

    return load_for_plan(path, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*", help="key=value, as for megatron-lns train")
    parser.add_argument("--vocab-size", type=int, required=True, help="the tokenizer's size")
    args = parser.parse_intermixed_args(argv)
    print(comment_block(load_for_estimate(args.config, args.overrides), args.vocab_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
