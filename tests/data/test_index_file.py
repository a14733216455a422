"""The login node's reader of ``PREFIX.idx`` reads what megatron-core's reads."""

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.errors import DataError
from megatron_lns.data.index_file import check_token_file, sequence_lengths
from megatron_lns.data.preprocess import preprocess


def test_document_lengths_are_megatrons(factory):
    prefix = str(factory.dataset(50))
    dataset = IndexedDataset(prefix)  # owns the memory map of its lengths
    megatrons = np.array(dataset.sequence_lengths)
    assert sequence_lengths(prefix).tolist() == megatrons.tolist()


@pytest.mark.parametrize(
    "cut, message",
    [(20, "its header is incomplete"), (-4, "lists 50 documents but holds the lengths of 49")],
)
def test_an_index_cut_short_is_named(tmp_path, cut, message):
    preprocess(demo_documents()[:50], tmp_path / "corpus")
    index = tmp_path / "corpus.idx"
    data = index.read_bytes()
    index.write_bytes(data[:cut] if cut > 0 else data[: 34 + 50 * 4 + cut])
    with pytest.raises(DataError, match=message):
        sequence_lengths(str(tmp_path / "corpus"))


@pytest.mark.parametrize("keep", [0, 100])
def test_a_token_file_cut_short_is_named(tmp_path, keep):
    preprocess(demo_documents()[:50], tmp_path / "corpus")
    check_token_file(str(tmp_path / "corpus"))
    tokens = tmp_path / "corpus.bin"
    expected = tokens.stat().st_size
    tokens.write_bytes(tokens.read_bytes()[:keep])
    with pytest.raises(
        DataError, match=rf"corpus.bin is cut short: {keep} bytes where .* of {expected} bytes"
    ):
        check_token_file(str(tmp_path / "corpus"))


@pytest.mark.parametrize("keep", [34 + 50 * 4, 34 + 50 * 12, -1])
def test_an_index_cut_short_past_its_lengths_is_named(tmp_path, keep):
    """The sequence pointers and document indices megatron maps after the lengths: an
    index cut there passed every check, then failed in each rank's dataset build."""
    preprocess(demo_documents()[:50], tmp_path / "corpus")
    index = tmp_path / "corpus.idx"
    whole = index.read_bytes()
    assert len(whole) == 34 + 50 * 4 + 50 * 8 + 51 * 8  # megatron's layout, as documented
    index.write_bytes(whole[:keep])
    size = len(whole[:keep])
    with pytest.raises(
        DataError,
        match=rf"corpus.idx is cut short: {size} bytes where the 50 sequences and 51 document "
        rf"indices of its header need {len(whole)}; preprocess the data again",
    ):
        check_token_file(str(tmp_path / "corpus"))
