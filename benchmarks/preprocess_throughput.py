"""Throughput and peak memory of ``megatron-lns preprocess`` beside Megatron-LM's tool
and the tokenizer's own batch encoding, on one corpus, at equal CPU counts.

    PYTHONPATH=. .venv/bin/python benchmarks/preprocess_throughput.py \\
        --megatron-lm /path/to/Megatron-LM [--work-dir DIR] [--corpus-mb 120] \\
        [--output benchmarks/results/preprocess_throughput.json]

Inputs are made here (``preprocess_corpus.py``: a JSONL corpus recombined from the
Python installation's own text, a 32k BPE trained with ``tokenizers`` and a 32k
SentencePiece model; nothing is downloaded) and cached in ``--work-dir``. For each
tokenizer and each CPU count (1, 2 and all cores, ``--cores``), these rows, each run
with its CPU affinity set to that many cores (children inherit it):

- ``megatron-lns preprocess --workers N`` of this checkout, the whole command, with the
  standard encoders and again with ``--encoder gigatoken`` (``--encoders``);
- Megatron-LM's ``tools/preprocess_data.py --workers N --append-eod`` from the
  checkout ``--megatron-lm`` names (its git commit is recorded), run with this venv's
  python and ``PYTHONPATH`` = that checkout, the whole command;
- the tokenizer alone: the texts already in memory, the ``tokenizers`` library's
  ``encode_batch_fast`` (``encode_batch`` where older) with ``RAYON_NUM_THREADS=N``, or
  SentencePiece's ``encode(texts, num_threads=N)``, in batches of ``ALONE_BATCH``
  documents; only the encoding is timed: no reading, parsing or writing.

The tokenizer alone and ``preprocess`` run ``--repeats`` rounds (default 2) and each row
keeps its fastest: on a shared machine other people's load slows single runs at random.
Megatron-LM's tool, two to eight times slower, runs once (that load can only slow its
row, which flatters the ratios against it). Docs/s, tokens/s and MB/s (10^6 bytes of JSONL input)
come from the wall time of each
(the commands' start-up included; it is also measured on its own, on a one-document
input); peak memory is the sampled sum over the process tree (``process_tree.py``).
Each ``preprocess`` output is compared byte for byte with Megatron-LM's (and where they
differ, document by document: how many differ).
``--memory-mb 200,600,2048`` then runs ``preprocess`` with the byte tokenizer on all
cores on generated inputs of those sizes (deleted afterwards) to show whether peak
memory depends on the input's size: the 200 MB input is few units, so fewer worker
processes; 600 MB and 2 GB run as many, and compare like with like. Writes the JSON
and a Markdown rendering of its tables (``.md`` beside it); the docs quote that file.
"""

from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import preprocess_corpus as corpus  # noqa: E402
from process_tree import log_tail, run_tree  # noqa: E402

MB = 1_000_000
MIB = 2**20
ALONE_BATCH = 1024
TOKENIZERS = ("bpe", "sentencepiece")
ENCODERS = ("standard", "gigatoken")
OURS = "megatron-lns preprocess"
ALONE = "tokenizer alone"
MEGATRON = "Megatron-LM preprocess_data.py"
SECTIONS = ("throughput", "startup", "memory")

