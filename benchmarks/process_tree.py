"""Run a command pinned to some CPUs and measure its whole process tree.

``preprocess`` and Megatron-LM's ``preprocess_data.py`` both tokenize in worker
processes, so the memory a run needs is that of the parent and all its workers
together: ``ru_maxrss`` (one process's peak) would miss it. The tree is sampled while
the command runs: the sum of the RSS of every process in it, and the sum of their PSS
(shared pages divided among the processes that share them: workers forked from a parent
that imported torch share its pages, which a sum of RSS counts once per worker). The
tree's CPU time (what ``getrusage`` gives for waited-for children) and the machine's load
average at the start are recorded too: on a shared machine they tell a slow run from a
crowded one.
"""

from __future__ import annotations

import os
import resource
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

# Reading every process's memory maps for PSS costs the sampler CPU that the run, pinned
# to the same cores on a small machine, would miss: five samples a second find the
# plateau a worker's memory sits at without taking a noticeable share of a core.
SAMPLE_SECONDS = 0.2


@dataclass
class TreeRun:
    returncode: int
    wall_s: float
    peak_rss_bytes: int  # largest sum of RSS over the tree, sampled
    peak_pss_bytes: int  # largest sum of PSS over the tree, sampled
    cpu_s: float  # user + system time of the whole tree (every process it waited for)
    load_before: float  # the machine's 1-minute load average when it started
    log: Path
    max_processes: int = 1  # the most processes the tree held at once
    root_peak_rss_bytes: int = 0  # the command's own process
    child_peak_rss_bytes: int = 0  # the largest of any process it started


def _tree_memory(root: psutil.Process) -> dict[int, tuple[int, int]]:
    """(RSS, PSS) of every process in the tree now, by pid."""
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    memory = {}
    for process in processes:
        try:
            info = process.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        memory[process.pid] = (info.rss, getattr(info, "pss", info.rss))
    return memory


def run_tree(
    argv: Sequence[str], cpus: Sequence[int], env: dict[str, str], log: Path, cwd: Path
) -> TreeRun:
    """Run ``argv`` with its CPU affinity set to ``cpus`` (inherited by every process it
    starts), stdout and stderr to ``log``; its wall time and peak tree memory."""
    allowed = set(cpus)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("wb") as out:
        start = time.perf_counter()
        process = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            preexec_fn=lambda: os.sched_setaffinity(0, allowed),
        )
        root = psutil.Process(process.pid)
        peak_rss = peak_pss = most = 0
        by_pid: dict[int, int] = {}
        while True:
            memory = _tree_memory(root)
            peak_rss = max(peak_rss, sum(rss for rss, _ in memory.values()))
            peak_pss = max(peak_pss, sum(pss for _, pss in memory.values()))
            most = max(most, len(memory))
            for pid, (rss, _) in memory.items():
                by_pid[pid] = max(by_pid.get(pid, 0), rss)
            try:
                returncode = process.wait(timeout=SAMPLE_SECONDS)
                break
            except subprocess.TimeoutExpired:
                continue
        wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    root_peak = by_pid.pop(process.pid, 0)
    child_peak = max(by_pid.values(), default=0)
    return TreeRun(
        returncode, wall, peak_rss, peak_pss, cpu, load, log, most, root_peak, child_peak
    )


def log_tail(log: Path, lines: int = 5) -> str:
    return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
