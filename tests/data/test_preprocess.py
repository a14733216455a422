"""Preprocessing round trips through megatron's indexed dataset, and data checks."""

import json

import numpy as np
import pytest
import torch
from helpers import byte_gpt_datasets
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_lns.data.datasets import (
    DataMismatchError,
    PretrainingBatchSampler,
    check_dataset_fits,
)
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.preprocess import (
    DatasetMetadata,
    PreprocessError,
    preprocess,
    read_documents,
)
from megatron_lns.data.tokenizer import ByteTokenizer, TokenizerError, build_tokenizer

DOCS = demo_documents()[:200]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(factory) -> str:
    """A real Hugging Face BPE tokenizer (vocabulary 400), trained on ``DOCS``."""
    return str(factory.hf_bpe())


@pytest.fixture(scope="module")
def sp_model(factory) -> str:
    return str(factory.sentencepiece("t5"))


def _read_back(prefix):
    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("library", ["byte", "huggingface", "sentencepiece"])
def test_round_trip_through_megatron_indexed_dataset(tmp_path, library, factory):
    files = factory.tokenizer(library)
    metadata = preprocess(
        DOCS[:50],
        tmp_path / "data",
        library,
        **files.preprocess_options(),
    )
    tokenizer = files.build()
    expected = [[*tokenizer.encode(doc), tokenizer.eod] for doc in DOCS[:50]]
    assert _read_back(tmp_path / "data") == expected
    assert metadata.num_documents == 50
    assert metadata.num_tokens == sum(map(len, expected))
    assert metadata.max_token_id == max(max(e) for e in expected)
    assert DatasetMetadata.load(tmp_path / "data") == metadata
    assert not list(tmp_path.glob("*.tmp*"))


def test_large_vocab_is_stored_as_int32_not_wrapped(tmp_path):
    ids = [70_000, 65_535, 3]

    class Fake:
        name, vocab_size, eod, unique_identifiers = "fake", 80_000, 79_999, {}

        def encode(self, text):
            return ids

    import megatron_lns.data.preprocess as pre

    original = pre.build_tokenizer
    pre.build_tokenizer = lambda *a, **k: Fake()
    try:
        preprocess(["x"], tmp_path / "wide")
    finally:
        pre.build_tokenizer = original
    assert _read_back(tmp_path / "wide") == [[*ids, 79_999]]
    assert IndexedDataset(str(tmp_path / "wide")).index.dtype == np.int32


def test_jsonl_and_text_inputs(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        json.dumps({"text": "first doc"}) + "\n\n" + json.dumps({"text": "second"}) + "\n"
    )
    text = tmp_path / "b.txt"
    text.write_text("line one\n\nline two\n")
    assert list(read_documents([jsonl, text])) == ["first doc", "second", "line one", "line two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'text' key"):
        list(read_documents([bad]))
    with pytest.raises(PreprocessError, match=r"missing\.jsonl does not exist"):
        list(read_documents([tmp_path / "missing.jsonl"]))


def test_dataset_from_another_tokenizer_is_refused(tmp_path, hf_tokenizer_dir):
    preprocess(DOCS[:20], tmp_path / "hf", "huggingface", tokenizer_type=hf_tokenizer_dir)
    with pytest.raises(
        DataMismatchError, match=r"tokenized with huggingface:.*but model.tokenizer is byte"
    ):
        check_dataset_fits(str(tmp_path / "hf"), ByteTokenizer(), model_vocab_size=384)


@pytest.mark.parametrize("library", ["byte", "huggingface", "sentencepiece"])
def test_data_passes_the_config_checks_with_its_own_tokenizer_only(
    tmp_path, library, hf_tokenizer_dir, sp_model, factory
):
    """The checks before any rank starts (config/data_checks.py) accept data made with the
    configured tokenizer, and refuse it under another one, as the ranks do."""
    from helpers import DEMO_CONFIG

    from megatron_lns.config import ConfigError, load_config, validate

    preprocess(DOCS, tmp_path / "data", library, **factory.tokenizer(library).preprocess_options())

    # Each library's own file only: validate refuses one the library does not read.
    files = {"huggingface": [f"model.tokenizer.type={hf_tokenizer_dir}"],
             "sentencepiece": [f"model.tokenizer.model={sp_model}"]}  # fmt: skip

    def config(library):
        return load_config(DEMO_CONFIG, [
            f"model.data.data_prefix=[{tmp_path}/data]", f"exp_manager.exp_dir={tmp_path}/runs",
            f"model.tokenizer.library={library}", *files.get(library, []),
        ])  # fmt: skip

    validate(config(library))
    other = "sentencepiece" if library == "byte" else "byte"
    with pytest.raises(ConfigError, match=rf"^model.data.data_prefix: dataset .* with {library}"):
        validate(config(other))