# The tokenizer alone, in a fresh interpreter (so RAYON_NUM_THREADS holds): argv is
# library, tokenizer file, JSONL, threads. Prints one JSON line.
ALONE_CHILD = """
import json, sys, time
library, path, jsonl, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(jsonl, encoding="utf-8") as lines:
    texts = [json.loads(line)["text"] for line in lines]
batch = int(sys.argv[5])
if library == "bpe":
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(path)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    count = lambda texts: sum(len(e.ids) for e in encode(texts, add_special_tokens=False))
else:
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=path)
    count = lambda texts: sum(map(len, sp.encode(texts, num_threads=threads)))
start, cpu = time.perf_counter(), time.process_time()
tokens = 0
for first in range(0, len(texts), batch):
    tokens += count(texts[first:first + batch])
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu_s": cpu, "documents": len(texts), "tokens": tokens}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAYON_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore", **extra)
    return env


def _git(path: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def megatron_lm_commit(checkout: Path) -> str:
    """The commit of a Megatron-LM checkout: ``git rev-parse HEAD``, or a ``COMMIT`` file
    beside it for a tree exported with ``git archive`` (no ``.git``)."""
    commit = _git(checkout, "rev-parse", "HEAD")
    if not commit and (checkout / "COMMIT").is_file():
        commit = (checkout / "COMMIT").read_text().strip()
    return commit or "unknown"


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.python = sys.executable

    # --- the three ways to tokenize -------------------------------------------------

    def ours(
        self,
        tok: dict,
        jsonl: Path,
        cores: int,
        name: str,
        library: str | None = None,
        encoder: str = "standard",
    ):
        out = self._fresh(f"ours-{name}")
        argv = [self.python, "-m", "megatron_lns.cli", "preprocess", "--input", str(jsonl)]
        argv += ["--output-prefix", str(out / "data"), "--workers", str(cores), "--quiet"]
        argv += tok["ours"] if library is None else ["--tokenizer-library", library]
        argv += ["--encoder", encoder]
        run = run_tree(argv, range(cores), _env(PYTHONPATH=str(ROOT)), out / "log", self.work)
        return run, out / "data"

    def megatron(self, tok: dict, jsonl: Path, cores: int, name: str):
        out = self._fresh(f"megatron-{name}")
        script = Path(self.args.megatron_lm) / "tools" / "preprocess_data.py"
        argv = [self.python, str(script), "--input", str(jsonl), "--append-eod"]
        argv += ["--output-prefix", str(out / "data"), "--workers", str(cores)]
        argv += ["--log-interval", "1000000", *tok["megatron"], tok["model"]]
        env = _env(PYTHONPATH=str(Path(self.args.megatron_lm).resolve()))
        run = run_tree(argv, range(cores), env, out / "log", self.work)
        return run, out / "data_text_document"

    def alone(self, tok: dict, jsonl: Path, cores: int):
        out = self._fresh("alone")
        argv = [self.python, "-c", ALONE_CHILD, tok["alone"][0], tok["alone"][1], str(jsonl)]
        argv += [str(cores), str(ALONE_BATCH)]
        run = run_tree(argv, range(cores), _env(RAYON_NUM_THREADS=str(cores)), out / "log", out)
        result = json.loads(run.log.read_text().strip().splitlines()[-1])
        return run, result

    def _fresh(self, name: str) -> Path:
        out = self.work / "runs" / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        return out

    # --- inputs ------------------------------------------------------------------------

    def inputs(self) -> tuple[Path, dict[str, dict]]:
        paragraphs = corpus.source_paragraphs()
        size = int(self.args.corpus_mb * MB)
        name = f"corpus-{size}-seed{self.args.seed}.jsonl"
        jsonl = corpus.write_corpus(self.work / name, size, self.args.seed, paragraphs)
        bpe = corpus.train_bpe(self.work / f"bpe32k-{jsonl.stem}", jsonl)
        spm = corpus.train_sentencepiece(self.work / f"sp32k-bpe-{jsonl.stem}.model", jsonl)
        tokenizers = {
            "bpe": {
                "label": "BPE 32k (Hugging Face dir)",
                "ours": ["--tokenizer-library", "huggingface", "--tokenizer-type", str(bpe)],
                "megatron": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"],
                "model": str(bpe),
                "alone": ("bpe", str(bpe / "tokenizer.json")),
            },
            "sentencepiece": {
                "label": "SentencePiece 32k",
                "ours": ["--tokenizer-library", "sentencepiece", "--tokenizer-model", str(spm)],
                "megatron": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"],
                "model": str(spm),
                "alone": ("sentencepiece", str(spm)),
            },
        }
        return jsonl, {name: tokenizers[name] for name in self.args.tokenizers}

    # --- sections ---------------------------------------------------------------------

    def throughput(self, jsonl: Path, tokenizers: dict[str, dict]) -> list[dict]:
        input_bytes = jsonl.stat().st_size
        rows = []
        for name, tok in tokenizers.items():
            for cores in self.args.cores:
                # Rounds of the tokenizer alone and preprocess, Megatron-LM's tool (2 to 8
                # times slower) once after the first: each row keeps its fastest round.
                best: dict[str, dict] = {}
                for round_ in range(self.args.repeats):
                    rows_now = [self._alone_row(tok, jsonl, cores, name, input_bytes)]
                    for encoder in self.args.encoders:
                        rows_now.append(
                            self._ours_row(tok, jsonl, cores, name, encoder, input_bytes)
                        )
                    if round_ == 0:
                        theirs, their_prefix = self.megatron(tok, jsonl, cores, name)
                        self._check(theirs, MEGATRON)
                        megatron = _row(name, cores, MEGATRON, theirs.wall_s, theirs, input_bytes)
                        megatron["documents"], megatron["tokens"] = _counts(their_prefix)
                        rows_now.append(megatron)
                    for row in rows_now:
                        if "prefix" in row:  # compared now: the next round overwrites it
                            prefix = row.pop("prefix")
                            row["documents_differing_from_megatron_lm"] = _differing(
                                prefix, their_prefix
                            )
                            row["identical_to_megatron_lm"] = all(
                                filecmp.cmp(f"{prefix}{s}", f"{their_prefix}{s}", shallow=False)
                                for s in (".bin", ".idx")
                            )
                        kept = best.setdefault(row["tool"], row)
                        if "refused" in row:
                            continue
                        kept.setdefault("rounds_s", []).append(row["seconds"])
                        if row["seconds"] < kept["seconds"]:
                            row["rounds_s"] = kept["rounds_s"]
                            best[row["tool"]] = row
                alone, megatron = best[ALONE], best[MEGATRON]
                if (alone["documents"], alone["tokens"]) != (
                    megatron["documents"],
                    megatron["tokens"],
                ):
                    raise SystemExit(
                        f"{name}: the tokenizer alone gave {alone['documents']} documents and "
                        f"{alone['tokens']} tokens, Megatron-LM {megatron['documents']} and "
                        f"{megatron['tokens']}: they did not do the same work"
                    )
                group = [row for tool, row in best.items() if tool.startswith(OURS)]
                group += [megatron, alone]
                measured = [row for row in group if "refused" not in row]
                for row in measured:
                    _rates(row)
                for row in measured:
                    row["vs_tokenizer_alone"] = row["docs_per_s"] / alone["docs_per_s"]
                    row["vs_megatron_lm"] = row["docs_per_s"] / megatron["docs_per_s"]
                rows += group
                print(_markdown_rows(group), flush=True)
        return rows

    def _alone_row(self, tok: dict, jsonl: Path, cores: int, name: str, size: int) -> dict:
        run, result = self.alone(tok, jsonl, cores)
        self._check(run, ALONE)
        row = _row(name, cores, ALONE, result["seconds"], run, size)
        # The tokenizer alone adds no end-of-document id: one per document.
        tokens = result["tokens"] + result["documents"]
        row.update(documents=result["documents"], tokens=tokens, cpu_s=result["cpu_s"])
        return row

    def _ours_row(
        self, tok: dict, jsonl: Path, cores: int, name: str, encoder: str, size: int
    ) -> dict:
        mine, prefix = self.ours(tok, jsonl, cores, f"{name}-{encoder}", encoder=encoder)
        tool = OURS if encoder == "standard" else f"{OURS} --encoder {encoder}"
        why = log_tail(mine.log, 1)
        if mine.returncode != 0 and encoder != "standard" and why.startswith("error:"):
            # An encoder that refuses this tokenizer says why in one line: a row that
            # says so, not a failed benchmark.
            return {"tokenizer": name, "cores": cores, "tool": tool, "refused": why}
        self._check(mine, tool)
        row = _row(name, cores, tool, mine.wall_s, mine, size)
        row["documents"], row["tokens"] = _counts(prefix)
        row["prefix"] = prefix
        return row

    def startup(self, jsonl: Path, tokenizers: dict[str, dict]) -> list[dict]:
        """Each command on a one-document input, one core: what it costs before work."""
        one = self.work / "one-document.jsonl"
        with jsonl.open(encoding="utf-8") as lines:
            one.write_text(next(lines), encoding="utf-8")
        rows = []
        for name, tok in tokenizers.items():
            mine, _ = self.ours(tok, one, 1, f"startup-{name}")
            self._check(mine, OURS)
            theirs, _ = self.megatron(tok, one, 1, f"startup-{name}")
            self._check(theirs, MEGATRON)
            for tool, run in ((OURS, mine), (MEGATRON, theirs)):
                rows.append({"tokenizer": name, "tool": tool, "wall_s": run.wall_s})
        return rows

    def memory(self) -> list[dict]:
        """``preprocess`` (byte tokenizer, all cores) on inputs of ``--memory-mb`` sizes."""
        paragraphs = corpus.source_paragraphs()
        cores = max(self.args.cores)
        rows = []
        for megabytes in self.args.memory_mb:
            jsonl = self.work / f"memory-{megabytes}MB.jsonl"
            try:
                corpus.write_corpus(jsonl, megabytes * MB, self.args.seed + 1, paragraphs)
                size = jsonl.stat().st_size
                run, prefix = self.ours({}, jsonl, cores, f"memory-{megabytes}", library="byte")
                self._check(run, "megatron-lns preprocess (byte)")
                documents, tokens = _counts(prefix)
                row = _row("byte", cores, OURS, run.wall_s, run, size)
                row.update(documents=documents, tokens=tokens)
                rows.append(_rates(row))
                print(_memory_rows([row]), flush=True)
            finally:
                jsonl.unlink(missing_ok=True)
                shutil.rmtree(self.work / "runs" / f"ours-memory-{megabytes}", ignore_errors=True)
        return rows

    def _check(self, run, what: str) -> None:
        if run.returncode != 0:
            raise SystemExit(
                f"{what} failed (exit {run.returncode}), log {run.log}:\n{log_tail(run.log)}"
            )


def _row(tokenizer: str, cores: int, tool: str, seconds: float, run, input_bytes: int) -> dict:
    return {
        "tokenizer": tokenizer,
        "cores": cores,
        "tool": tool,
        "seconds": seconds,
        "command_wall_s": run.wall_s,
        "input_bytes": input_bytes,
        "peak_rss_bytes": run.peak_rss_bytes,
        "peak_pss_bytes": run.peak_pss_bytes,
        "cpu_s": run.cpu_s,
        "load_average_before": run.load_before,
        "processes": run.max_processes,
        "parent_peak_rss_bytes": run.root_peak_rss_bytes,
        "largest_child_peak_rss_bytes": run.child_peak_rss_bytes,
    }


def _rates(row: dict) -> dict:
    row["docs_per_s"] = row["documents"] / row["seconds"]
    row["tokens_per_s"] = row["tokens"] / row["seconds"]
    row["mb_per_s"] = row["input_bytes"] / MB / row["seconds"]
    return row


def _counts(prefix: Path) -> tuple[int, int]:
    """Documents and tokens of a megatron indexed dataset, from its ``.idx``."""
    import numpy as np

    with open(f"{prefix}.idx", "rb") as f:
        header = f.read(9 + 8 + 1 + 8 + 8)
    sequences = int.from_bytes(header[18:26], "little")
    documents = int.from_bytes(header[26:34], "little") - 1
    lengths = np.memmap(f"{prefix}.idx", dtype=np.int32, mode="r", offset=34, shape=(sequences,))
    return documents, int(lengths.sum(dtype=np.int64))


def _differing(prefix: Path, reference: Path) -> int:
    """How many documents of ``prefix`` differ from ``reference``'s (same count assumed)."""
    if all(filecmp.cmp(f"{prefix}{s}", f"{reference}{s}", shallow=False) for s in (".bin", ".idx")):
        return 0
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ours, theirs = IndexedDataset(str(prefix)), IndexedDataset(str(reference))
    if len(ours) != len(theirs):
        return abs(len(ours) - len(theirs)) + min(len(ours), len(theirs))
    return sum(
        1
        for i in range(len(ours))
        if len(ours[i]) != len(theirs[i]) or bool((ours[i] != theirs[i]).any())
    )


