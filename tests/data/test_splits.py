"""Small corpora and splits: what megatron used to loop forever on fails fast with the
prefix, split and document count; what it can honour builds."""

import signal
import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from helpers import ROOT, byte_gpt_datasets, fresh_launch_env
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.preprocess import preprocess
from megatron_lns.data.splits import DatasetSplitError, samples_in_split
from megatron_lns.data.tokenizer import ByteTokenizer


@contextmanager
def deadline(seconds: int):
    """Turn a regression into megatron's infinite loop into a failure, not a hung suite."""

    def expire(signum, frame):
        raise TimeoutError(f"dataset build still running after {seconds}s: it hangs")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _corpus(tmp_path, num_documents: int, name: str = "small") -> str:
    prefix = tmp_path / name
    preprocess(demo_documents()[:num_documents], prefix)
    return str(prefix)


@pytest.mark.parametrize(
    "num_documents, split, samples, empty_split, needed",
    [
        (200, "998,2,0", (40, 8, 0), "valid", 251),  # the paper configs' split
        (10, "95,5,0", (40, 8, 0), "valid", 11),  # the demo's split
        (200, "949,50,1", (40, 8, 8), "test", 501),  # megatron's default split
        (1, "50,50,0", (40, 8, 0), "train", 2),
    ],
)
def test_a_split_without_documents_fails_fast(
    tmp_path, num_documents, split, samples, empty_split, needed
):
    prefix = _corpus(tmp_path, num_documents)
    with deadline(120), pytest.raises(DatasetSplitError) as err:
        byte_gpt_datasets([prefix], split, samples, cache=str(tmp_path / "cache"))
    message = str(err.value)
    assert f"the {empty_split} split of {prefix} (split '{split}')" in message
    assert f"gets 0 of its {num_documents} documents" in message
    assert f"give at least {needed} documents" in message
    assert "\n" not in message


def test_a_split_the_run_does_not_draw_from_is_not_built(tmp_path):
    """``949,50,1`` on 200 documents leaves the test split empty, and validation off
    (no valid samples) leaves ``998,2,0``'s empty valid split unused: both train."""
    prefix = _corpus(tmp_path, 200)
    with deadline(120):
        splits = byte_gpt_datasets([prefix], "949,50,1", (40, 8, 0))
        assert splits.test is None and len(splits.valid) >= 8 and len(splits.train) >= 40
        splits = byte_gpt_datasets([prefix], "998,2,0", (40, 0, 0))
    assert splits.valid is None and splits.test is None
    assert len(splits.train) >= 40
    assert splits.train[0]["tokens"].shape == (32,)


def test_a_split_shorter_than_one_sample_repeats_its_documents(tmp_path):
    """Three tiny documents (fewer tokens than a sample): megatron repeats them."""
    prefix = tmp_path / "tiny"
    preprocess(["ab", "cd", "ef"], prefix)
    with deadline(120):
        splits = byte_gpt_datasets([str(prefix)], "1,1,1", (10, 4, 4), seq_length=16)
    text = np.asarray(splits.valid[0]["tokens"])
    assert set(text.tolist()) <= {ord("c"), ord("d"), ByteTokenizer().eod}
    assert len(splits.train) >= 10 and len(splits.test) >= 4


def test_an_unweighted_blend_needs_one_sample_from_each_prefix(tmp_path):
    big = _corpus(tmp_path, 200, "big")
    short = tmp_path / "short"
    preprocess(["a few words"] * 10, short)
    with (
        deadline(120),
        pytest.raises(
            DatasetSplitError, match=r"valid split of .*short.*less than one sample of 33"
        ),
    ):
        byte_gpt_datasets([big, str(short)], "90,10,0")
    with deadline(120):
        splits = byte_gpt_datasets([big, str(short)], "90,10,0", weights=[0.5, 0.5])
    assert len(splits.valid) >= 8


def test_the_samples_one_pass_over_a_split_holds_are_megatrons(tmp_path):
    """``analyze --batches`` is capped at this count: what megatron's datasets hold when
    asked for one sample (one epoch), for a prefix and an unweighted blend of two."""
    big, other = _corpus(tmp_path, 200, "big"), _corpus(tmp_path, 120, "other")
    for prefixes in ([big], [big, other]):
        with deadline(120):
            splits = byte_gpt_datasets(prefixes, "90,10,0", (1, 1, 0))
        counted = samples_in_split(prefixes, "90,10,0", "valid", seq_length=32)
        parts = getattr(splits.valid, "datasets", [splits.valid])  # a blend's, one pass each
        assert counted > 10 and counted == sum(map(len, parts)), prefixes
    assert samples_in_split([big], "90,10,0", "test", seq_length=32) == 0


def test_documents_without_tokens_fail_fast(tmp_path):
    """Data from other tools may hold empty documents; a split of only those has no tokens."""
    prefix = tmp_path / "empty_docs"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(257))
    for length in (40, 40, 40, 0):
        builder.add_document(torch.full((length,), 7, dtype=torch.int64), [length])
    builder.finalize(f"{prefix}.idx")
    with (
        deadline(120),
        pytest.raises(DatasetSplitError, match=r"gets 1 documents that hold no tokens"),
    ):
        byte_gpt_datasets([str(prefix)], "3,1,0", (10, 2, 0), seq_length=8)


@pytest.mark.parametrize("split", ["0,1,0", "1,2,3,4", "", "a,b"])
def test_a_split_string_megatron_cannot_use_is_refused(tmp_path, split):
    prefix = _corpus(tmp_path, 20)
    with pytest.raises(DatasetSplitError, match=r"non-negative weights 'train,valid,test'"):
        byte_gpt_datasets([prefix], split)


def test_train_on_a_corpus_too_small_for_its_split_stops_with_one_line(tmp_path):
    """The demo's ``95,5,0`` on ten documents: an error and exit code 2, not a hang; since
    the config checks count the splits (config/data_checks.py), before any rank starts."""
    prefix = _corpus(tmp_path, 10)
    command = [
        sys.executable,
        "-m",
        "megatron_lns.cli",
        "train",
        str(ROOT / "nemo_configs" / "tiny_cpu_demo.yaml"),
        f"model.data.data_prefix=[{prefix}]",
        f"exp_manager.exp_dir={tmp_path / 'runs'}",
        "trainer.max_steps=40",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=fresh_launch_env()
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: model.data.data_prefix: the valid split of {prefix} (split '95,5,0') gets 0 of its 10 documents and "
        "megatron would loop forever building it: give at least 11 documents, or a larger "
        "valid share (e.g. split '90,10,0')"
    ]
    assert "Traceback" not in result.stderr
