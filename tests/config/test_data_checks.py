"""What a run's data and tokenizer must satisfy is checked before any rank starts: by
``train --dry-run``, by ``submit`` before sbatch (on SLURM, before the queue) and by
``train`` itself, each with one line naming the key; these used to pass all three and
fail only once the ranks built their datasets."""

import json

import pytest
from helpers import DEMO_CONFIG, config_error, hugging_face_tokenizer_dir

from megatron_lns.cli import main
from megatron_lns.config.data_checks import dataset_num_samples
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.preprocess import preprocess
from megatron_lns.data.splits import split_bookends


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Byte-tokenized corpora of 5 and 200 documents."""
    root = tmp_path_factory.mktemp("corpora")
    preprocess(demo_documents()[:5], root / "small")
    preprocess(demo_documents()[:200], root / "big")
    return root


def _refusals(tmp_path, monkeypatch, capsys, *overrides):
    """The error line of ``train --dry-run``, ``submit`` and ``train`` with ``overrides``,
    each of which must exit 2 before anything is written or submitted."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-sbatch-here"))  # submit never gets there
    args = [str(DEMO_CONFIG), f"exp_manager.exp_dir={tmp_path / 'runs'}", *overrides]
    lines = []
    for command in (["train", *args, "--dry-run"], ["submit", *args], ["train", *args]):
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        lines.append(err[0])
    assert lines[0] == lines[1] == lines[2]
    assert not (tmp_path / "runs").exists()
    return lines[0]


@pytest.mark.parametrize(
    "split, expected",
    [
        ("0,100,0", "model.data.splits_string must be three comma-separated non-negative"),
        ("0,1,1", "the first (train) positive"),
    ],
)
def test_a_split_without_a_training_share(tmp_path, monkeypatch, capsys, split, expected):
    message = _refusals(tmp_path, monkeypatch, capsys, f"model.data.splits_string={split}")
    assert expected in message


def test_an_unknown_builtin_corpus(tmp_path, monkeypatch, capsys):
    message = _refusals(tmp_path, monkeypatch, capsys, "model.data.data_prefix=[builtin:wiki]")
    assert message == (
        "error: model.data.data_prefix: unknown built-in corpus 'builtin:wiki'; available: "
        "builtin:pydoc"
    )


def test_a_file_that_is_not_a_sentencepiece_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "tok.model").write_text("not a model\n")
    message = _refusals(
        tmp_path, monkeypatch, capsys,
        "model.tokenizer.library=sentencepiece", f"model.tokenizer.model={tmp_path}/tok.model",
    )  # fmt: skip
    assert message.startswith(
        f"error: model.tokenizer.model: cannot load SentencePiece model {tmp_path}/tok.model: "
    )


@pytest.mark.parametrize(
    "files, expected",
    [
        ({}, "holds no tokenizer files (tokenizer.json, tokenizer_config.json"),
        ({"config.json": "{}"}, "holds no tokenizer files (tokenizer.json, tokenizer_config"),
        ({"tokenizer.json": "{not json"}, "cannot load a Hugging Face tokenizer from"),
        ({"tokenizer_config.json": "[1"}, "tokenizer_config.json is not valid JSON"),
    ],
    ids=["empty", "model-only", "bad-tokenizer-json", "bad-config-json"],
)
def test_a_hugging_face_directory_that_does_not_load(
    tmp_path, monkeypatch, capsys, files, expected
):
    directory = tmp_path / "tok"
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_text(text)
    message = _refusals(
        tmp_path, monkeypatch, capsys,
        "model.tokenizer.library=huggingface", f"model.tokenizer.type={directory}",
    )  # fmt: skip
    assert message.startswith(f"error: model.tokenizer.type: {directory}")
    assert expected in message


def test_a_hugging_face_file_instead_of_a_directory(tmp_path, monkeypatch, capsys):
    directory = hugging_face_tokenizer_dir(tmp_path)
    message = _refusals(
        tmp_path, monkeypatch, capsys,
        "model.tokenizer.library=huggingface", f"model.tokenizer.type={directory}/tokenizer.json",
    )  # fmt: skip
    assert "is a file, not a directory: give the directory save_pretrained wrote" in message


def test_data_from_another_tokenizer(tmp_path, monkeypatch, capsys, corpora):
    directory = tmp_path / "tok"
    directory.mkdir()
    hugging_face_tokenizer_dir(directory)
    message = _refusals(
        tmp_path, monkeypatch, capsys,
        f"model.data.data_prefix=[{corpora}/big]",
        "model.tokenizer.library=huggingface", f"model.tokenizer.type={directory}",
    )  # fmt: skip
    assert message == (
        f"error: model.data.data_prefix: dataset {corpora}/big was tokenized with byte (vocab "
        f"257) but model.tokenizer is huggingface:{directory}"
    )


def test_data_with_another_vocabulary_size(tmp_path, monkeypatch, capsys, corpora):
    for suffix in (".bin", ".idx"):
        (tmp_path / f"big{suffix}").write_bytes((corpora / f"big{suffix}").read_bytes())
    metadata = json.loads((corpora / "big.json").read_text())
    (tmp_path / "big.json").write_text(json.dumps({**metadata, "vocab_size": 300}))
    message = _refusals(tmp_path, monkeypatch, capsys, f"model.data.data_prefix=[{tmp_path}/big]")
    assert message == (
        f"error: model.data.data_prefix: dataset {tmp_path}/big was tokenized with byte (vocab "
        "300) but model.tokenizer is byte (vocab 257)"
    )


