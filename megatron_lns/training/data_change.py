"""The data a checkpoint was trained on, and a resume on other data (issue 34: never
replace data a run is reading, silently).

Every checkpoint records, in its ``complete.json`` (``checkpoint_dirs.DATA``), the
identity of the token files of each ``model.data.data_prefix`` entry, as the entry is
written (``builtin:pydoc``: the corpus as prepared in the cache), from
``data.metadata.dataset_identity``. A resume whose files under an entry the checkpoint
names are other ones (another corpus preprocessed into the same prefix) is refused before
anything is loaded, naming the prefix, unless ``exp_manager.resume_with_changed_data``:
then one line says so and training continues on the new data: the position (a sample
count) carries over, the sample order and cached index mappings are the new data's, so
the samples seen after the resume are not those the checkpoint's run would have seen.
An entry added to or removed from the blend is a config change (reported with the
others, ``provenance.py``), not checked here; a checkpoint written before checkpoints
recorded their data resumes as before.

Torch-free: reading a marker and hashing index files needs no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.data.blend import DataBlend
from megatron_lns.data.metadata import dataset_identity, same_data
from megatron_lns.training.checkpoint_dirs import DATA, CheckpointError, read_marker

OVERRIDE_KEY = "exp_manager.resume_with_changed_data"


class DataChangedError(CheckpointError):
    """The files of a data prefix are not those the checkpoint was trained on."""


@dataclass(frozen=True)
class DataInUse:
    """One entry of the blend: as ``model.data.data_prefix`` names it, the prefix of its
    files (a built-in corpus's in the cache), their identity."""

    name: str
    prefix: str
    identity: str

    @property
    def shown(self) -> str:
        return self.name if self.name == self.prefix else f"{self.name} ({self.prefix})"


def data_in_use(blend: DataBlend, resolved: DataBlend) -> list[DataInUse]:
    """The identity of each entry of ``blend``, once each; ``resolved`` is the same blend
    with its built-in corpora prepared (``DataBlend.resolved``)."""
    entries = dict(zip(blend.prefixes, resolved.prefixes, strict=True))
    return [DataInUse(name, prefix, dataset_identity(prefix)) for name, prefix in entries.items()]


def data_record(data: Sequence[DataInUse]) -> dict[str, str]:
    """What a checkpoint records of ``data`` (``TrainingState.data``)."""
    return {entry.name: entry.identity for entry in data}


def changed_data(path: Path, data: Sequence[DataInUse]) -> tuple[list[DataInUse], int]:
    """The entries of ``data`` whose files are not those the checkpoint ``path`` recorded,
    and the checkpoint's step; none for a checkpoint that recorded no data."""
    marker = read_marker(path)
    recorded = marker.get(DATA)
    if not isinstance(recorded, dict):
        return [], 0
    changed = [
        entry
        for entry in data
        if isinstance(recorded.get(entry.name), str)
        and not same_data(recorded[entry.name], entry.prefix, entry.identity)
    ]
    return changed, int(marker.get("iteration", 0))


def check_data(path: Path, data: Sequence[DataInUse], allowed: bool) -> str | None:
    """Refuse to resume from ``path`` on data other than its own (:class:`DataChangedError`
    naming the prefixes); with ``allowed`` (the override), the line that says the data
    changed instead. None when nothing changed."""
    changed, step = changed_data(path, data)
    if not changed:
        return None
    names = ", ".join(entry.shown for entry in changed)
    dataset = "dataset" if len(changed) == 1 else "datasets"
    if allowed:
        return (
            f"{dataset} {names} changed since checkpoint {path.name} was written at step "
            f"{step}; training continues on the new data ({OVERRIDE_KEY}=true)"
        )
    raise DataChangedError(
        f"{dataset} {names} changed since checkpoint {path} was written at step {step} "
        "(other token files than the ones it was trained on): restore them, or set "
        f"{OVERRIDE_KEY}=true to continue training on the new data"
    )
