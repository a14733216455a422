"""GPU check for one machine with one GPU: a few minutes, one results file.

    .venv/bin/python benchmarks/gpu_check.py [--output-dir benchmarks/results]

1. Runs the GPU-marked tests (tests/gpu): local backend on CUDA; with Transformer
   Engine also TE LNS vs local LNS logits in bf16, FP8 training, TE step time.
2. Times LNS against Pre-LN, full training steps in interleaved rounds, for each
   setting this machine supports: local backend bf16; TE bf16; TE FP8 (delayed
   scaling, compute capability >= 8.9). Without TE it checks the local backend only.
3. Writes gpu_check_<gpu>.json and .md with the machine, versions, test outcome and
   the step-time ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _run_gpu_tests() -> dict:
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"returncode": proc.returncode, "summary": tail, "seconds": time.time() - started}


def _time_setting(backend: str, fp8: str | None) -> dict:
    from megatron_lns.training.benchmark import lns_vs_pre_ln

    base = dict(
        num_layers=12,
        hidden_size=1024,
        num_attention_heads=16,
        ffn_hidden_size=2816,
        vocab_size=32000,
        seq_length=2048,
        precision="bf16",
        backend=backend,
        fp8=fp8,
        output_layer_init="normal",
    )
    device = torch.device("cuda", torch.cuda.current_device())
    times = lns_vs_pre_ln(base, device, 2, 4, warmup=5, rounds=7, steps_per_round=5)
    result = {name: t.median for name, t in times.items()}
    result["ratio_lns_to_pre_ln"] = times["lns"].median / times["pre_ln"].median
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--output-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device; this check needs a GPU", file=sys.stderr)
        return 2

    from megatron_lns.runtime import ParallelLayout, init_distributed
    from megatron_lns.te import te_available

    tests = None if args.skip_tests else _run_gpu_tests()
    init_distributed(ParallelLayout(), device="cuda")
    has_te = te_available()
    capability = torch.cuda.get_device_capability()
    settings = [("local", None)]
    if has_te:
        settings.append(("te", None))
        if capability >= (8, 9):
            settings.append(("te", "delayed"))
    timings = {}
    for backend, fp8 in settings:
        name = f"{backend}_{fp8 or 'bf16'}"
        print(f"timing {name} ...", flush=True)
        timings[name] = _time_setting(backend, fp8)

    gpu = torch.cuda.get_device_name()
    report = {
        "gpu": gpu,
        "compute_capability": f"{capability[0]}.{capability[1]}",
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformer_engine": _te_version() if has_te else None,
        "model": "12 layers, hidden 1024, 16 heads, FFN 2816, seq 2048, micro batch 2 x 4, bf16",
        "tests": tests,
        "step_time_seconds": timings,
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check_" + "".join(c if c.isalnum() else "_" for c in gpu)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# GPU check: {gpu}",
        "",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"Transformer Engine {report['transformer_engine']}",
        "",
        report["model"],
        "",
        "| setting | Pre-LN step (ms) | LNS step (ms) | LNS / Pre-LN |",
        "|---|---|---|---|",
    ]
    for name, t in timings.items():
        lines.append(
            f"| {name} | {t['pre_ln'] * 1e3:.1f} | {t['lns'] * 1e3:.1f} | "
            f"{t['ratio_lns_to_pre_ln']:.4f} |"
        )
    if tests is not None:
        lines += ["", "GPU tests (`pytest -m gpu tests/gpu`):", "", "```", *tests["summary"], "```"]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if tests is None or tests["returncode"] == 0 else 1


def _te_version() -> str:
    import transformer_engine

    return getattr(transformer_engine, "__version__", "unknown")


if __name__ == "__main__":
    sys.exit(main())