def test_a_corpus_too_small_for_its_split(tmp_path, monkeypatch, capsys, corpora):
    message = _refusals(tmp_path, monkeypatch, capsys, f"model.data.data_prefix=[{corpora}/small]")
    assert message == (
        f"error: model.data.data_prefix: the valid split of {corpora}/small (split '95,5,0') gets "
        "0 of its 5 documents and megatron would loop forever building it: give at least 11 "
        "documents, or a larger valid share (e.g. split '90,10,0')"
    )


def test_an_unweighted_blend_whose_prefix_holds_less_than_one_sample(
    tmp_path, monkeypatch, capsys, corpora
):
    message = _refusals(
        tmp_path, monkeypatch, capsys,
        f"model.data.data_prefix=[{corpora}/small,{corpora}/big]",
        "model.data.splits_string=90,10,0",
    )  # fmt: skip
    assert message.startswith(
        f"error: model.data.data_prefix: the valid split of {corpora}/small (split '90,10,0') "
        "holds "
    )
    assert "less than one sample of 129" in message


def test_an_index_file_in_another_format(tmp_path, monkeypatch, capsys, corpora):
    (tmp_path / "x.bin").write_bytes(b"")
    (tmp_path / "x.idx").write_bytes(b"not an index")
    message = _refusals(tmp_path, monkeypatch, capsys, f"model.data.data_prefix=[{tmp_path}/x]")
    assert message == (
        f"error: model.data.data_prefix: {tmp_path}/x.idx is not a megatron index file "
        "(no MMIDIDX header): preprocess the data again"
    )


def test_a_token_file_cut_short(tmp_path, monkeypatch, capsys, corpora):
    (tmp_path / "big.idx").write_bytes((corpora / "big.idx").read_bytes())
    (tmp_path / "big.bin").write_bytes((corpora / "big.bin").read_bytes()[:1000])
    message = _refusals(tmp_path, monkeypatch, capsys, f"model.data.data_prefix=[{tmp_path}/big]")
    assert message.startswith(
        f"error: model.data.data_prefix: {tmp_path}/big.bin is cut short: 1000 bytes where "
    )


def test_an_index_file_cut_short_past_its_lengths(tmp_path, monkeypatch, capsys, corpora):
    """Its lengths whole, its document indices cut: megatron failed in every rank."""
    (tmp_path / "big.bin").write_bytes((corpora / "big.bin").read_bytes())
    (tmp_path / "big.idx").write_bytes((corpora / "big.idx").read_bytes()[:-8])
    message = _refusals(tmp_path, monkeypatch, capsys, f"model.data.data_prefix=[{tmp_path}/big]")
    assert message.startswith(f"error: model.data.data_prefix: {tmp_path}/big.idx is cut short: ")


def test_data_that_fits_passes(tmp_path, monkeypatch, capsys, corpora):
    monkeypatch.chdir(tmp_path)
    args = [f"model.data.data_prefix=[{corpora}/big]", f"exp_manager.exp_dir={tmp_path}/runs"]
    assert main(["train", str(DEMO_CONFIG), *args, "--dry-run"]) == 0


@pytest.mark.parametrize("split", ["949,50,1", "95,5,0", "1,0,0", "0.98,0.02,0", "1,1,1"])
@pytest.mark.parametrize("sizes", [(8, 8, 8), (8, 0, 0), (8, 8, 0)])
def test_the_split_matrix_is_megatrons(split, sizes):
    """The login node's bookends are the ones megatron's GPTDatasetConfig computes."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from megatron_lns.data.tokenizer import ByteTokenizer

    config = GPTDatasetConfig(
        random_seed=1, sequence_length=8, blend=(["x"], None), split=split,
        tokenizer=ByteTokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False,
    )  # fmt: skip
    megatrons = [None if n == 0 else b for b, n in zip(config.split_matrix, sizes, strict=True)]
    assert split_bookends(split, sizes) == megatrons


def test_the_sample_counts_the_checks_use():
    from megatron_lns.config import load_config

    cfg = load_config(DEMO_CONFIG, [])
    assert dataset_num_samples(cfg) == (300 * 8, 8 * 8 * 4, 0)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.tokenizer.model=/nonexistent/tok.model"],
            "model.tokenizer.model='/nonexistent/tok.model' is read only by "
            "model.tokenizer.library=sentencepiece, not byte",
        ),
        (["model.tokenizer.type=foo"], "model.tokenizer.type='foo' is read only by"),
        (
            ["model.tokenizer.library=sentencepiece", "model.tokenizer.model=t.model",
             "model.tokenizer.type=foo"],
            "model.tokenizer.type='foo' is read only by model.tokenizer.library=huggingface, "
            "not sentencepiece",
        ),
    ],
)  # fmt: skip
def test_a_tokenizer_file_the_library_does_not_read_is_refused(overrides, expected):
    """The byte tokenizer (the default) reads no file: a .model given with it was ignored."""
    assert config_error(*overrides).startswith(expected)
