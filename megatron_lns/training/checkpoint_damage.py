"""What is wrong with a checkpoint whose files torch cannot read, in one line.

torch's reader of a ``torch_dist`` checkpoint (DCP) says what failed inside a damaged
file (``EOFError: Ran out of input``, under a ``CheckpointException`` that carries a page
of traceback), never which file it was. Finding its index of the shards (``.metadata``)
unreadable, it first logs two tracebacks of its own, through the root logger, then
raises. So every reader of a checkpoint (resume, ``analyze``, ``export-hf``) reads the
index here before anything else (:func:`read_index`), and a read that failed all the same
is explained here (:func:`read_failure`): the shard file that is missing or shorter than
its index says, else the last line of torch's error. Torch only, no megatron: export
reads checkpoints without a process group.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from megatron_lns.base.errors import last_line
from megatron_lns.training.checkpoint_dirs import CheckpointError

INDEX = ".metadata"


def _index(directory: str | Path) -> Metadata | str:
    """torch's index of the shards of checkpoint ``directory``, or why it cannot be read."""
    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # a missing, truncated or garbled .metadata
        return f"its {INDEX} (the index of its shards) cannot be read: {last_line(err)}"


def read_index(directory: str | Path) -> Metadata:
    """torch's index of the shards of checkpoint ``directory``; a one-line
    :class:`CheckpointError` naming it when it cannot be read."""
    index = _index(directory)
    if isinstance(index, str):
        raise CheckpointError(f"could not load checkpoint {directory}: {index}")
    return index


def shard_damage(directory: str | Path, index: Metadata) -> str | None:
    """The first shard file ``index`` places data in that is missing, unreadable or
    shorter than that data ends, in a few words; None when every one is long enough."""
    needed: dict[str, int] = {}
    for info in (getattr(index, "storage_data", None) or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        try:
            size = (Path(directory) / name).stat().st_size
        except FileNotFoundError:
            return f"its shard {name} is missing"
        except OSError as err:
            return f"its shard {name} cannot be read ({err.strerror or err})"
        if size < end:
            return f"its shard {name} is truncated ({size} bytes of at least {end})"
    return None


def read_failure(directory: str | Path, err: BaseException) -> str:
    """Why reading checkpoint ``directory`` failed with ``err``, in one line: the damaged
    file where one is, else the last line of ``err``."""
    index = _index(directory)
    if isinstance(index, str):
        return index
    return shard_damage(directory, index) or last_line(err)