def _markdown_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if "refused" in r:
            cells = " | ".join([f"refused: {r['refused']}"] + [""] * 9)
            lines.append(f"| {r['tokenizer']} | {r['cores']} | {r['tool']} | {cells} |")
            continue
        same = r.get("identical_to_megatron_lm")
        lines.append(
            f"| {r['tokenizer']} | {r['cores']} | {r['tool']} | {r['docs_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / 1e6:.2f} M | {r['mb_per_s']:.2f} | "
            f"{r['peak_rss_bytes'] / MIB:,.0f} | {r['peak_pss_bytes'] / MIB:,.0f} | "
            f"{r['seconds']:.1f} | {r['cpu_s']:.1f} | "
            f"{r['vs_tokenizer_alone']:.2f} | {r['vs_megatron_lm']:.2f} | "
            f"{_identical(same, r.get('documents_differing_from_megatron_lm'))} |"
        )
    return "\n".join(lines)


def _identical(same: bool | None, differing: int | None) -> str:
    if same is None:
        return ""
    return "yes" if same else f"NO ({differing:,} documents differ)"


def _memory_rows(rows: list[dict]) -> str:
    return "\n".join(
        f"| {r['input_bytes'] / MB:,.0f} MB | {r['documents']:,} | {r['cores']} | "
        f"{r['processes']} | {r['seconds']:.1f} | {r['mb_per_s']:.2f} | "
        f"{r['peak_rss_bytes'] / MIB:,.0f} | {r['peak_pss_bytes'] / MIB:,.0f} | "
        f"{r['parent_peak_rss_bytes'] / MIB:,.0f} | "
        f"{r['largest_child_peak_rss_bytes'] / MIB:,.0f} |"
        for r in rows
    )


