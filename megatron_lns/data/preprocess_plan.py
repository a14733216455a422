"""The plan of a preprocessing run: its settings, its units of work, and which are done.

The unit of work is an input file, or a byte range of ``UNIT_BYTES`` of a large
uncompressed line file (the lines that start in it): one 120 MB JSONL file then keeps
two workers busy, each on its own core, rather than one process on two tokenizer threads.
Units depend only on the inputs, never on the number of workers, tasks or nodes, and the
dataset is their outputs concatenated in order: so its bytes are the same however the
work was split, and whether it was resumed.

Everything lives beside the output, in ``PREFIX.parts/``::

    plan.json              the settings and the units (what a rerun is compared with)
    lock                   held by the run that plans and merges (fcntl.flock)
    units/NNNNNN.bin/.idx  a finished unit's tokens
    units/NNNNNN.json      its receipt, written last: input identity, documents, tokens,
                           bad records, seconds
    units/NNNNNN.lock      held by the process tokenizing the unit

A unit is done when its receipt exists and names the same input (path, byte range, size,
modification time) as the plan does now; an input that changed since is redone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from megatron_lns.base.disk import write_text_atomically
from megatron_lns.data.corpus_inputs import PreprocessError, input_format
from megatron_lns.data.output_files import parts_directory

UNIT_BYTES = 32 << 20
PLAN_FORMAT = 1
# What a receipt (unit_worker writes it) holds that the merge and the manifest count with.
RECEIPT_FIGURES = {
    "documents": int,
    "tokens": int,
    "max_token_id": int,
    "bad_records": list,
    "seconds": (int, float),
}


@dataclass(frozen=True)
class Unit:
    index: int
    path: str  # absolute
    start: int
    end: int | None  # None: to the end of the file
    size: int  # of the whole file
    mtime_ns: int

    @property
    def name(self) -> str:
        return f"{self.index:06d}"

    @property
    def bytes(self) -> int:
        return (self.size if self.end is None else self.end) - self.start

    def describe(self) -> str:
        if self.end is None and self.start == 0:
            return self.path
        return f"{self.path} bytes {self.start}-{self.end if self.end is not None else self.size}"


@dataclass(frozen=True)
class Settings:
    """What decides the dataset's bytes, besides the inputs' contents."""

    tokenizer: str
    vocab_size: int
    eod: int
    json_key: str
    unit_bytes: int
    inputs: tuple[str, ...]  # absolute paths, in order

    def differences(self, other: Settings) -> list[str]:
        """What differs from ``other`` (an earlier run's), in words."""
        found = []
        for key in ("tokenizer", "vocab_size", "eod", "json_key", "unit_bytes"):
            if getattr(self, key) != getattr(other, key):
                found.append(f"{key} {getattr(other, key)} -> {getattr(self, key)}")
        if self.inputs != other.inputs:
            added = [p for p in self.inputs if p not in set(other.inputs)]
            removed = [p for p in other.inputs if p not in set(self.inputs)]
            parts = [f"{len(added)} added ({', '.join(added[:2])})" if added else ""]
            parts.append(f"{len(removed)} removed ({', '.join(removed[:2])})" if removed else "")
            what = "; ".join(p for p in parts if p) or "the same files in another order"
            found.append(f"the inputs: {what}")
        return found


def plan_units(files: list[Path], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    units: list[Unit] = []
    for path in files:
        stat = path.stat()
        absolute = str(path.resolve())
        ranges: list[tuple[int, int | None]] = [(0, None)]
        if input_format(path).splittable and stat.st_size > unit_bytes:
            starts = range(0, stat.st_size, unit_bytes)
            ranges = [(s, min(s + unit_bytes, stat.st_size)) for s in starts]
        for start, end in ranges:
            units.append(Unit(len(units), absolute, start, end, stat.st_size, stat.st_mtime_ns))
    return units


def task_share(units: list[Unit], task: int, tasks: int) -> list[Unit]:
    """Task ``task``'s units when ``tasks`` share the work: the largest unit first to the
    least loaded task (ties to the lowest), so every task gets about the same bytes and
    each task's share is the same on every node that computes it."""
    loads = [0] * tasks
    shares: list[list[Unit]] = [[] for _ in range(tasks)]
    for unit in sorted(units, key=lambda u: (-u.bytes, u.index)):
        lightest = min(range(tasks), key=lambda t: (loads[t], t))
        loads[lightest] += unit.bytes
        shares[lightest].append(unit)
    return sorted(shares[task], key=lambda u: u.index)


def plan_digest(settings: Settings, units: list[Unit]) -> str:
    text = json.dumps([asdict(settings), [asdict(u) for u in units]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class FileLock:
    """An exclusive ``fcntl.flock`` on ``path``, refused (not waited for) when held, with
    who holds it written inside for the refusal's message. Released when the process
    ends however it ends, so a killed run leaves no stale lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def acquire(self) -> bool:
        f = open(self.path, "a+")  # noqa: SIM115 (kept open while the lock is held)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return False
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._file = f
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError):
            return self.path.read_text().strip() or "another process"
        return "another process"

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the lock
            self._file = None


class PartsDirectory:
    """``PREFIX.parts/``: the plan, the finished units and their receipts."""

    def __init__(self, output_prefix: Path) -> None:
        self.output_prefix = output_prefix
        self.root = parts_directory(output_prefix)
        self.units = self.root / "units"

    def create(self) -> None:
        try:
            self.units.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PreprocessError(f"cannot create {self.units}: {err.strerror}") from None

    def prefix(self, unit: Unit) -> str:
        return str(self.units / unit.name)

    def load_plan(self) -> tuple[Settings, list[Unit]] | None:
        path = self.root / "plan.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            settings = Settings(**{**data["settings"], "inputs": tuple(data["settings"]["inputs"])})
            return settings, [Unit(**u) for u in data["units"]]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise PreprocessError(
                f"{path} is not a plan this version can read ({err}): --overwrite starts over"
            ) from None

    def save_plan(self, settings: Settings, units: list[Unit]) -> None:
        data = {"format": PLAN_FORMAT, "settings": asdict(settings)}
        data["units"] = [asdict(u) for u in units]
        write_json_atomically(self.root / "plan.json", data)

    def receipt(self, unit: Unit) -> dict | None:
        """The unit's receipt if it is done (for this very input), else None: also when
        the receipt is not one (not JSON, not a mapping, a figure the merge sums missing),
        so that the unit is tokenized again rather than merged from what it says."""
        prefix = self.prefix(unit)
        try:
            receipt = json.loads(Path(f"{prefix}.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(receipt, dict) or receipt.get("unit") != asdict(unit):
            return None
        if any(not isinstance(receipt.get(key), kind) for key, kind in RECEIPT_FIGURES.items()):
            return None
        if not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
            return None
        return receipt

    def write_receipt(self, unit: Unit, receipt: dict) -> dict:
        """Publish ``receipt`` (written last: it makes the unit done); the receipt as read."""
        path = Path(f"{self.prefix(unit)}.json")
        temporary = self.units / f"{unit.name}.tmp-{os.getpid()}.json"  # one of temporaries()
        receipt = {"unit": asdict(unit), **receipt}
        write_json_atomically(path, receipt, temporary)
        return receipt

    def forget(self, unit: Unit) -> None:
        for suffix in (".json", ".bin", ".idx"):
            Path(f"{self.prefix(unit)}{suffix}").unlink(missing_ok=True)

    def temporaries(self, unit: Unit) -> list[Path]:
        return sorted(self.units.glob(f"{unit.name}.tmp-*"))

    def lock(self, unit: Unit) -> FileLock:
        return FileLock(Path(f"{self.prefix(unit)}.lock"))

    def remove_abandoned(self, unit: Unit) -> None:
        """Remove the temporaries of ``unit`` unless a process is writing it (holds its
        lock): what this run's stopped workers left."""
        lock = self.lock(unit)
        if lock.acquire():
            try:
                for path in self.temporaries(unit):
                    path.unlink(missing_ok=True)
            finally:
                lock.release()


def write_json_atomically(path: Path, data: dict, temporary: Path | None = None) -> None:
    write_text_atomically(path, json.dumps(data, indent=1) + "\n", temporary=temporary)
