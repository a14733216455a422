"""Activations kept for backward, measured on CPU, against ``megatron-lns plan``'s count.

    .venv/bin/python benchmarks/activations_measured.py

Runs one training step's forward and backward through megatron's pipeline schedules
(``training.step.forward_backward``) on two CPU ranks, for a tiny model (4 layers, hidden
64, fp32) of ``nemo_configs/tiny_cpu_demo.yaml`` at several layouts and recompute modes,
and records every tensor autograd saves for backward inside the transformer layers
(``torch.autograd.graph.saved_tensors_hooks``): each storage is counted once, parameters
never, and a storage stops counting when autograd frees the last thing that saved it. The
peak of those bytes on each rank is the memory its activations hold at the worst moment
of the step; ``plan`` predicts it for that rank's pipeline stage (``activations_gb``).

The CPU runs megatron-core's local backend (``transformer_engine: false``), whose terms
``plan`` counts as such (``megatron_lns/planning/memory.py``); the fused Transformer
Engine path needs a GPU to measure. ``tests/planning/test_activations_measured.py`` runs
the same cases and holds each within :data:`TOLERANCE`.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from tiny_model import TINY_WIDTH

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 257  # the byte tokenizer
WORLD_SIZE = 2
# What plan does not count (the rotary cos/sin tables, the norms' inverse RMS, the causal
# mask: memory.py) is 2-5% of this tiny model's layer; anything else off fails.
TOLERANCE = 0.07
TINY = [
    "trainer.devices=2",
    "model.num_layers=4",
    *TINY_WIDTH,
]
FULL_RECOMPUTE = [
    "model.activations_checkpoint_granularity=full",
    "+model.activations_checkpoint_method=uniform",
    "+model.activations_checkpoint_num_layers=1",
]
PP2 = ["model.pipeline_model_parallel_size=2", "model.global_batch_size=8"]  # 4 micro-batches
CASES = {
    "DP 2, no recompute": [],
    "DP 2, selective recompute": ["model.activations_checkpoint_granularity=selective"],
    "DP 2, full recompute": FULL_RECOMPUTE,
    "DP 2, GQA (2 groups)": ["model.num_query_groups=2"],
    "TP 2": ["model.tensor_model_parallel_size=2"],
    "TP 2 + SP": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "PP 2, 1F1B": PP2,
    "PP 2, 1F1B, full recompute": [*PP2, *FULL_RECOMPUTE],
    "PP 2 x VP 2, interleaved": [
        *PP2,
        "model.num_layers=8",
        "model.virtual_pipeline_model_parallel_size=2",
    ],
}


def case_config(name: str):
    """The validated config of the case ``name``."""
    from megatron_lns.config import validate
    from megatron_lns.planning import load_for_plan

    cfg = load_for_plan(ROOT / "nemo_configs" / "tiny_cpu_demo.yaml", [*TINY, *CASES[name]])
    validate(cfg, check_files=False, world_size=WORLD_SIZE)
    return cfg


class _Saved:
    """What autograd keeps in place of a saved tensor: freed with the graph that holds it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor) -> None:
        self.tensor = tensor


def peak_saved_bytes(cfg) -> tuple[int, int]:
    """(this rank's pipeline stage, the most bytes of non-parameter storages saved for
    backward inside its transformer layers at any moment of one step of ``cfg``)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_lns.runtime import init_distributed
    from megatron_lns.training.build import (
        build_model_chunks,
        model_config,
        parallel_layout,
        wrap_with_ddp,
    )
    from megatron_lns.training.step import forward_backward, make_batch

    layout = parallel_layout(cfg)
    device = init_distributed(layout, device="cpu", seed=1)
    chunks = wrap_with_ddp(build_model_chunks(model_config(cfg, VOCAB), layout, device))
    parameters = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}

    # Counted: inside a layer (also when full recomputation reruns it in backward) and the
    # block's own saves (recomputation's checkpointed inputs), not the final norm's.
    counting: list[bool] = []

    def enter(counted: bool):
        return lambda *_: counting.append(counted)

    def leave(*_) -> None:
        counting.pop()

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerBlock | TransformerLayer):
                module.register_forward_pre_hook(enter(True))
                module.register_forward_hook(leave)
            if isinstance(module, TransformerBlock) and module.final_layernorm is not None:
                module.final_layernorm.register_forward_pre_hook(enter(False))
                module.final_layernorm.register_forward_hook(leave)

    holders: dict[int, int] = {}  # storage address -> saves still alive
    bytes_now = [0, 0]  # live, peak

    def release(address: int, nbytes: int) -> None:
        holders[address] -= 1
        if not holders[address]:
            del holders[address]
            bytes_now[0] -= nbytes

    def pack(tensor):
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if not (counting and counting[-1]) or address in parameters:
            return tensor
        if address not in holders:
            holders[address] = 0
            bytes_now[0] += storage.nbytes()
            bytes_now[1] = max(bytes_now)
        holders[address] += 1
        saved = _Saved(tensor)
        weakref.finalize(saved, release, address, storage.nbytes())
        return saved

    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    m = cfg.model
    data_parallel = parallel_state.get_data_parallel_world_size()
    count = m.global_batch_size // (m.micro_batch_size * data_parallel)
    generator = torch.Generator().manual_seed(0)
    shape = (m.micro_batch_size, m.encoder_seq_length + 1)
    batches = [
        make_batch(torch.randint(0, VOCAB, shape, generator=generator)) for _ in range(count)
    ]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        forward_backward(chunks, batches)
    if holders:
        raise AssertionError(f"{len(holders)} saved storages outlived the step's backward")
    return parallel_state.get_pipeline_model_parallel_rank(), bytes_now[1]


def measure(names: list[str]) -> dict[str, tuple[int, int, int]]:
    """On this rank, each case's (stage, measured bytes, plan's bytes for that stage)."""
    from megatron_lns.base.third_party_noise import quiet_third_party_noise
    from megatron_lns.planning.memory import stage_estimates
    from megatron_lns.planning.shape import model_shape

    quiet_third_party_noise()
    results = {}
    for name in names:
        cfg = case_config(name)
        stage, measured = peak_saved_bytes(cfg)
        planned = stage_estimates(cfg, model_shape(cfg, VOCAB))[stage].activations_gb * 1e9
        results[name] = (stage, measured, round(planned))
    return results


def _measure_and_record(out_dir: str, names: list[str]) -> None:
    with open(Path(out_dir) / f"rank{os.environ['RANK']}.pkl", "wb") as f:
        pickle.dump(measure(names), f)


def main() -> int:
    from megatron_lns.runtime import spawn_local

    with tempfile.TemporaryDirectory() as out:
        spawn_local(_measure_and_record, WORLD_SIZE, out, list(CASES))
        ranks = [pickle.loads((Path(out) / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    print("activations kept for backward at the step's peak, 4 layers, fp32, CPU local backend")
    print(f"{'case':<28} {'rank':>4} {'stage':>5} {'plan':>10} {'measured':>10} {'ratio':>6}")
    for name in CASES:
        for rank, results in enumerate(ranks):
            stage, measured, planned = results[name]
            print(
                f"{name:<28} {rank:>4} {stage:>5} {planned:>10} {measured:>10} "
                f"{measured / planned:>6.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
