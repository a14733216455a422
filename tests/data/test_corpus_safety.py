"""Corpus preprocessing that must not lose data or drop what the user asked: an output
prefix that names a directory, outputs that are inputs, options a run would not use,
plans and receipts that cannot be read, corpora without a document.

Each case is one line ``error: ...`` (exit code 2) that names the problem, or a run that
does what was asked; none leaves a file that a later run would take for finished work.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import cli_error_of

from megatron_lns.cli import main
from megatron_lns.data.corpus_inputs import expand_inputs
from megatron_lns.data.output_files import OUTPUT_SUFFIXES
from megatron_lns.data.preprocess import CorpusRun, PreprocessError, preprocess_corpus


def _corpus_file(path: Path, *texts: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def _unpublish(prefix: Path) -> None:
    """Remove the published dataset, keeping PREFIX.parts/: a rerun then merges again."""
    for suffix in OUTPUT_SUFFIXES:
        Path(f"{prefix}{suffix}").unlink()


@pytest.mark.parametrize("prefix", [".", "", "..", "data/.", "data/.."])
def test_an_output_prefix_that_names_a_directory_is_refused(tmp_path, capsys, prefix, monkeypatch):
    """``--output-prefix .`` (or '') ended in a ValueError traceback: PREFIX.parts is
    made by adding to the prefix's name, and a directory's alias has none."""
    monkeypatch.chdir(tmp_path)
    corpus = _corpus_file(tmp_path / "wiki.jsonl", "one document")
    error = cli_error_of(capsys, "preprocess", "--input", corpus, "--output-prefix", prefix)
    shown = prefix or "''"
    assert error.startswith(f"error: output prefix {shown} names a directory, not the files (e.g.")
    with pytest.raises(PreprocessError, match=r"output prefix \.\. names a directory"):
        preprocess_corpus(CorpusRun([corpus], Path("..")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wiki.jsonl"]


def test_an_input_that_is_one_of_the_outputs_files_is_refused(tmp_path, capsys):
    """``--input c/wiki.json --output-prefix c/wiki`` replaced the input with the
    dataset's metadata and exited 0."""
    corpus = _corpus_file(tmp_path / "wiki.json", "one document")
    before = Path(corpus).read_bytes()
    prefix = str(tmp_path / "wiki")
    assert cli_error_of(capsys, "preprocess", "--input", corpus, "--output-prefix", prefix) == (
        f"error: input {corpus} is {prefix}.json, which --output-prefix {prefix} writes: "
        "the run would overwrite it; give another prefix"
    )
    assert Path(corpus).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wiki.json"]
    (tmp_path / "data.parts").mkdir()
    receipt = _corpus_file(tmp_path / "data.parts" / "units" / "000000.json", "x")
    with pytest.raises(PreprocessError, match=rf"input {receipt} is in {tmp_path}/data.parts/"):
        preprocess_corpus(CorpusRun([receipt], tmp_path / "data"))


@pytest.mark.parametrize("given", ["directory", "glob"])
def test_a_directory_or_glob_leaves_out_the_outputs_own_files(tmp_path, given):
    """An output beside its inputs: the rerun found PREFIX.json, PREFIX.manifest.json and
    the receipts in PREFIX.parts/ as four new inputs and refused to continue ("other
    settings"); with --overwrite it tokenized its own outputs."""
    _corpus_file(tmp_path / "d" / "a.jsonl", "hello world", "second doc")
    inputs = [str(tmp_path / "d") if given == "directory" else f"{tmp_path}/d/**/*.json*"]
    run = CorpusRun(inputs, tmp_path / "d" / "out")
    first = preprocess_corpus(run)
    (tmp_path / "d" / "out.tmp-0123456789ab.json").write_text("{}")  # a stopped run's
    assert preprocess_corpus(run).lines == [
        f"removed {tmp_path}/d/out.tmp-0123456789ab.json: left by a run that stopped before "
        "publishing",
        f"{tmp_path}/d/out.bin/.idx are up to date: nothing to do",
    ]
    again = preprocess_corpus(CorpusRun(inputs, tmp_path / "d" / "out", overwrite=True))
    assert again.metadata == first.metadata
    assert again.metadata.num_documents == 2


def test_a_glob_character_in_the_prefix_removes_only_its_own_stale_temporaries(tmp_path):
    """Stale merges were found with the prefix as a glob pattern: 'out[1]' removed
    another run's out1.tmp-* file."""
    corpus = _corpus_file(tmp_path / "a.jsonl", "hello world")
    others = tmp_path / "out1.tmp-aaaaaaaaaaaa.bin"
    own = tmp_path / "out[1].tmp-bbbbbbbbbbbb.bin"
    others.touch()
    own.touch()
    lines = preprocess_corpus(CorpusRun([corpus], tmp_path / "out[1]")).lines
    assert f"removed {own}: left by a run that stopped before publishing" in lines
    assert others.exists() and not own.exists()


