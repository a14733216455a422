"""Wall and CPU time of ``submit --dry-run`` and ``train --dry-run`` for the OLMo-7B config.

Both commands run where a job is prepared (a login node): they load, override and
validate the YAML and print the sbatch script or the resolved config. What they import
dominates their cost, so this measures whole processes, as a user starts them::

    .venv/bin/python benchmarks/cli_startup.py --baseline a22ba4a --repeats 5

measures this checkout and, with ``--baseline REV``, the package as it was at git
revision REV (checked out into a temporary worktree, run with the same interpreter),
interleaved repeat by repeat so that both see the same machine load. Each repeat starts
a fresh interpreter running the CLI (CPU time is the child's user + system time from
``getrusage``) and records whether torch or megatron-core ended up in ``sys.modules``.
The data files and tokenizer directory the config names are created empty in a
temporary directory (mounted into the job's container): validation checks that they
exist, not what they hold. Results go to ``benchmarks/results/cli_startup.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLMO = Path("nemo_configs") / "olmo_7b_lns_20b.yaml"
COMMANDS = ("submit", "train")
# Run the CLI, then report which heavy packages the command imported (stderr's last line).
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
    "print('IMPORTED:' + ','.join(heavy), file=sys.stderr)\n"
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


def _run_once(
    tree: Path, command: str, overrides: list[str], cwd: Path
) -> tuple[float, float, str]:
    argv = [sys.executable, "-c", PROBE, command, str(tree / OLMO), *overrides, "--dry-run"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{command} --dry-run failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    imported = done.stderr.strip().splitlines()[-1].removeprefix("IMPORTED:")
    return wall, cpu, imported


@contextlib.contextmanager
def _checkout(revision: str) -> Iterator[Path]:
    """The repository at ``revision``, in a temporary worktree removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        added = subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(tree), revision],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if added.returncode != 0:
            sys.exit(f"error: --baseline {revision}: {added.stderr.strip().splitlines()[-1]}")
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)


def _summary(runs: list[tuple[float, float, str]]) -> dict:
    walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
    return {
        "wall_s_median": round(statistics.median(walls), 3),
        "cpu_s_median": round(statistics.median(cpus), 3),
        "wall_s": [round(w, 3) for w in walls],
        "cpu_s": [round(c, 3) for c in cpus],
        "imports": [m for m in runs[-1][2].split(",") if m],
    }


def _revision(tree: Path) -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    )
    return done.stdout.strip()


def measure(trees: dict[str, Path], repeats: int) -> dict:
    results: dict = {label: {"git_revision": _revision(tree)} for label, tree in trees.items()}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = _inputs(Path(tmp))
        for command in COMMANDS:
            runs: dict[str, list] = {label: [] for label in trees}
            for tree in trees.values():  # warm the file cache and .pyc files
                _run_once(tree, command, overrides, Path(tmp))
            for _ in range(repeats):
                for label, tree in trees.items():
                    runs[label].append(_run_once(tree, command, overrides, Path(tmp)))
            for label in trees:
                results[label][f"{command} --dry-run"] = _summary(runs[label])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="REV", help="also measure git revision REV")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        trees = {"this checkout": ROOT}
        if args.baseline:
            trees = {f"baseline {args.baseline}": stack.enter_context(_checkout(args.baseline))}
            trees["this checkout"] = ROOT
        results = measure(trees, args.repeats)
    for label, result in results.items():
        for command in COMMANDS:
            row = result[f"{command} --dry-run"]
            imports = ", ".join(row["imports"]) or "neither torch nor megatron.core"
            print(
                f"{label} ({result['git_revision']}): {command} --dry-run: "
                f"wall {row['wall_s_median']:.2f} s, cpu {row['cpu_s_median']:.2f} s "
                f"(median of {args.repeats}), imports {imports}"
            )
    record = {
        "config": str(OLMO),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "results": results,
    }
    out = ROOT / "benchmarks" / "results" / "cli_startup.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
