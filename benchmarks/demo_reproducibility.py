"""How reproducible are the demo's losses? The same demo, run in fresh processes under
environments that change only floating-point rounding.

Variants (each a fresh `megatron-lns demo` process, every step's loss logged):

* ``baseline`` and ``baseline_again``: the same environment twice. Same machine, same
  software, same thread count: the curves must be bitwise identical.
* ``one_thread``: OMP/MKL limited to one thread (other reduction splits).
* ``avx2``: PyTorch's vectorised kernels and MKL's GEMMs restricted to AVX2, as on a CPU
  without AVX-512 (other kernels, other rounding).

The last two stand in for "another machine": they show how far rounding differences of
one ulp grow over training, arm by arm. Output: a table on stdout and a JSON file.

    .venv/bin/python benchmarks/demo_reproducibility.py \
        --output benchmarks/results/demo_reproducibility_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "baseline": {},
    "baseline_again": {},
    "one_thread": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
ARMS = ("lns", "pre_ln")  # the demo's variants


def run_demo(variant_env: dict[str, str], exp_dir: Path, overrides: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(variant_env)
    command = [
        sys.executable, "-m", "megatron_lns.cli", "demo", "--out", str(exp_dir), *overrides,
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)


def read_curves(exp_dir: Path) -> dict[str, dict]:
    """Per arm: every step's train loss and the final held-out loss."""
    curves = {}
    for arm in ARMS:
        (metrics,) = (exp_dir / arm).glob("seed*/metrics.jsonl")  # the demo runs one seed
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        curves[arm] = {
            "train": [r["loss"] for r in records if "loss" in r],
            "held_out": [r["val_loss"] for r in records if "val_loss" in r][-1],
        }
    return curves


def compare(reference: dict, other: dict) -> dict:
    a, b = reference["train"], other["train"]
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    first = next((step for step, d in enumerate(diffs, 1) if d > 0), None)
    return {
        "bitwise_identical": first is None and reference["held_out"] == other["held_out"],
        "first_step_that_differs": first,
        "max_train_loss_diff": max(diffs),
        "held_out_diff": abs(reference["held_out"] - other["held_out"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[name for name in VARIANTS if name != "baseline"],
        default=[name for name in VARIANTS if name != "baseline"],
        help="which environments to compare with the baseline (default: all)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the demo YAML")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {}
        for name in ["baseline", *args.variants]:
            print(f"running the demo: {name} {VARIANTS[name] or ''}", flush=True)
            run_demo(VARIANTS[name], Path(tmp) / name, args.overrides)
            curves[name] = read_curves(Path(tmp) / name)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "overrides": args.overrides,
        "held_out": {name: {arm: c[arm]["held_out"] for arm in ARMS} for name, c in curves.items()},
        "vs_baseline": {
            name: {arm: compare(curves["baseline"][arm], curves[name][arm]) for arm in ARMS}
            for name in args.variants
        },
    }
    print(f"\n{'variant':<16}{'arm':<7}{'bitwise':>8}{'first diff':>11}"
          f"{'max |d train|':>15}{'|d held-out|':>14}")  # fmt: skip
    for name, arms in report["vs_baseline"].items():
        for arm, c in arms.items():
            print(
                f"{name:<16}{arm:<7}{c['bitwise_identical']!s:>8}"
                f"{c['first_step_that_differs'] or '-'!s:>11}"
                f"{c['max_train_loss_diff']:>15.2e}{c['held_out_diff']:>14.2e}"
            )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