# The goals: megatron-lns preprocess at least this share of the tokenizer's own
# batch throughput, and at least this multiple of Megatron-LM's tool's, at equal cores;
# peak memory independent of input size (here: the largest input's peak within this
# factor of the smallest's).
GOAL_VS_ALONE = 0.85
GOAL_VS_MEGATRON = 1.5
GOAL_MEMORY_GROWTH = 1.10


def goals(report: dict) -> list[dict]:
    """Each goal of the issue, per tokenizer and core count: the measured value, the
    target, and whether it was met."""
    results = []
    for row in report["throughput"]:
        if not row["tool"].startswith(OURS) or "refused" in row:
            continue
        where = f"{row['tokenizer']}, {row['cores']} core{'s' if row['cores'] > 1 else ''}"
        if row["tool"] == OURS:  # the goals are the standard encoders'
            group = [
                r
                for r in report["throughput"]
                if (r["tokenizer"], r["cores"]) == (row["tokenizer"], row["cores"])
            ]
            alone = next(r for r in group if r["tool"] == ALONE)
            megatron = next(r for r in group if r["tool"] == MEGATRON)
            results += [
                _goal(f"vs tokenizer alone ({where})", row, alone, GOAL_VS_ALONE),
                _goal(f"vs Megatron-LM ({where})", row, megatron, GOAL_VS_MEGATRON),
            ]
        results.append(
            {
                "goal": f"{row['tool']}: output identical to Megatron-LM's ({where})",
                "met": row["identical_to_megatron_lm"],
            }
        )
    memory = report["memory"]
    if len(memory) > 1:
        large = memory[-1]
        # Against the smallest input that ran as many processes (one worker per unit of
        # input, up to --workers): more processes is more memory whatever the input.
        small = next(r for r in memory if r["processes"] == large["processes"])
        if small is not large:
            growth = large["peak_rss_bytes"] / small["peak_rss_bytes"]
            results.append(
                {
                    "goal": f"peak RSS at {large['input_bytes'] / MB:,.0f} MB / at "
                    f"{small['input_bytes'] / MB:,.0f} MB ({large['processes']} processes)",
                    "value": growth,
                    "target": f"<= {GOAL_MEMORY_GROWTH}",
                    "met": growth <= GOAL_MEMORY_GROWTH,
                }
            )
    return results


