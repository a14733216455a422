"""LNS cost on the local backend: folded LNS vs Pre-LN vs the paper's multiply-after-norm.

    .venv/bin/python benchmarks/lns_overhead.py [--device cpu|cuda] [--layers 16 ...]

Builds the three variants of the same model in one process and times full training
steps (forward, backward, optimizer) in interleaved rounds. Prints median step times
and the ratios to Pre-LN, and writes them as JSON with --output.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from megatron_lns.model.language_model import GPTModelConfig
from megatron_lns.model.norms import MultiplyAfterNorm
from megatron_lns.runtime import ParallelLayout, init_distributed
from megatron_lns.training.benchmark import compare_step_times, trainable_for_timing


def _use_multiply_after_norm(chunk: torch.nn.Module) -> torch.nn.Module:
    """Swap every layer's pre-norms for the multiply-after-norm reference, same weights."""
    for layer in chunk.decoder.layers:
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            norm = getattr(layer, name)
            reference = MultiplyAfterNorm(
                chunk.config, norm.hidden_size, norm.eps, affine=norm.affine
            )
            reference.load_state_dict(norm.state_dict())
            reference.output_scale = norm.output_scale
            setattr(layer, name, reference.to(next(chunk.parameters()).device))
    return chunk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--output", default=None, help="write results as JSON here")
    args = parser.parse_args(argv)

    device = init_distributed(ParallelLayout(), device=args.device)
    base = dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=512,
        seq_length=args.seq,
        precision=args.precision,
        output_layer_init="normal",
    )
    variants = {
        "pre_ln": trainable_for_timing(
            GPTModelConfig(norm_scaling="none", **base), ParallelLayout(), device
        ),
        "lns_folded": trainable_for_timing(
            GPTModelConfig(norm_scaling="lns", **base), ParallelLayout(), device
        ),
        "lns_multiply_after_norm": trainable_for_timing(
            GPTModelConfig(norm_scaling="lns", **base),
            ParallelLayout(),
            device,
            chunk_transform=_use_multiply_after_norm,
        ),
    }
    times = compare_step_times(
        variants,
        args.micro_batch,
        1,
        args.seq,
        512,
        device,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
    )
    reference = times["pre_ln"].median
    machine = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
        f"micro batch {args.micro_batch}, {args.precision}, {machine}"
    )
    print(f"{'variant':<26}{'median step (ms)':>18}{'vs Pre-LN':>11}")
    results = {"machine": machine, "args": vars(args), "variants": {}}
    for name, t in times.items():
        ratio = t.median / reference
        print(f"{name:<26}{t.median * 1e3:>18.1f}{ratio:>11.3f}")
        results["variants"][name] = {
            "median_s": t.median,
            "ratio_to_pre_ln": ratio,
            "samples_s": t.seconds,
        }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
