"""The command line as a Unix tool: output into a pipe whose reader has gone; bad paths
and flags named in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, cli_error_of

DEMO = ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`submit ... --dry-run | head -1`: the reader leaves after one line; Python ignores
    SIGPIPE, so the write raises BrokenPipeError, which must not become a traceback."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes
    try:
        result = subprocess.run(
            [sys.executable, "-m", "megatron_lns.cli", "submit", str(DEMO), "--dry-run"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            env=env,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141  # 128 + SIGPIPE, as a shell reports `cat big | head`


def test_a_path_of_the_wrong_kind_is_not_said_not_to_exist(tmp_path, capsys):
    """Every command that takes a file or a directory: one that exists but is the other
    kind was reported as "does not exist"."""
    folder, plain = tmp_path / "folder", tmp_path / "plain.txt"
    folder.mkdir()
    plain.write_text("x\n")
    (tmp_path / "prefix.bin").mkdir()
    (tmp_path / "prefix.idx").write_text("")
    out = str(tmp_path / "out")
    cases = {
        ("train", str(DEMO), "model.tokenizer.library=sentencepiece",
         f"model.tokenizer.model={folder}", "--dry-run"):
            f"model.tokenizer.model: {folder} is a directory, not a file",
        ("train", str(DEMO), f"model.data.data_prefix=[{tmp_path / 'prefix'}]", "--dry-run"):
            f"model.data.data_prefix: {tmp_path / 'prefix.bin'} is a directory, not a file",
        ("train", str(DEMO), f"model.data.data_prefix=[{folder}]", "--dry-run"):
            f"model.data.data_prefix: {folder}.bin does not exist ({folder} is a directory",
        ("preprocess", "--input", str(plain), "--output-prefix", out,
         "--tokenizer-library", "sentencepiece", "--tokenizer-model", str(folder)):
            f"SentencePiece model {folder} is a directory, not a file",
        ("preprocess", "--input", str(plain), "--output-prefix", out,
         "--tokenizer-library", "huggingface", "--tokenizer-type", str(plain)):
            f"Hugging Face tokenizer directory {plain} is a file, not a directory",
        ("import-hf", str(plain), out): f"Hugging Face directory {plain} is a file, not a directory",
    }  # fmt: skip
    for args, expected in cases.items():
        assert cli_error_of(capsys, *args).startswith(f"error: {expected}"), args


def test_userbuffer_settings_and_config_files_that_are_directories(tmp_path):
    import pytest

    from megatron_lns.config import ConfigError, load_config
    from megatron_lns.config.userbuffers import UserbufferSettingsError, read_userbuffer_settings

    with pytest.raises(UserbufferSettingsError, match="is a directory, not a file"):
        read_userbuffer_settings(tmp_path, "model.ub_tp_comm_overlap_cfg")
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory, not a file"):
        load_config(tmp_path)


def test_preprocess_refuses_outputs_it_could_not_write_as_named(tmp_path, capsys):
    """``--output-prefix data/newdir/`` wrote data/newdir.bin and reported
    data/newdir/.bin; a PREFIX.bin that is a directory ended in IsADirectoryError after
    tokenizing, with PREFIX.bin of other suffixes already renamed into place; a missing
    --tokenizer-type was named as model.tokenizer.type."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one document\nanother\n")
    (tmp_path / "taken.idx").mkdir()
    prep = ("preprocess", "--input", str(corpus), "--quiet", "--workers", "1", "--output-prefix")
    newdir = f"{tmp_path / 'newdir'}/"
    assert cli_error_of(capsys, *prep, newdir) == (
        f"error: output prefix {newdir} ends in '/': it names the files, not a directory "
        f"(e.g. {newdir}corpus writes {newdir}corpus.bin)"
    )
    assert cli_error_of(capsys, *prep, str(tmp_path / "taken")) == (
        f"error: cannot write {tmp_path / 'taken.idx'}: it is a directory"
    )
    # Under a file: it said "cannot create ...: File exists".
    under_a_file = corpus / "sub" / "out"
    assert cli_error_of(capsys, *prep, str(under_a_file)) == (
        f"error: cannot write {under_a_file}.bin: {corpus} is a file, not a directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "taken.idx"]
    library = (*prep, str(tmp_path / "x"), "--tokenizer-library")
    assert cli_error_of(capsys, *library, "huggingface") == (
        "error: --tokenizer-library huggingface needs --tokenizer-type (a local tokenizer "
        "directory)"
    )
    assert cli_error_of(capsys, *library, "sentencepiece") == (
        "error: --tokenizer-library sentencepiece needs --tokenizer-model (a .model file)"
    )


def _command_names() -> set[str]:
    from megatron_lns.cli import COMMANDS

    return {module.__name__.rsplit(".", 1)[1].replace("_", "-") for module in COMMANDS}


def _bad_input_of_every_command(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """For each command: arguments a user gets wrong, and what its one line must name."""
    missing, out = str(tmp / "missing"), str(tmp / "out")
    return {
        "train": (
            ["train", "tiny_cpu_demo", "model.no_such_key=1", "--dry-run"],
            "model.no_such_key",
        ),
        "plan": (["plan", "tiny_cpu_demo", "--gpu", "X100"], "--gpu X100"),
        "submit": (
            ["submit", "tiny_cpu_demo", "model.tensor_model_parallel_size=3", "--dry-run"],
            "model.tensor_model_parallel_size",
        ),
        "compare": (
            ["compare", "tiny_cpu_demo", "model.hidden_size=abc", "--dry-run"],
            "model.hidden_size",
        ),
        "demo": (["demo", "model.hidden_size=abc", "--dry-run"], "model.hidden_size"),
        "preprocess": (["preprocess", "--input", missing, "--output-prefix", out], missing),
        "export-hf": (["export-hf", missing, out], missing),
        "import-hf": (["import-hf", missing, out], missing),
        "analyze": (["analyze", missing], missing),
        "status": (["status", missing], missing),
    }


def test_every_command_answers_bad_input_in_one_line(tmp_path, capsys):
    """Each command of ``megatron-lns``, a new one included (the case list must name it),
    answers a user's mistake with one ``error:`` line naming it, exit 2, and no output."""
    cases = _bad_input_of_every_command(tmp_path)
    assert set(cases) == _command_names()
    for command, (args, named) in cases.items():
        line = cli_error_of(capsys, *args)
        assert named in line, (command, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_every_preprocess_flag_is_in_its_docs():
    """``preprocess --quiet`` was in no doc: each flag is named in docs/preprocessing.md
    or docs/data.md (where the tokenizer flags are shown)."""
    from megatron_lns.cli import build_parser

    parser = build_parser()
    [commands] = [a for a in parser._actions if a.dest == "command"]
    docs = "".join((ROOT / "docs" / name).read_text() for name in ("preprocessing.md", "data.md"))
    flags = [o for a in commands.choices["preprocess"]._actions for o in a.option_strings]
    assert [f for f in flags if f.startswith("--") and f != "--help" and f not in docs] == []
