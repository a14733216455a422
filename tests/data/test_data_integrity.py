"""Data that changes or breaks: re-preprocessed prefixes never meet stale index caches,
bad preprocess input names its file and line, and an interrupted preprocess leaves
nothing behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    byte_gpt_datasets,
    end_by_signal,
    fresh_launch_env,
    killed_on_exit,
    read_only,
    wait_while_running,
)

import megatron_lns.data.blend as blend
from megatron_lns.cli import main
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.errors import DataError
from megatron_lns.data.preprocess import (
    CorpusRun,
    PreprocessError,
    preprocess,
    preprocess_corpus,
    read_documents,
)

DOCS = demo_documents()[:400]


def _samples(prefix, cache_dir, count=12):
    splits = byte_gpt_datasets([prefix], cache=cache_dir, seed=5)
    return [np.asarray(splits.train[i]["tokens"]).tolist() for i in range(count)]


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


@pytest.mark.parametrize("index_cache", ["index_mapping_dir", "megatron default"])
def test_a_re_preprocessed_prefix_never_uses_stale_index_mappings(tmp_path, index_cache):
    """Corpus B has as many documents as corpus A but other lengths: after B replaces A
    under the same prefix, samples are exactly those of B built with no cache at all."""
    corpus_a, corpus_b = DOCS[:150], DOCS[150:300]
    assert [len(d) for d in corpus_a] != [len(d) for d in corpus_b]
    prefix = tmp_path / "data" / "corpus"
    cache = tmp_path / "index_cache" if index_cache == "index_mapping_dir" else None
    cached_files = cache or Path(f"{prefix}") / "cache"

    preprocess(corpus_a, prefix)
    from_a = _samples(prefix, cache)
    assert any(cached_files.rglob("*description.txt"))  # the cache was written

    preprocess(corpus_b, prefix)
    from_b = _samples(prefix, cache)
    preprocess(corpus_b, tmp_path / "fresh" / "corpus")
    assert from_b == _samples(tmp_path / "fresh" / "corpus", tmp_path / "fresh_cache")
    assert from_b != from_a
    assert from_b == _samples(prefix, cache)  # and B's own mappings are reused


def test_an_index_mapping_cut_short_is_named(tmp_path):
    preprocess(DOCS[:100], tmp_path / "corpus")
    _samples(tmp_path / "corpus", tmp_path / "cache")
    (shuffle,) = (tmp_path / "cache").glob("*-train-shuffle_index.npy")
    shuffle.write_bytes(shuffle.read_bytes()[:100])  # as a run killed mid-write leaves it
    with pytest.raises(DataError, match=r"cannot read the cached index mapping .*-train-\*"):
        _samples(tmp_path / "corpus", tmp_path / "cache")


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", b'{"text": "ok"}\n{"text": "cut\n', r"bad.jsonl:2: not valid JSON"),
        ("key.jsonl", b'{"text": "ok"}\n\n{"body": "x"}\n', r"key.jsonl:3: no 'text' key"),
        ("type.jsonl", b'{"text": "ok"}\n{"text": 42}\n', r"type.jsonl:2: 'text' is int, not"),
        ("null.jsonl", b'{"text": null}\n', r"null.jsonl:1: 'text' is null, not a string"),
        ("list.jsonl", b'["text"]\n', r"list.jsonl:1: expected a JSON object, got list"),
        (
            "latin1.txt",
            b"fine\ncaf\xe9\n",
            r"latin1.txt:2: not UTF-8 text \(byte 0xe9 at column 4\)",
        ),
        (
            "surrogate.jsonl",
            b'{"text": "\\ud800"}\n',
            r"surrogate.jsonl:1: not valid JSON \(no low surrogate in string\)",
        ),
        ("empty.jsonl", b"", r"no documents in .*empty.jsonl: the input is empty"),
        ("blank.txt", b"\n  \n\n", r"no documents in .*blank.txt: the input is empty"),
        ("latin1.jsonl", b'{"text": "caf\xe9"}\n', r"latin1.jsonl:1: not UTF-8 text"),
    ],
)
def test_bad_preprocess_input_names_file_and_line(tmp_path, name, content, message):
    path = _write(tmp_path / name, content)
    with pytest.raises(PreprocessError, match=message):
        list(read_documents([path]))
    with pytest.raises(PreprocessError, match=message):
        preprocess(read_documents([path]), tmp_path / "out" / "data")
    assert not (tmp_path / "out" / "data.bin").exists()
    assert _leftovers(tmp_path / "out") == []


@pytest.mark.slow
def test_bad_input_found_while_tokenizing_in_worker_processes(tmp_path):
    path = _write(tmp_path / "late.jsonl", b"".join([b'{"text": "doc"}\n'] * 500) + b"{\n")
    out = tmp_path / "out" / "data"
    with pytest.raises(PreprocessError, match=r"late.jsonl:501: not valid JSON"):
        preprocess_corpus(CorpusRun([str(path)], out, workers=2, unit_bytes=4096))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["data.parts"]
    assert not list((tmp_path / "out").glob("data.parts/units/*.tmp-*"))


TOLERATE = "(--max-bad-records N tolerates up to N bad records)"
SUFFIXES = "(.jsonl, .json, .ndjson, .parquet, .txt, optionally .gz or .zst)"


def test_the_cli_prints_preprocess_errors_as_one_line(tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", b'{"text": "ok"}\n{"text": 1.5}\n')
    directory = tmp_path / "a_directory"
    directory.mkdir()
    out = str(tmp_path / "out")
    for inputs, expected in [
        ([str(bad)], f"error: {bad}:2: 'text' is float, not a string {TOLERATE}"),
        ([str(directory)], f"error: input directory {directory} holds no data files {SUFFIXES}"),
    ]:
        code = main(["preprocess", "--input", *inputs, "--output-prefix", out, "--quiet"])
        assert (code, capsys.readouterr().err.strip()) == (2, expected)
    locked = tmp_path / "read_only"
    locked.mkdir()
    with read_only(locked):
        code = main(["preprocess", "--input", str(bad), "--output-prefix", f"{locked}/x"])
    assert code == 2
    assert capsys.readouterr().err.strip() in (
        f"error: cannot write to {locked}: permission denied",
        f"error: cannot write to {locked}: read-only file system",
    )
    code = main(
        ["preprocess", "--input", str(bad), "--output-prefix", out, "--tokenizer-library",
         "huggingface", "--quiet"]
    )  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.startswith("error: --tokenizer-library huggingface needs")


class Boom(RuntimeError):
    pass


def _failing_documents(after: int):
    for i, doc in enumerate(DOCS):
        if i == after:
            raise Boom("stopped midway")
        yield doc


def test_an_error_midway_leaves_no_temporary_files_and_keeps_the_old_dataset(tmp_path):
    prefix = tmp_path / "corpus"
    preprocess(DOCS[:20], prefix)
    before = {s: Path(f"{prefix}{s}").read_bytes() for s in (".bin", ".idx", ".json")}
    with pytest.raises(Boom):
        preprocess(_failing_documents(300), prefix)
    assert {s: Path(f"{prefix}{s}").read_bytes() for s in before} == before
    assert _leftovers(tmp_path) == []


def test_builtin_corpus_prepared_concurrently_or_interrupted(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_LNS_CACHE", str(tmp_path))
    calls = []

    def corpus():
        calls.append(1)
        if len(calls) == 1:
            return _failing_documents(100)  # the first preparation is interrupted
        return iter(DOCS[:300])

    monkeypatch.setitem(blend.BUILTIN_CORPORA, "small", corpus)
    with pytest.raises(Boom):
        blend.builtin_dataset_prefix("small", "byte", None, None)
    assert list(tmp_path.iterdir()) == []  # nothing that looks prepared

    results, errors = [], []

    def prepare():
        try:
            results.append(blend.builtin_dataset_prefix("small", "byte", None, None))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=prepare) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == [] and len(set(results)) == 1
    prefix = results[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{prefix.name}{s}" for s in (".bin", ".idx", ".json")
    )
    assert json.loads(Path(f"{prefix}.json").read_text())["num_documents"] == 300
    prepared = len(calls)
    assert blend.builtin_dataset_prefix("small", "byte", None, None) == prefix
    assert len(calls) == prepared  # cached now


def test_a_malformed_dataset_description_is_named(tmp_path):
    from megatron_lns.data.preprocess import DatasetMetadata

    preprocess(DOCS[:5], tmp_path / "corpus")
    (tmp_path / "corpus.json").write_text("{not json")
    with pytest.raises(DataError, match=r"corpus.json is not a megatron-lns dataset description"):
        DatasetMetadata.load(tmp_path / "corpus")


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_midway_leaves_no_files(tmp_path, signum):
    script = textwrap.dedent(
        f"""
        import itertools, sys, time
        from megatron_lns.data.preprocess import preprocess
        from megatron_lns.base.exit_status import exit_status

        def endless():
            for i in itertools.count():
                time.sleep(0.001)
                yield f"document {{i}} " * 20

        # As the command line ends: CPython's own exit on an uncaught KeyboardInterrupt
        # (by SIGINT) is lost once torch._dynamo has been imported: it exits 1.
        sys.exit(exit_status(lambda: preprocess(endless(), {str(tmp_path / "corpus")!r})))
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        env=fresh_launch_env(PYTHONPATH=os.pathsep.join(sys.path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with killed_on_exit(process):
        wait_while_running(process, lambda: bool(_leftovers(tmp_path)), 240,
                           "preprocess did not start")  # fmt: skip
        end_by_signal(process, signum, 120)
    assert list(tmp_path.iterdir()) == []


def _resolve_missing_builtin() -> str:
    from megatron_lns.data.blend import DataBlend
    from megatron_lns.runtime import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(), device="cpu")
    try:
        DataBlend.parse(["builtin:nope"]).resolved("byte", None, None)
    except DataError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_a_failed_builtin_preparation_on_rank_zero_stops_every_rank(tmp_path):
    from helpers import run_distributed

    messages = run_distributed(_resolve_missing_builtin, 2, tmp_path)
    assert messages[0].startswith("unknown built-in corpus 'builtin:nope'")
    assert messages[1] == f"rank 0 could not prepare the built-in corpus: {messages[0]}"
