"""The identity of a dataset's token files, which checkpoints record (issue 34)."""

import dataclasses
import hashlib
import shutil
from pathlib import Path

from megatron_lns.data.metadata import (
    WEAK_IDENTITY_PREFIX,
    DatasetMetadata,
    dataset_identity,
    same_data,
    weak_dataset_identity,
)
from megatron_lns.data.token_files import token_files_sha256


def _copy(source: Path, prefix: Path, dataset_id: str | None = None) -> str:
    """The dataset ``source`` copied to ``prefix``, its PREFIX.json recording
    ``dataset_id`` (None: none, as in datasets preprocessed before it was recorded)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".bin", ".idx"):
        shutil.copyfile(f"{source}{suffix}", f"{prefix}{suffix}")
    metadata = DatasetMetadata.load(source)
    dataclasses.replace(metadata, dataset_id=dataset_id).save(DatasetMetadata.path_for(prefix))
    return str(prefix)


def _sha256(*paths: str) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def test_the_same_files_have_the_same_identity_and_other_documents_another(tmp_path, factory):
    fifty, sixty = factory.dataset(50), factory.dataset(60)
    one = _copy(fifty, tmp_path / "one" / "corpus")
    two = _copy(fifty, tmp_path / "two" / "corpus")
    assert dataset_identity(one) == dataset_identity(two) == dataset_identity(one)
    other = _copy(sixty, tmp_path / "one" / "corpus")  # replaced in place
    assert dataset_identity(other) != dataset_identity(two)


def test_a_recorded_dataset_id_is_the_identity_while_it_describes_the_files(tmp_path, factory):
    source = factory.dataset(50)
    full = _sha256(f"{source}.idx", f"{source}.bin")
    assert DatasetMetadata.load(source).dataset_id == full  # as preprocess records it
    prefix = _copy(source, tmp_path / "corpus", dataset_id=full)
    assert dataset_identity(prefix) == full == token_files_sha256(prefix)
    # Other token files copied over, the old .json left beside them: not its id.
    for suffix in (".bin", ".idx"):
        shutil.copyfile(f"{factory.dataset(60)}{suffix}", f"{prefix}{suffix}")
    assert dataset_identity(prefix) == weak_dataset_identity(prefix)


def test_without_a_dataset_id_the_weaker_identity_covers_the_index_and_the_size(tmp_path, factory):
    prefix = _copy(factory.dataset(50), tmp_path / "corpus")
    identity = dataset_identity(prefix)
    assert identity.startswith(WEAK_IDENTITY_PREFIX)
    size = Path(f"{prefix}.bin").stat().st_size
    index = Path(f"{prefix}.idx").read_bytes()
    expected = hashlib.sha256(index + size.to_bytes(8, "little")).hexdigest()
    assert identity == WEAK_IDENTITY_PREFIX + expected
    # Its documented weakness: other tokens in documents of the same lengths.
    tokens = Path(f"{prefix}.bin")
    data = bytearray(tokens.read_bytes())
    data[0] ^= 1
    full_before = token_files_sha256(prefix)
    tokens.write_bytes(bytes(data))
    assert dataset_identity(prefix) == identity
    assert token_files_sha256(prefix) != full_before
    # Any change of a document's length changes it.
    index_bytes = bytearray(index)
    length_offset = 34  # the first document's int32 length, after the header
    index_bytes[length_offset] += 1
    Path(f"{prefix}.idx").write_bytes(bytes(index_bytes))
    assert dataset_identity(prefix) != identity


def test_identities_are_compared_at_the_strength_of_the_recorded_one(tmp_path, factory):
    source, other = factory.dataset(50), factory.dataset(60)
    full = _sha256(f"{source}.idx", f"{source}.bin")
    weak = _copy(source, tmp_path / "weak" / "corpus")
    strong = _copy(source, tmp_path / "strong" / "corpus", dataset_id=full)
    # A checkpoint of the old dataset; the same documents preprocessed again with an id.
    recorded = dataset_identity(weak)
    assert same_data(recorded, strong, dataset_identity(strong))
    # A checkpoint that recorded the full id; the same files, their .json without it.
    assert same_data(full, weak, dataset_identity(weak))
    replaced = _copy(other, tmp_path / "weak" / "corpus")
    assert not same_data(recorded, replaced, dataset_identity(replaced))
    assert not same_data(full, replaced, dataset_identity(replaced))
    other_full = _sha256(f"{other}.idx", f"{other}.bin")
    assert not same_data(full, replaced, other_full)
