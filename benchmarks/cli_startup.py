"""Wall and CPU time of ``submit --dry-run`` and ``train --dry-run`` for the OLMo-7B config.

Both commands run where a job is prepared (a login node): they load, override and
validate the YAML and print the sbatch script or the resolved config. What they import
dominates their cost, so this measures whole processes, as a user starts them::

    .venv/bin/python benchmarks/cli_startup.py --label after --repeats 5

Each repeat starts a fresh ``python -m megatron_lns.cli`` (CPU time is the child's user +
system time from ``getrusage``) and records whether torch or megatron-core ended up in
``sys.modules``. The data files and tokenizer directory the config names are created
empty in a temporary directory (mounted into the job's container): validation checks
that they exist, not what they hold.
Results go to ``benchmarks/results/cli_startup_<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLMO = ROOT / "nemo_configs" / "olmo_7b_lns_20b.yaml"
# Run the CLI, then report which heavy packages the command imported (on stderr's last line).
PROBE = (
    "import sys, runpy\n"
    "sys.argv = ['megatron-lns', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('megatron_lns.cli', run_name='__main__')\n"
    "except SystemExit as exit:\n"
    "    code = exit.code\n"
    "else:\n"
    "    code = 0\n"
    "heavy = sorted(m for m in ('torch', 'megatron.core') if m in sys.modules)\n"
    "print('IMPORTED ' + ','.join(heavy), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def _inputs(tmp: Path) -> list[str]:
    prefix = tmp / "data" / "corpus_text_document"
    prefix.parent.mkdir()
    for suffix in (".bin", ".idx"):
        prefix.with_suffix(suffix).touch()
    tokenizer = tmp / "tokenizer"
    tokenizer.mkdir()
    return [
        f"model.data.data_prefix=[{prefix}]",
        f"model.tokenizer.type={tokenizer}",
        f"exp_manager.exp_dir={tmp / 'runs'}",
        # The OLMo job runs in a container: the run directory must be mounted at its path.
        f"cluster.container_mounts=[{tmp}:{tmp}]",
    ]


def _run_once(command: str, overrides: list[str], cwd: Path) -> tuple[float, float, list[str]]:
    argv = [sys.executable, "-c", PROBE, command, str(OLMO), *overrides, "--dry-run"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{command} --dry-run failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    imported = done.stderr.strip().splitlines()[-1].removeprefix("IMPORTED ")
    return wall, cpu, [m for m in imported.split(",") if m]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="names the results file (before/after)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = _inputs(Path(tmp))
        for command in ("submit", "train"):
            _run_once(command, overrides, Path(tmp))  # warm the file cache and .pyc files
            runs = [_run_once(command, overrides, Path(tmp)) for _ in range(args.repeats)]
            walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
            results[f"{command} --dry-run"] = {
                "wall_s_median": round(statistics.median(walls), 3),
                "cpu_s_median": round(statistics.median(cpus), 3),
                "wall_s": [round(w, 3) for w in walls],
                "cpu_s": [round(c, 3) for c in cpus],
                "imports": runs[-1][2],
            }
            row = results[f"{command} --dry-run"]
            print(
                f"{command:>6} --dry-run: wall {row['wall_s_median']:.2f} s, "
                f"cpu {row['cpu_s_median']:.2f} s (median of {args.repeats}), "
                f"imports {', '.join(row['imports']) or 'neither torch nor megatron.core'}"
            )
    out = ROOT / "benchmarks" / "results" / f"cli_startup_{args.label}.json"
    record = {
        "config": str(OLMO.relative_to(ROOT)),
        "git_revision": revision,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "results": results,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
