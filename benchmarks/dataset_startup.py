"""Training start-up on a thousand-shard dataset: 1,000 prefixes vs one merged prefix.

A corpus tokenized in many pieces can reach training as one prefix per piece, or merged
into one prefix. This measures what each costs a rank before its first step: the same
documents (synthetic token ids, byte-tokenizer vocabulary) written as ``--shards``
megatron indexed datasets and as one, then, each in a fresh interpreter, what a rank
runs to get its datasets (``DatasetSettings.build``: every prefix's ``.json`` checked
against the tokenizer, its ``.idx`` hashed for the cache key, megatron's
``BlendedMegatronDatasetBuilder`` building the train and validation ``GPTDataset``s,
blended when there are several prefixes). Cold: a fresh index-mapping cache (a first
run); warm: the cache the cold run left (a restart). Wall time and peak RSS
(``ru_maxrss``) of the child, which does nothing else::

    PYTHONPATH=. .venv/bin/python benchmarks/dataset_startup.py \\
        [--shards 1000] [--output benchmarks/results/dataset_startup.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20

# argv: JSON list of prefixes, cache dir, seq length, train samples, valid samples, split.
CHILD = """
import json, resource, sys, time
start = time.perf_counter()
from megatron_lns.data.blend import DataBlend
from megatron_lns.data.datasets import DatasetSettings
imported = time.perf_counter()
prefixes, cache, seq, train, valid, split = json.loads(sys.argv[1]), sys.argv[2], \\
    int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
settings = DatasetSettings(DataBlend.parse(prefixes), split, seq, 1234, cache_dir=cache)
splits = settings.build(("byte", None, None), 257, (train, valid, 0))
sample = splits.train[len(splits.train) - 1]
done = time.perf_counter()
print(json.dumps({
    "import_s": imported - start, "build_s": done - imported,
    "train_samples": len(splits.train), "valid_samples": len(splits.valid),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
"""


def write_datasets(
    directory: Path, shards: int, documents: int, seed: int
) -> tuple[list[str], str]:
    """``shards`` prefixes of ``documents`` documents each (300-700 byte-vocabulary ids,
    the last one the end-of-document id 256) and one prefix holding all of them in
    order, with their ``.json`` descriptions; written once."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_lns.data.metadata import DatasetMetadata

    shard_prefixes = [str(directory / "shards" / f"shard_{i:05d}") for i in range(shards)]
    merged = str(directory / "merged" / "all")
    if Path(f"{merged}.json").exists():
        return shard_prefixes, merged
    for sub in ("shards", "merged"):
        shutil.rmtree(directory / sub, ignore_errors=True)
        (directory / sub).mkdir(parents=True)
    rng = np.random.default_rng(seed)
    dtype = DType.optimal_dtype(257)
    total_documents = total_tokens = 0
    for prefix in shard_prefixes:
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
        tokens = 0
        for length in rng.integers(300, 701, size=documents):
            ids = rng.integers(0, 256, size=int(length), dtype=np.int64)
            ids[-1] = 256
            builder.add_document(torch.from_numpy(ids), [int(length)])
            tokens += int(length)
        builder.finalize(f"{prefix}.idx")
        DatasetMetadata("byte", 257, 256, 256, documents, tokens).save(f"{prefix}.json")
        total_documents += documents
        total_tokens += tokens
    builder = IndexedDatasetBuilder(f"{merged}.bin", dtype=dtype)
    for prefix in shard_prefixes:
        builder.add_index(prefix)
    builder.finalize(f"{merged}.idx")
    DatasetMetadata("byte", 257, 256, 256, total_documents, total_tokens).save(f"{merged}.json")
    return shard_prefixes, merged


def build_once(prefixes: list[str], cache: Path, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-c", CHILD, json.dumps(prefixes), str(cache), str(args.seq_length)]
    argv += [str(args.train_samples), str(args.valid_samples), args.split]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"building the datasets failed:\n{done.stderr[-3000:]}")
    return {"wall_s": wall, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--documents-per-shard", type=int, default=100)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--train-samples", type=int, default=20_000)
    parser.add_argument("--valid-samples", type=int, default=200)
    parser.add_argument("--split", default="95,5,0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default="/tmp/megatron_lns_dataset_startup")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/dataset_startup.json"))
    args = parser.parse_args(argv)

    work = Path(args.work_dir)
    started = time.perf_counter()
    shards, merged = write_datasets(work, args.shards, args.documents_per_shard, args.seed)
    write_s = time.perf_counter() - started
    layouts = {f"{args.shards} prefixes": shards, "1 merged prefix": [merged]}
    results = []
    for name, prefixes in layouts.items():
        cache = work / f"cache-{len(prefixes)}"
        shutil.rmtree(cache, ignore_errors=True)
        cold = build_once(prefixes, cache, args)
        files = [f for f in cache.rglob("*") if f.is_file()]
        cold["cache_files"] = len(files)
        cold["cache_bytes"] = sum(f.stat().st_size for f in files)
        warm = build_once(prefixes, cache, args)
        results.append({"layout": name, "prefixes": len(prefixes), "cold": cold, "warm": warm})
        print(name, json.dumps({"cold": cold, "warm": warm}), flush=True)
    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "git_revision": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "work_dir")},
        "documents": args.shards * args.documents_per_shard,
        "write_s": write_s,
        "results": results,
        "note": "wall_s: the whole child (interpreter start, imports, build); build_s: "
        "DatasetSettings.build and one sample; peak RSS: ru_maxrss of the child",
    }
    output = Path(args.output)
    output.write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    output.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {output} and {output.with_suffix('.md')}")
    return 0


def markdown(report: dict) -> str:
    lines = [
        f"Measured {report['date']} on {report['machine']} ({report['cpus']} CPUs), "
        f"megatron-lns {report['git_revision']}: {report['documents']:,} documents, "
        f"seq {report['settings']['seq_length']}, {report['settings']['train_samples']:,} "
        f"train samples.",
        "",
        "| layout | cold build s | cold peak RSS MiB | index cache | warm build s | "
        "warm peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        c, w = r["cold"], r["warm"]
        lines.append(
            f"| {r['layout']} | {c['build_s']:.2f} | {c['peak_rss_bytes'] / MIB:,.0f} | "
            f"{c['cache_files']:,} files, {c['cache_bytes'] / MIB:,.1f} MiB | "
            f"{w['build_s']:.2f} | {w['peak_rss_bytes'] / MIB:,.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
