"""Streaming read speed of corpus shards: what ``preprocess``'s readers do, beside the
alternatives they were chosen over.

The same generated documents (``--megabytes`` of JSON lines, text from CPython's own
documentation recombined with a fixed seed) are written as ``.jsonl``, ``.jsonl.gz``,
``.jsonl.zst`` and ``.parquet``; each reader streams every document's text (no
tokenizer) in one process, one core. Rows: this package's reader
(``megatron_lns.data.corpus_reader.read_batches``) for each format, and by hand the
alternatives: ``gzip`` + the standard ``json``, ``gzip`` + ``orjson``, ``zstandard`` +
``orjson``, plain lines + ``json``/``orjson``, and pyarrow's parquet batches. MB/s is of
document text (UTF-8), so formats compare on what they deliver::

    .venv/bin/python benchmarks/corpus_readers.py --megabytes 200 --repeats 3

Results go to ``benchmarks/results/corpus_readers.json`` (the best of the repeats).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import platform
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from megatron_lns.data.corpus_inputs import input_format
from megatron_lns.data.corpus_reader import read_batches
from megatron_lns.data.demo_corpus import demo_documents

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "corpus_readers.json"


def documents(megabytes: int, seed: int = 0) -> Iterator[str]:
    """Documents of 1-40 paragraphs drawn from pydoc's topics, until ``megabytes``."""
    paragraphs = [p for d in demo_documents() for p in d.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    total = 0
    while total < megabytes * 1_000_000:
        text = "\n\n".join(rng.choices(paragraphs, k=rng.randint(1, 40)))
        total += len(text.encode())
        yield text


def write_shards(directory: Path, megabytes: int) -> dict[str, Path]:
    texts = list(documents(megabytes))
    lines = b"".join(orjson.dumps({"text": t, "id": i}) + b"\n" for i, t in enumerate(texts))
    paths = {
        "jsonl": directory / "corpus.jsonl",
        "jsonl.gz": directory / "corpus.jsonl.gz",
        "jsonl.zst": directory / "corpus.jsonl.zst",
        "parquet": directory / "corpus.parquet",
    }
    paths["jsonl"].write_bytes(lines)
    paths["jsonl.gz"].write_bytes(gzip.compress(lines, compresslevel=6))
    paths["jsonl.zst"].write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    pq.write_table(pa.table({"text": texts}), paths["parquet"], row_group_size=1000)
    return paths


def ours(path: Path) -> Iterator[str]:
    for batch in read_batches(path, input_format(path), "text"):
        yield from batch.texts


def by_hand(opener: Callable[[Path], io.IOBase], loads: Callable) -> Callable:
    def read(path: Path) -> Iterator[str]:
        with opener(path) as f:
            for line in f:
                yield loads(line)["text"]

    return read


def zstd_lines(path: Path) -> io.IOBase:
    stream = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))  # noqa: SIM115
    return io.BufferedReader(stream, 1 << 20)


def arrow_batches(path: Path) -> Iterator[str]:
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096, columns=["text"]):
        yield from batch.column(0).to_pylist()


def readers(paths: dict[str, Path]) -> list[tuple[str, Path, Callable]]:
    plain = lambda p: open(p, "rb")  # noqa: E731, SIM115
    return [
        ("megatron-lns, .jsonl", paths["jsonl"], ours),
        ("megatron-lns, .jsonl.gz", paths["jsonl.gz"], ours),
        ("megatron-lns, .jsonl.zst", paths["jsonl.zst"], ours),
        ("megatron-lns, .parquet", paths["parquet"], ours),
        (".jsonl + json", paths["jsonl"], by_hand(plain, json.loads)),
        (".jsonl + orjson", paths["jsonl"], by_hand(plain, orjson.loads)),
        (".jsonl.gz + json", paths["jsonl.gz"], by_hand(gzip.open, json.loads)),
        (".jsonl.gz + orjson", paths["jsonl.gz"], by_hand(gzip.open, orjson.loads)),
        (".jsonl.zst + orjson", paths["jsonl.zst"], by_hand(zstd_lines, orjson.loads)),
        (".parquet, pyarrow batches", paths["parquet"], arrow_batches),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_shards(Path(tmp), args.megabytes)
        rows = []
        for name, path, read in readers(paths):
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                text_bytes = sum(len(t.encode()) for t in read(path))
                best = min(best, time.perf_counter() - started)
            rows.append(
                {
                    "reader": name,
                    "file_mb": round(path.stat().st_size / 1e6, 1),
                    "text_mb": round(text_bytes / 1e6, 1),
                    "seconds": round(best, 3),
                    "text_mb_per_s": round(text_bytes / 1e6 / best, 1),
                }
            )
            print(f"{name:32s} {rows[-1]['text_mb_per_s']:8.1f} MB/s of text")
    result = {
        "command": f"benchmarks/corpus_readers.py --megabytes {args.megabytes} "
        f"--repeats {args.repeats}",
        "machine": f"{platform.processor() or platform.machine()}, one core",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print("| reader | file MB | text MB | MB/s of text |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['reader']} | {r['file_mb']} | {r['text_mb']} | {r['text_mb_per_s']} |")


if __name__ == "__main__":
    main()