def test_an_empty_hugging_face_directory_is_named_as_such(tmp_path):
    """transformers' error of an empty directory begins "Couldn't instantiate the backend
    tokenizer from one of:", and its first line was all preprocess said."""
    with pytest.raises(TokenizerError, match=f"^{tmp_path} holds no tokenizer files "):
        build_tokenizer("huggingface", str(tmp_path))


def test_ids_beyond_model_vocab_are_refused_even_without_metadata(tmp_path, hf_tokenizer_dir):
    preprocess(DOCS[:20], tmp_path / "hf", "huggingface", tokenizer_type=hf_tokenizer_dir)
    tokenizer = build_tokenizer("huggingface", hf_tokenizer_dir)
    check_dataset_fits(str(tmp_path / "hf"), tokenizer, model_vocab_size=512)
    DatasetMetadata.path_for(tmp_path / "hf").unlink()  # as if prepared by other tools
    with pytest.raises(
        DataMismatchError,
        match=r"contains token id \d+, which does not fit the model's vocabulary of 256",
    ):
        check_dataset_fits(str(tmp_path / "hf"), tokenizer, model_vocab_size=256)


def test_gpt_dataset_samples_are_windows_of_the_token_stream(tmp_path, factory):
    prefix = factory.dataset(len(DOCS))  # DOCS in bytes
    stream = np.concatenate([np.asarray(d) for d in _read_back(prefix)])
    splits = byte_gpt_datasets([prefix], cache=tmp_path / "cache", seed=3)
    assert splits.valid is not None
    text = stream.tobytes()
    eod = ByteTokenizer().eod
    for i in range(5):
        sample = splits.train[i]
        tokens = np.asarray(sample["tokens"]).astype(stream.dtype)
        # GPTDataset concatenates shuffled documents: each piece between EODs is a
        # contiguous run of one document.
        pieces = np.split(tokens, np.flatnonzero(tokens == eod) + 1)
        assert all(piece.tobytes() in text for piece in pieces if len(piece))
        assert torch.equal(
            torch.as_tensor(sample["labels"][:-1]), torch.as_tensor(sample["tokens"][1:])
        )


def test_batch_sampler_layout_and_resume():
    def take(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    # Global batch of 8 = 2 micro-batches x micro 2 x DP 2.
    rank0 = take(PretrainingBatchSampler(100, 0, 2, 2, 0), 4)
    rank1 = take(PretrainingBatchSampler(100, 0, 2, 2, 1), 4)
    assert rank0 == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert rank1 == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert take(PretrainingBatchSampler(100, 8, 2, 2, 0), 2) == rank0[2:]
    assert take(PretrainingBatchSampler(10, 8, 2, 1, 0), 2) == [
        [8, 9],
        [0, 1],
    ]  # wraps, never stops


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "over-an-old-dataset"])
def test_a_full_disk_is_one_line_and_leaves_no_dataset_that_looks_complete(
    tmp_path, capsys, existing
):
    """The tokens outgrow the disk: one line naming the output; neither a new ``.bin``/
    ``.idx`` pair nor temporary files remain (``PREFIX.parts`` keeps only the plan), and an
    older dataset stays as it was."""
    from helpers import small_filesystem

    from megatron_lns.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(DOCS * 4) + "\n")  # ~200 KiB of tokens as uint16
    with small_filesystem(tmp_path / "disk", 64) as disk:
        prefix = disk / "data" / "corpus"
        if existing:
            preprocess(DOCS[:5], prefix)
            before = {p.name: p.read_bytes() for p in prefix.parent.iterdir()}
        status = main(["preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
                       "--workers", "1", "--quiet", "--overwrite"])  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert status == 2
        assert err.startswith(f"error: cannot write {prefix}.bin: no space left on device (")
        assert "\n" not in err
        left = {p.name: p.read_bytes() for p in prefix.parent.iterdir() if p.is_file()}
        assert left == (before if existing else {})
        work = sorted(p.name for p in prefix.parent.glob("corpus.parts/**/*") if p.is_file())
        assert work == ["000000.lock", "lock", "plan.json"]