def _goal(name: str, row: dict, other: dict, target: float) -> dict:
    """``row``'s throughput over ``other``'s, by wall time (the goal) and by CPU time (what
    each would take alone on its cores: on a crowded machine the wall time is not)."""
    value = other["seconds"] / row["seconds"]
    return {
        "goal": name,
        "value": value,
        "value_by_cpu_time": other["cpu_s"] / row["cpu_s"],
        "target": f">= {target}",
        "met": value >= target,
    }


def markdown(report: dict) -> str:
    c = report["corpus"]
    text = [
        f"Measured {report['date']} on {report['machine']} ({report['cpus']} CPUs), "
        f"Python {report['python']}, megatron-lns {report['git_revision']}, Megatron-LM "
        f"{report['megatron_lm_commit'][:12]}. Corpus: {c['bytes'] / MB:,.0f} MB JSONL, "
        f"{c['documents']:,} documents (seed {c['seed']}).",
    ]
    if report["throughput"]:
        text += [
            "",
            "| tokenizer | cores | tool | docs/s | tokens/s | MB/s | peak RSS MiB | "
            "peak PSS MiB | wall s | CPU s | vs tokenizer alone | vs Megatron-LM | "
            "identical output |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            _markdown_rows(report["throughput"]),
        ]
    if report["startup"]:
        text += ["", "| tokenizer | command | start-up s (one document, 1 core) |"]
        text += ["|---|---|---|"]
        for r in report["startup"]:
            text.append(f"| {r['tokenizer']} | {r['tool']} | {r['wall_s']:.1f} |")
    if report["memory"]:
        text += [
            "",
            "| input | documents | cores | processes | seconds | MB/s | peak RSS MiB | "
            "peak PSS MiB | parent's peak RSS MiB | largest worker's peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
            _memory_rows(report["memory"]),
        ]
    text += ["", "| goal | measured | by CPU time | target | met |", "|---|---|---|---|---|"]
    for g in report["goals"]:
        value = " | ".join(f"{g[k]:.2f}" if k in g else "" for k in ("value", "value_by_cpu_time"))
        text.append(
            f"| {g['goal']} | {value} | {g.get('target', '')} | {'yes' if g['met'] else 'NO'} |"
        )
    return "\n".join(text) + "\n"


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megatron-lm", help="a Megatron-LM checkout")
    parser.add_argument(
        "--render", metavar="JSON", help="only print (and write beside it) the tables of a report"
    )
    parser.add_argument("--work-dir", default="/tmp/megatron_lns_preprocess_bench")
    parser.add_argument("--corpus-mb", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds of the tokenizer alone and preprocess per row (the fastest is kept)",
    )
    cpus = len(os.sched_getaffinity(0))
    parser.add_argument(
        "--cores", type=_int_list, default=sorted({1, min(2, cpus), cpus}), help="e.g. 1,2,16"
    )
    parser.add_argument("--tokenizers", type=lambda s: s.split(","), default=list(TOKENIZERS))
    parser.add_argument(
        "--encoders",
        type=lambda s: s.split(","),
        default=list(ENCODERS),
        help="preprocess --encoder values to run",
    )
    parser.add_argument(
        "--memory-mb", type=_int_list, default=[200, 600, 2048], help="'' to skip the memory runs"
    )
    parser.add_argument(
        "--sections",
        type=lambda s: s.split(","),
        default=list(SECTIONS),
        help=f"which to run, of {','.join(SECTIONS)}",
    )
    parser.add_argument("--output", default=str(HERE / "results" / "preprocess_throughput.json"))
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads(Path(args.render).read_text())
        report["goals"] = goals(report)
        text = markdown(report)
        Path(args.render).with_suffix(".md").write_text(text)
        print(text, end="")
        return 0
    if not args.megatron_lm:
        parser.error("--megatron-lm is required (a Megatron-LM checkout)")
    if not (Path(args.megatron_lm) / "tools" / "preprocess_data.py").is_file():
        parser.error(f"{args.megatron_lm} holds no tools/preprocess_data.py")
    if max(args.cores) > cpus:
        parser.error(f"--cores {max(args.cores)}: only {cpus} CPUs here")
    for flag, given, known in (
        ("--tokenizers", args.tokenizers, TOKENIZERS),
        ("--sections", args.sections, SECTIONS),
        ("--encoders", args.encoders, ENCODERS),
    ):
        if unknown := set(given) - set(known):
            parser.error(f"{flag}: unknown {', '.join(sorted(unknown))}")

    started = time.perf_counter()
    bench = Bench(args)
    jsonl, tokenizers = bench.inputs()
    with jsonl.open(encoding="utf-8") as lines:
        documents = sum(1 for _ in lines)
    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.processor() or platform.machine(),
        "cpus": cpus,
        "python": platform.python_version(),
        "git_revision": _git(ROOT, "rev-parse", "--short", "HEAD"),
        "megatron_lm": str(Path(args.megatron_lm).resolve()),
        "megatron_lm_commit": megatron_lm_commit(Path(args.megatron_lm)),
        "corpus": {"bytes": jsonl.stat().st_size, "documents": documents, "seed": args.seed},
        "note": (
            "docs/s, tokens/s, MB/s (10^6 bytes of JSONL) from each command's wall time, "
            "start-up included; the tokenizer alone: encoding time only. Peak RSS / PSS: "
            "sampled sums over the process tree. Every run pinned to its cores."
        ),
        "startup": [],
        "throughput": [],
        "memory": [],
    }
    if "throughput" in args.sections:
        report["throughput"] = bench.throughput(jsonl, tokenizers)
    if "startup" in args.sections:
        report["startup"] = bench.startup(jsonl, tokenizers)
    if "memory" in args.sections and args.memory_mb:
        report["memory"] = bench.memory()
    report["goals"] = goals(report)
    report["wall_s"] = time.perf_counter() - started
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    output.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {output} and {output.with_suffix('.md')} in {report['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
