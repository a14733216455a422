"""Activations kept for backward, measured on CPU, against ``megatron-lns plan``'s count.

    .venv/bin/python benchmarks/activations_measured.py

Builds a tiny model (4 layers, hidden 64) of ``nemo_configs/tiny_cpu_demo.yaml`` at world
size 1, runs one micro-batch forward and records every tensor autograd saves for
backward (``torch.autograd.graph.saved_tensors_hooks``) while the decoder's layers run,
counting each storage once and no parameter. That is the memory one micro-batch's
activations hold at the end of its forward; ``plan`` multiplies the same per-layer
count by the micro-batches in flight. Each row is a recompute mode or attention shape.

The measurement is of megatron-core's local backend on CPU, without fused kernels: its
norms keep their normalised output beside their input, the unfused SwiGLU keeps three
more ffn-wide tensors, and the value projection keeps the whole mixed QKV tensor alive.
``plan`` counts what the fused GPU path (Transformer Engine, fused SwiGLU) keeps, so the
ratio here is the local backend's overhead, not the formula's error on a GPU; a
measurement with Transformer Engine on a GPU is the check still to do (docs/plan.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 257  # the byte tokenizer
TINY = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=128",
    "model.encoder_seq_length=32",
    "model.micro_batch_size=2",
    "model.global_batch_size=2",
]
CASES = {
    "no recompute": [],
    "selective": ["model.activations_checkpoint_granularity=selective"],
    "full, uniform, 1 layer": [
        "model.activations_checkpoint_granularity=full",
        "+model.activations_checkpoint_method=uniform",
        "+model.activations_checkpoint_num_layers=1",
    ],
    "GQA (2 groups)": ["model.num_query_groups=2"],
}


def measured_bytes(cfg) -> int:
    """Bytes of the distinct non-parameter storages saved for backward inside the decoder
    during one micro-batch's forward."""
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_lns.build import build_model_chunks, model_config, parallel_layout

    (model,) = build_model_chunks(model_config(cfg, VOCAB), parallel_layout(cfg))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = []
    saved: dict[int, int] = {}

    def enter(*_) -> None:
        inside.append(True)

    def leave(*_) -> None:
        inside.pop()

    for module in model.modules():
        if isinstance(module, TransformerBlock):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside and storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    m = cfg.model
    s, b = m.encoder_seq_length, m.micro_batch_size
    tokens = torch.randint(0, VOCAB, (b, s))
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens, positions, None, labels=tokens)
    return sum(saved.values())


def rows() -> list[tuple[str, int, int]]:
    from megatron_lns.config import validate
    from megatron_lns.planning import load_for_plan
    from megatron_lns.planning.memory import stage_estimates
    from megatron_lns.planning.shape import model_shape
    from megatron_lns.runtime import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(), device="cpu")
    results = []
    for name, overrides in CASES.items():
        cfg = load_for_plan(ROOT / "nemo_configs" / "tiny_cpu_demo.yaml", [*TINY, *overrides])
        validate(cfg, check_files=False)
        (estimate,) = stage_estimates(cfg, model_shape(cfg, VOCAB))
        results.append((name, round(estimate.activations_gb * 1e9), measured_bytes(cfg)))
    return results


def main() -> int:
    from megatron_lns.third_party_noise import quiet_third_party_noise

    quiet_third_party_noise()
    print("activations of one micro-batch, 4 layers, fp32, CPU local backend (bytes)")
    print(f"{'case':<24} {'plan':>10} {'measured':>10} {'measured/plan':>14}")
    for name, planned, measured in rows():
        print(f"{name:<24} {planned:>10} {measured:>10} {measured / planned:>14.2f}")
    print("plan's full-recompute figure includes one layer's activations while it is")
    print("recomputed in backward; the forward keeps only each layer's input.")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