@pytest.mark.parametrize("limit", ["inf", "1e400", "nan", "-inf"])
def test_a_bad_record_limit_that_is_no_number_is_refused_before_any_work(tmp_path, capsys, limit):
    """'inf' (or 1e400) ended in an OverflowError traceback, and --submit wrote it into
    the job's script for the job to fail on."""
    corpus = _corpus_file(tmp_path / "a.jsonl", "hello world")
    (tmp_path / "cluster.yaml").write_text("cluster:\n  partition: cpu\n")
    expected = (
        f"error: --max-bad-records {limit}: give a count (10) or a fraction of the records (0.001)"
    )
    prep = ["preprocess", "--input", corpus, "--output-prefix", str(tmp_path / "out")]
    assert cli_error_of(capsys, *prep, f"--max-bad-records={limit}") == expected
    submit = ["--submit", str(tmp_path / "cluster.yaml"), "--dry-run"]
    assert cli_error_of(capsys, *prep, f"--max-bad-records={limit}", *submit) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "cluster.yaml"]


def test_a_tokenizer_file_the_library_does_not_read_is_refused(tmp_path, capsys):
    """--tokenizer-model (or --tokenizer-type) without the library that reads it was
    ignored: the run tokenized bytes and exited 0."""
    corpus = _corpus_file(tmp_path / "a.jsonl", "hello world")
    prep = ["preprocess", "--input", corpus, "--output-prefix", str(tmp_path / "out")]
    assert cli_error_of(capsys, *prep, "--tokenizer-model", "anything.model") == (
        "error: --tokenizer-model anything.model: --tokenizer-library byte does not read it "
        "(--tokenizer-library sentencepiece does)"
    )
    sentencepiece = ["--tokenizer-library", "sentencepiece", "--tokenizer-model", "m.model"]
    assert cli_error_of(capsys, *prep, *sentencepiece, "--tokenizer-type", "hf-dir") == (
        "error: --tokenizer-type hf-dir: --tokenizer-library sentencepiece does not read it "
        "(--tokenizer-library huggingface does)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


def test_overwrite_starts_over_from_a_plan_that_cannot_be_read(tmp_path):
    """An unreadable PREFIX.parts/plan.json was refused with '--overwrite starts over'
    although --overwrite was given: the plan was read before the option was looked at."""
    corpus = _corpus_file(tmp_path / "a.jsonl", "hello world", "second doc")
    (tmp_path / "out.parts").mkdir()
    (tmp_path / "out.parts" / "plan.json").write_text("[]\n")
    with pytest.raises(PreprocessError, match=r"plan.json is not a plan .*: --overwrite starts"):
        preprocess_corpus(CorpusRun([corpus], tmp_path / "out"))
    lines = preprocess_corpus(CorpusRun([corpus], tmp_path / "out", overwrite=True)).lines
    assert (
        lines[0]
        == f"{tmp_path}/out.parts/plan.json is not a plan this version can read: started over"
    )
    assert lines[-1].startswith(f"wrote {tmp_path}/out.bin/.idx: 2 documents")
    assert preprocess_corpus(CorpusRun([corpus], tmp_path / "out")).lines == [
        f"{tmp_path}/out.bin/.idx are up to date: nothing to do"
    ]


@pytest.mark.parametrize(
    "receipt", ["[]\n", '{"unit": null}\n', "receipt"], ids=["list", "no-unit", "not-json"]
)
def test_a_receipt_that_is_not_one_makes_its_unit_redone(tmp_path, receipt):
    """A unit receipt holding a JSON list ended the rerun in an AttributeError traceback."""
    first = _corpus_file(tmp_path / "in" / "1.jsonl", "hello world", "second doc")
    second = _corpus_file(tmp_path / "in" / "2.jsonl", "third doc")
    run = CorpusRun([first, second], tmp_path / "out")
    expected = preprocess_corpus(run).metadata
    (tmp_path / "out.parts" / "units" / "000000.json").write_text(receipt)
    _unpublish(tmp_path / "out")
    outcome = preprocess_corpus(run)
    assert outcome.lines[0] == "resumed: 1 of 2 units were done before"
    assert outcome.metadata == expected


def test_a_receipt_without_a_figure_the_merge_sums_makes_its_unit_redone(tmp_path):
    corpus = _corpus_file(tmp_path / "in" / "1.jsonl", "hello world", "second doc")
    run = CorpusRun([corpus], tmp_path / "out")
    expected = preprocess_corpus(run).metadata
    path = tmp_path / "out.parts" / "units" / "000000.json"
    receipt = json.loads(path.read_text())
    del receipt["documents"]
    path.write_text(json.dumps(receipt))
    _unpublish(tmp_path / "out")
    outcome = preprocess_corpus(run)
    assert not outcome.lines[0].startswith("resumed")
    assert outcome.metadata == expected


def _parquet_with(path: Path, junk_at: int | None) -> str:
    """Ten documents in parquet; with ``junk_at``, eight zero bytes written there (a
    negative offset counts from the footer's start)."""
    pq.write_table(pa.table({"text": ["a document"] * 10}), path)
    data = bytearray(path.read_bytes())
    if junk_at is not None:
        footer = len(data) - 8 - struct.unpack("<i", data[-8:-4])[0]
        start = footer + junk_at + 1 if junk_at < 0 else junk_at
        data[start : start + 8] = b"\0" * 8
    path.write_bytes(bytes(data))
    return str(path)


def test_parquet_that_cannot_be_read_is_one_line(tmp_path, capsys):
    """Duplicate column names ended in a KeyError traceback; pyarrow's messages with
    newlines (thrift's line, then pyarrow's) made the error two or three lines."""
    table = pa.Table.from_arrays([pa.array(["a", "b"]), pa.array(["c", "d"])], ["text", "text"])
    pq.write_table(table, tmp_path / "twice.parquet")
    footer = _parquet_with(tmp_path / "footer.parquet", -1)
    page = _parquet_with(tmp_path / "page.parquet", 4)
    for corpus, message in [
        (tmp_path / "twice.parquet", "2 columns are named 'text': which one holds the text"),
        (footer, "not a readable parquet file (Couldn't deserialize thrift: "),
        (page, "cannot read parquet row 1 on (Couldn't deserialize thrift: "),
    ]:
        out = str(tmp_path / "out" / Path(corpus).stem)
        error = cli_error_of(capsys, "preprocess", "--input", str(corpus), "--output-prefix", out)
        assert error.startswith(f"error: {corpus}: {message}"), error
    assert "; Deserializing page header failed.)" in error


def test_a_corpus_without_a_document_publishes_nothing(tmp_path, capsys):
    """Every record bad but within --max-bad-records: a dataset of 0 documents was
    published with exit status 0 (preprocess() of documents in memory refused it)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    out = tmp_path / "out" / "e"
    args = ["--input", str(bad), "--output-prefix", str(out), "--max-bad-records", "5"]
    assert main(["preprocess", *args, "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: no documents in {bad}: every record is bad (1, listed in "
        f"{out}.parts/units/*.json); nothing published"
    )
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["e.parts"]
    blank = tmp_path / "blank.txt"  # in byte ranges, none of which is a whole empty file
    blank.write_text("\n" * 10_000)
    run = CorpusRun([str(blank)], tmp_path / "out" / "blank", unit_bytes=4096)
    with pytest.raises(PreprocessError, match=r"blank.txt: the input is empty; nothing publ"):
        preprocess_corpus(run)
    assert not Path(f"{tmp_path}/out/blank.bin").exists()


@pytest.mark.parametrize("suffix", [".bz2", ".xz"])
def test_a_compression_that_is_not_read_is_refused_by_name(tmp_path, suffix):
    """A .jsonl.bz2 (or .xz) was read as text: its compressed bytes became documents (or
    bad records), and a directory left it out without a word."""
    compressed = tmp_path / "in" / f"a.jsonl{suffix}"
    compressed.parent.mkdir()
    compressed.write_bytes(b"BZh91AY&SY\x00\x01")
    name = {".bz2": "bzip2", ".xz": "xz"}[suffix]
    message = rf"^{compressed}: {name} compression is not read; decompress the file, or "
    for given in (compressed, compressed.parent):
        with pytest.raises(PreprocessError, match=message):
            preprocess_corpus(CorpusRun([str(given)], tmp_path / "out"))
    assert not (tmp_path / "out.parts").exists()


def test_a_published_dataset_cut_short_is_not_up_to_date(tmp_path, capsys):
    """The digest of its plan said up to date for a PREFIX.bin truncated after it was
    published (an interrupted copy): training would then fail on it, every rank."""
    corpus = _corpus_file(tmp_path / "in" / "a.jsonl", "one document", "another document")
    prefix = tmp_path / "out" / "x"
    arguments = ["preprocess", "--input", corpus, "--output-prefix", str(prefix), "--quiet"]
    assert main(arguments) == 0
    whole = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(whole[:10])
    error = cli_error_of(capsys, *arguments)
    assert error.startswith(f"error: {prefix}.bin is cut short: 10 bytes where {prefix}.idx")
    assert error.endswith(f"(--overwrite writes {prefix}.bin/.idx again)")
    assert main([*arguments, "--overwrite"]) == 0
    assert Path(f"{prefix}.bin").read_bytes() == whole


def test_a_glob_takes_every_file_it_matches_but_the_outputs(tmp_path):
    """A glob names its files itself: extensionless shards are read as text, as before the
    output's own files were left out of globs; only those are."""
    for name in ("shard-0", "shard-1"):
        (tmp_path / name).write_text("a document\n")
    prefix = tmp_path / "shard-out"
    assert expand_inputs([str(tmp_path / "shard-*")], prefix) == [
        tmp_path / "shard-0",
        tmp_path / "shard-1",
    ]
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "shard-*"),
                "--output-prefix",
                str(prefix),
                "--quiet",
            ]
        )
        == 0
    )
    assert expand_inputs([str(tmp_path / "shard-*")], prefix) == [
        tmp_path / "shard-0",
        tmp_path / "shard-1",
    ]
