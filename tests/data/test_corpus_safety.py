"""Corpus preprocessing that must not lose data or drop what the user asked: an output
prefix that names a directory, outputs that are inputs, options a run would not use,
plans and receipts that cannot be read, corpora without a document.

Each case is one line ``error: ...`` (exit code 2) that names the problem, or a run that
does what was asked; none leaves a file that a later run would take for finished work.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli_error_of

from megatron_lns.cli import main
from megatron_lns.data.preprocess import CorpusRun, PreprocessError, preprocess_corpus


def _corpus_file(path: Path, *texts: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def _preprocess(*args: str) -> int:
    return main(["preprocess", "--quiet", "--workers", "1", *args])


@pytest.mark.parametrize("prefix", [".", "", "..", "data/.", "data/.."])
def test_an_output_prefix_that_names_a_directory_is_refused(tmp_path, capsys, prefix, monkeypatch):
    """``--output-prefix .`` (or '') ended in a ValueError traceback: PREFIX.parts is
    made by adding to the prefix's name, and a directory's alias has none."""
    monkeypatch.chdir(tmp_path)
    corpus = _corpus_file(tmp_path / "wiki.jsonl", "one document")
    error = cli_error_of(capsys, "preprocess", "--input", corpus, "--output-prefix", prefix)
    shown = prefix or "''"
    assert error.startswith(f"error: output prefix {shown} ")
    assert "it names the files, not a directory" in error
    with pytest.raises(PreprocessError, match=r"output prefix \.\. names a directory"):
        preprocess_corpus(CorpusRun([corpus], Path("..")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wiki.jsonl"]
