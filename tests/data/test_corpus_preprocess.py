"""Corpus preprocessing: compressed and parquet shards, units, resume, tasks, bad input.

What a user of ``megatron-lns preprocess`` relies on: the ids are the training tokenizer's,
document by document; the bytes do not depend on how the work was split or whether it
was resumed; a bad shard is one line naming it and publishes nothing; a published
dataset is never replaced without ``--overwrite``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import (
    byte_gpt_datasets,
    end_by_signal,
    fresh_launch_env,
    killed_on_exit,
    wait_while_running,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_lns.cli import main
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.metadata import DatasetMetadata
from megatron_lns.data.preprocess import CorpusRun, PreprocessError, preprocess, preprocess_corpus
from megatron_lns.data.preprocess_plan import FileLock, Unit
from megatron_lns.data.token_files import token_files_sha256
from megatron_lns.data.unit_worker import BadRecordLimit, TokenizerSpec, UnitTokenizer

DOCS = demo_documents()[:600]


def _jsonl(docs: list[str]) -> bytes:
    return b"".join(json.dumps({"text": d, "id": i}).encode() + b"\n" for i, d in enumerate(docs))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[list[str], list[str]]:
    """Five shards of every kind, and the documents they hold, in order."""
    root = tmp_path_factory.mktemp("shards")
    parts = [DOCS[:100], DOCS[100:250], DOCS[250:400], DOCS[400:500], DOCS[500:]]
    (root / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(parts[0])))
    (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(parts[1])))
    pq.write_table(pa.table({"text": parts[2]}), root / "c.parquet", row_group_size=40)
    (root / "d.jsonl").write_bytes(_jsonl(parts[3]))
    (root / "e.txt").write_text("".join(d.replace("\n", " ") + "\n" for d in parts[4]))
    names = ["a.jsonl.gz", "b.jsonl.zst", "c.parquet", "d.jsonl", "e.txt"]
    texts = [*DOCS[:500], *(d.replace("\n", " ") for d in parts[4])]
    return [str(root / n) for n in names], texts


def _corpus(inputs, out, tokenizer=None, **options) -> CorpusRun:
    return CorpusRun(list(inputs), Path(out), tokenizer or TokenizerSpec("byte"), **options)


def _files(prefix) -> dict[str, bytes]:
    return {s: Path(f"{prefix}{s}").read_bytes() for s in (".bin", ".idx", ".json")}


def _spec(factory, library: str) -> TokenizerSpec:
    files = factory.tokenizer(library)
    return TokenizerSpec(library, files.type, files.model)


@pytest.mark.parametrize("library", ["byte", "huggingface", "sentencepiece"])
def test_mixed_shards_give_the_training_tokenizers_ids_document_by_document(
    tmp_path, shards, factory, library
):
    inputs, texts = shards
    spec = _spec(factory, library)
    outcome = preprocess_corpus(_corpus(inputs, tmp_path / "data", spec, workers=1))
    tokenizer = spec.build()
    dataset = IndexedDataset(str(tmp_path / "data"))
    assert len(dataset) == len(texts)
    for i, text in enumerate(texts):
        assert dataset[i].tolist() == [*tokenizer.encode(text), tokenizer.eod], i
    assert outcome.metadata.dataset_id == token_files_sha256(str(tmp_path / "data"))
    manifest = json.loads(Path(f"{tmp_path}/data.manifest.json").read_text())
    assert [u["documents"] for u in manifest["units"]] == [100, 150, 150, 100, 100]
    assert manifest["totals"]["tokens"] == outcome.metadata.num_tokens


def test_the_bytes_are_the_same_however_the_work_is_split(tmp_path, shards, factory):
    """One process; two workers with small units (byte ranges of the plain files); three
    tasks of a plan, merged by a plain run: the same dataset, byte for byte."""
    inputs, _ = shards
    spec = _spec(factory, "huggingface")
    preprocess_corpus(_corpus(inputs, tmp_path / "one", spec, workers=1))
    expected = _files(tmp_path / "one")
    preprocess_corpus(_corpus(inputs, tmp_path / "two", spec, workers=2, unit_bytes=4096))
    assert _files(tmp_path / "two") == expected
    plan = json.loads((tmp_path / "two.parts" / "plan.json").read_text())
    ranges = [u for u in plan["units"] if u["end"] is not None]
    assert len(ranges) > 5 and {Path(u["path"]).name for u in ranges} == {"d.jsonl", "e.txt"}

    split = _corpus(inputs, tmp_path / "tasks", spec, unit_bytes=4096)
    preprocess_corpus(_corpus(inputs, tmp_path / "tasks", spec, unit_bytes=4096, plan_only=True))
    assert not Path(f"{tmp_path}/tasks.bin").exists()
    for task in range(3):
        lines = preprocess_corpus(dataclasses.replace(split, task=(task, 3))).lines
        assert lines[-1].startswith(f"task {task}/3: ")
    merged = preprocess_corpus(split)
    assert (
        merged.lines[0]
        == f"resumed: {len(plan['units'])} of {len(plan['units'])} units were done before"
    )
    assert _files(tmp_path / "tasks") == expected


def test_a_unit_another_process_finished_meanwhile_is_not_counted_as_tokenized(
    tmp_path, shards, monkeypatch
):
    """Two jobs on one plan: a unit the other finished between this task's look at the
    receipts and its lock on the unit was counted as tokenized by both (19 of 16)."""
    inputs, _ = shards
    split = _corpus(inputs, tmp_path / "data", unit_bytes=4096)
    preprocess_corpus(dataclasses.replace(split, plan_only=True))
    plan = json.loads((tmp_path / "data.parts" / "plan.json").read_text())
    tokenize = UnitTokenizer.tokenize
    taken: list[int] = []

    def another_process_first(self, unit, report):
        if not taken:  # before this task's first unit, "another process" does its last
            last = Unit(**plan["units"][-1])
            taken.append(last.index)
            assert tokenize(self, last, lambda *_: None) == "tokenized"
        return tokenize(self, unit, report)

    monkeypatch.setattr(UnitTokenizer, "tokenize", another_process_first)
    lines = preprocess_corpus(dataclasses.replace(split, task=(0, 1))).lines
    n = len(plan["units"])
    assert lines[-1] == (
        f"task 0/1: {n} units, {n - 1} tokenized now, 0 done before, 1 done by another process"
    )
    assert f"tokenized {n - 1} units (1 more finished by another process): " in lines[-2]


def test_training_reads_the_output_as_it_is(tmp_path, shards):
    inputs, texts = shards
    preprocess_corpus(_corpus(inputs, tmp_path / "data"))
    splits = byte_gpt_datasets([tmp_path / "data"], samples=(16, 4, 0))
    assert len(splits.train) >= 16 and len(splits.valid) >= 4
    assert DatasetMetadata.load(tmp_path / "data").num_documents == len(texts)


def test_a_rerun_is_up_to_date_and_other_settings_are_refused(tmp_path, shards, factory):
    inputs, _ = shards
    run = _corpus(inputs, tmp_path / "data")
    preprocess_corpus(run)
    assert preprocess_corpus(run).lines == [
        f"{tmp_path}/data.bin/.idx are up to date: nothing to do"
    ]
    other = _corpus(inputs, tmp_path / "data", _spec(factory, "sentencepiece"))
    with pytest.raises(
        PreprocessError,
        match=r"data.parts holds a run with other settings \(tokenizer byte -> sentencepiece:.*vocab_size 257 -> .*--overwrite to start over",
    ):
        preprocess_corpus(other)
    with pytest.raises(PreprocessError, match=r"the inputs: 1 removed \(.*e.txt\)"):
        preprocess_corpus(_corpus(inputs[:-1], tmp_path / "data"))


def test_a_changed_shard_is_named_and_only_it_is_redone(tmp_path, shards):
    inputs, _ = shards
    copied = []
    for path in inputs:
        copy = tmp_path / "in" / Path(path).name
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(Path(path).read_bytes())
        copied.append(str(copy))
    run = _corpus(copied, tmp_path / "data")
    preprocess_corpus(run)
    units = tmp_path / "data.parts" / "units"
    before = {p.name: p.stat().st_mtime_ns for p in units.glob("*.json")}
    Path(copied[3]).write_bytes(_jsonl(DOCS[:7]))
    with pytest.raises(
        PreprocessError, match=r"data.bin/.idx exist and are not this run's output: --overwrite"
    ):
        preprocess_corpus(run)
    lines = preprocess_corpus(_corpus(copied, tmp_path / "data", overwrite=True)).lines
    assert any(line.startswith(f"{copied[3]} changed since it was tokenized") for line in lines)
    after = {p.name: p.stat().st_mtime_ns for p in units.glob("*.json")}
    assert [n for n in before if before[n] != after[n]] == ["000003.json"]
    assert DatasetMetadata.load(tmp_path / "data").num_documents == 600 - 100 + 7


def test_an_existing_dataset_is_replaced_only_with_overwrite(tmp_path, shards, capsys):
    inputs, _ = shards
    preprocess(DOCS[:3], tmp_path / "data")
    before = _files(tmp_path / "data")
    args = ["preprocess", "--input", *inputs, "--output-prefix", str(tmp_path / "data"), "--quiet"]
    assert main(args) == 2
    assert (
        "exist and are not this run's output: --overwrite replaces them" in capsys.readouterr().err
    )
    assert _files(tmp_path / "data") == before
    assert main([*args, "--overwrite"]) == 0
    assert DatasetMetadata.load(tmp_path / "data").num_documents == 600


def test_a_second_run_on_the_same_output_is_refused(tmp_path, shards):
    inputs, _ = shards
    (tmp_path / "data.parts").mkdir()
    lock = FileLock(tmp_path / "data.parts" / "lock")
    assert lock.acquire()
    try:
        with pytest.raises(
            PreprocessError,
            match=rf"another preprocess \(pid {os.getpid()} on .*\) is writing {tmp_path}/data",
        ):
            preprocess_corpus(_corpus(inputs, tmp_path / "data"))
    finally:
        lock.release()
    preprocess_corpus(_corpus(inputs, tmp_path / "data"))


def test_stale_temporaries_of_dead_runs_are_named_and_removed(tmp_path, shards):
    inputs, _ = shards
    (tmp_path / "data.parts" / "units").mkdir(parents=True)
    stale = [
        tmp_path / "data.tmp-0123456789ab.bin",
        tmp_path / "data.parts/units/000002.tmp-ab.bin",
    ]
    for path in stale:
        path.write_bytes(b"x" * 100)
    lines = preprocess_corpus(_corpus(inputs, tmp_path / "data")).lines
    assert f"removed {stale[0]}: left by a run that stopped before publishing" in lines
    assert not any(path.exists() for path in stale)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_bad_records_stop_the_run_by_default_or_are_counted_and_listed(tmp_path, capsys):
    lines = [b'{"text": "fine"}', b'{"text": 3}', b"{oops", b'{"text": "also fine"}']
    bad = _write(tmp_path / "bad.jsonl", b"\n".join(lines) + b"\n")
    table = pa.table({"text": ["one", None, "three"]})
    pq.write_table(table, tmp_path / "nulls.parquet")
    nulls = str(tmp_path / "nulls.parquet")
    with pytest.raises(
        PreprocessError,
        match=rf"^{bad}:2: 'text' is int, not a string \(--max-bad-records N tolerates",
    ):
        preprocess_corpus(_corpus([bad, nulls], tmp_path / "data"))
    with pytest.raises(PreprocessError, match=rf"{nulls} row 2: 'text' is null"):
        preprocess_corpus(_corpus([nulls], tmp_path / "nulls"))
    limit = BadRecordLimit.parse("2")
    with pytest.raises(
        PreprocessError,
        match=r"3 bad records in all, more than --max-bad-records 2 .* nothing published",
    ):
        preprocess_corpus(
            _corpus([bad, nulls], tmp_path / "data", bad_records=limit, overwrite=True)
        )
    assert not Path(f"{tmp_path}/data.bin").exists()
    capsys.readouterr()
    assert main(["preprocess", "--input", bad, nulls, "--output-prefix", f"{tmp_path}/cli",
                 "--max-bad-records", "3", "--quiet", "--workers", "1"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert f"warning: bad record {bad}:3: not valid JSON" in err
    assert "3 bad records skipped (listed in" in out
    manifest = json.loads(Path(f"{tmp_path}/cli.manifest.json").read_text())
    assert manifest["totals"]["bad_records"] == 3
    assert manifest["units"][1]["bad_records"] == [f"{nulls} row 2: 'text' is null"]
    assert DatasetMetadata.load(tmp_path / "cli").num_documents == 4
    fraction = BadRecordLimit.parse("0.1")
    with pytest.raises(
        PreprocessError,
        match=r"bad.jsonl: 2 bad records, 50.0000% of 4 records, more than --max-bad-records 0.1",
    ):
        preprocess_corpus(_corpus([bad], tmp_path / "fraction", bad_records=fraction))


def test_unreadable_shards_are_one_line_errors_and_publish_nothing(tmp_path):
    good = _jsonl(DOCS[:200])
    zstd = zstandard.ZstdCompressor().compress(good)
    cases = {
        "cut.jsonl.gz": (gzip.compress(good)[:-2000], r"cut.jsonl.gz: truncated gzip file"),
        "junk.jsonl.gz": (b"\x1f\x8b\x08\x00" + b"\x07" * 500, r"junk.jsonl.gz: corrupt gzip data"),
        "cut.jsonl.zst": (zstd[: len(zstd) // 2], r"cut.jsonl.zst: truncated zstd file"),
        "junk.jsonl.zst": (
            b"\x28\xb5\x2f\xfd" + b"\x07" * 500,
            r"junk.jsonl.zst: corrupt zstd data",
        ),
        "empty.jsonl.zst": (b"", r"empty.jsonl.zst holds no documents \(an empty shard\)"),
        "blank.jsonl": (b"\n\n", r"blank.jsonl holds no documents"),
        "not.parquet": (b"PAR1 nothing", r"not.parquet: not a readable parquet file"),
    }
    for name, (data, message) in cases.items():
        path = _write(tmp_path / name, data)
        with pytest.raises(PreprocessError, match=f"^{tmp_path}/{message}"):
            preprocess_corpus(_corpus([path], tmp_path / "out" / name))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nokey.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    for name, message in [
        ("nokey.parquet", r"no column 'text' \(columns: body\); --json-key names the text column"),
        ("ints.parquet", r"column 'text' holds int64, not strings"),
    ]:
        with pytest.raises(PreprocessError, match=f"{name}: {message}"):
            preprocess_corpus(_corpus([str(tmp_path / name)], tmp_path / "out" / name))
    published = [p for p in (tmp_path / "out").rglob("*") if p.suffix in (".bin", ".idx")]
    assert published == []


def test_inputs_from_directories_and_globs_in_sorted_order(tmp_path, shards, capsys):
    inputs, _ = shards
    one = tmp_path / "one"
    preprocess_corpus(_corpus(sorted(inputs), one))
    directory = Path(inputs[0]).parent
    preprocess_corpus(_corpus([str(directory)], tmp_path / "dir"))
    preprocess_corpus(_corpus([f"{directory}/*"], tmp_path / "glob"))
    assert _files(tmp_path / "dir") == _files(one) == _files(tmp_path / "glob")
    for inputs_, message in [
        ([f"{directory}/*.nothing"], "matches no file"),
        ([inputs[0], f"{directory}/../{directory.name}/a.jsonl.gz"], "is named twice"),
        ([f"{directory}/x.jsonl.gz"], "x.jsonl.gz does not exist"),
    ]:
        with pytest.raises(PreprocessError, match=message):
            preprocess_corpus(_corpus(inputs_, tmp_path / "bad"))
    with pytest.raises(
        PreprocessError,
        match=r"--task 0/2: the plan .*plan.json is missing: run the same command with --plan-only first",
    ):
        preprocess_corpus(_corpus(inputs, tmp_path / "new" / "notask", task=(0, 2)))
    assert not (tmp_path / "new").exists()  # it left new/notask.parts/units/


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> list[str]:
    """Forty shards that take the Hugging Face tokenizer seconds: time to stop a run midway."""
    root = tmp_path_factory.mktemp("many")
    docs = demo_documents()
    for i in range(40):
        (root / f"{i:02d}.jsonl.gz").write_bytes(gzip.compress(_jsonl(docs[i * 40 : i * 40 + 200])))
    return [str(root)]


@pytest.mark.long
@pytest.mark.parametrize(
    "signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["KILL", "TERM", "INT"]
)
def test_a_run_stopped_midway_keeps_its_finished_units_and_resumes_to_the_same_bytes(
    tmp_path, many_shards, factory, signum
):
    """Stopped once some units are finished, in worker processes: nothing published, no
    temporary file and no process left; finished units kept; the rerun skips them and
    writes the bytes an uninterrupted run writes."""
    files = factory.tokenizer("huggingface")
    args = ["preprocess", "--input", *many_shards, "--output-prefix", str(tmp_path / "data"),
            "--tokenizer-library", "huggingface", "--tokenizer-type", files.type,
            "--workers", "2", "--quiet"]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_lns.cli", *args],
        env=fresh_launch_env(PYTHONPATH=os.pathsep.join(sys.path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    units = tmp_path / "data.parts" / "units"
    with killed_on_exit(process):
        wait_while_running(process, lambda: len(list(units.glob("*.json"))) >= 2, 120,
                           "no unit finished")  # fmt: skip
        workers = _children(process.pid)
        end_by_signal(process, signum, 60)
    assert not Path(f"{tmp_path}/data.bin").exists()
    finished = len(list(units.glob("*.json")))
    assert 2 <= finished < 40
    deadline = time.monotonic() + 30
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if _alive(pid)] == []
    if signum != signal.SIGKILL:  # a killed parent cannot clean up; the next run does
        assert list(units.glob("*.tmp-*")) == []

    spec = TokenizerSpec("huggingface", files.type)
    lines = preprocess_corpus(_corpus(many_shards, tmp_path / "data", spec, workers=2)).lines
    assert lines[0] == f"resumed: {finished} of 40 units were done before"
    assert list(units.glob("*.tmp-*")) == []
    preprocess_corpus(_corpus(many_shards, tmp_path / "whole", spec, workers=1))
    assert _files(tmp_path / "data") == _files(tmp_path / "whole")
