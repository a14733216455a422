"""Tokenizing one unit of the plan into ``PREFIX.parts/units/NNNNNN.bin/.idx`` + receipt.

A unit is written under a temporary name and renamed into place, its receipt last: an
error, a kill or a stop midway leaves no file that looks finished, and the next run that
takes the unit's lock names and removes what was left. Worker processes run
:func:`worker_main`; a run with one worker calls :meth:`UnitTokenizer.tokenize` itself.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_lns.base.disk import disk_full_reported
from megatron_lns.base.parent_death import die_with_parent
from megatron_lns.data.corpus_inputs import PreprocessError, input_format
from megatron_lns.data.corpus_reader import read_batches
from megatron_lns.data.document_encoder import encode_documents
from megatron_lns.data.gigatoken_encoder import GigatokenTokenizer
from megatron_lns.data.preprocess_plan import PartsDirectory, Unit
from megatron_lns.data.token_files import TokenFileWriter, token_dtype
from megatron_lns.data.tokenizer import (
    HuggingFaceTokenizer,
    RustBackendTokenizer,
    Tokenizer,
    build_tokenizer,
)

# report(kind, payload): "bad" (a line), "progress" ((input bytes, documents, tokens)),
# "removed" (a stale temporary's path)
Report = Callable[[str, object], None]


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as the command line names it: what a worker process builds its own from.

    ``backend`` (set by :meth:`for_workers`) carries a loaded Hugging Face fast tokenizer's
    Rust backend, so that workers rebuild it without importing transformers and torch."""

    library: str
    type: str | None = None
    model: str | None = None
    encoder: str = "standard"  # or "gigatoken" (gigatoken_encoder.py)
    backend: tuple[str, int, int, str] | None = None  # name, vocab size, EOD, backend JSON

    def build(self) -> Tokenizer:
        if self.backend is not None:
            tokenizer = RustBackendTokenizer(*self.backend)
        else:
            tokenizer = build_tokenizer(self.library, self.type, self.model)
        if self.encoder == "gigatoken":
            return GigatokenTokenizer(tokenizer)
        return tokenizer

    def for_workers(self, loaded: Tokenizer) -> TokenizerSpec:
        """This spec for worker processes, given the tokenizer the parent loaded from it."""
        loaded = getattr(loaded, "reference", loaded)  # the tokenizer under gigatoken
        if isinstance(loaded, HuggingFaceTokenizer) and (json := loaded.backend_json()):
            backend = (loaded.name, loaded.vocab_size, loaded.eod, json)
            return dataclasses.replace(self, backend=backend)
        return self


@dataclass(frozen=True)
class BadRecordLimit:
    """``--max-bad-records``: a count (0: the first bad record stops the run) or a
    fraction of the records (documents and bad ones) below 1."""

    count: int | None = 0
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> BadRecordLimit:
        """A finite count or fraction: 'inf' (or 1e400) is refused like any other word,
        there being no count it stands for (a fraction below 1 bounds any corpus)."""
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not math.isfinite(value):
            value = -1.0
        if value >= 1 and value == int(value):
            return cls(count=int(value))
        if 0 <= value < 1:
            return cls(count=None, fraction=value) if value else cls(count=0)
        raise PreprocessError(
            f"--max-bad-records {text}: give a count (10) or a fraction of the records (0.001)"
        )

    def exceeded(self, bad: int, records: int) -> str | None:
        if self.count is not None and bad > self.count:
            return f"more than --max-bad-records {self.count}"
        if self.fraction is not None and records and bad / records > self.fraction:
            share = f"{bad / records:.4%} of {records} records"
            return f"{share}, more than --max-bad-records {self.fraction}"
        return None


# What became of a unit given to a process: tokenized there, finished by another process
# between the plan's look and taking its lock, or held (being tokenized) by another.
TOKENIZED, DONE_ELSEWHERE, HELD = "tokenized", "done elsewhere", "held"
UNIT_OUTCOMES = (TOKENIZED, DONE_ELSEWHERE, HELD)


@dataclass(frozen=True)
class UnitTokenizer:
    """What every unit of a run is tokenized with; :meth:`tokenize` does one unit."""

    parts: PartsDirectory
    tokenizer: Tokenizer
    json_key: str
    limit: BadRecordLimit
    threads: int = 1

    def tokenize(self, unit: Unit, report: Report) -> str:
        """Tokenize ``unit`` and publish it with its receipt, unless another process holds
        it or has finished it meanwhile: which of :data:`UNIT_OUTCOMES` it was."""
        parts = self.parts
        lock = parts.lock(unit)
        if not lock.acquire():
            return HELD
        try:
            if parts.receipt(unit):
                return DONE_ELSEWHERE
            for stale in parts.temporaries(unit):
                stale.unlink(missing_ok=True)
                report("removed", str(stale))
            parts.forget(unit)  # an earlier input's files
            kept = f"; the finished units are kept in {parts.root}"
            with disk_full_reported(f"{parts.output_prefix}.bin", then=kept):
                self._write(unit, report)
            return TOKENIZED
        finally:
            lock.release()

    def _write(self, unit: Unit, report: Report) -> dict:
        parts, tokenizer, limit = self.parts, self.tokenizer, self.limit
        started = time.monotonic()
        temporary = f"{parts.prefix(unit)}.tmp-{uuid.uuid4().hex[:12]}"
        writer = TokenFileWriter(temporary, token_dtype(tokenizer.vocab_size))
        path = Path(unit.path)
        bad: list[str] = []
        max_token_id = -1
        try:
            batches = read_batches(path, input_format(path), self.json_key, unit.start, unit.end)
            for batch in batches:
                for record in batch.bad:
                    bad.append(str(record))
                    if limit.count == 0:
                        raise PreprocessError(
                            f"{record} (--max-bad-records N tolerates up to N bad records)"
                        )
                    report("bad", f"bad record {record}")
                    if why := limit.exceeded(len(bad), 0):
                        raise PreprocessError(f"{record}: {len(bad)} bad records, {why}")
                ids, lengths = encode_documents(tokenizer, batch.texts, self.threads)
                if len(ids):
                    max_token_id = max(max_token_id, int(ids.max()))
                writer.add(ids, lengths)
                report("progress", (batch.input_bytes, len(lengths), len(ids)))
            if writer.documents == 0 and not bad and unit.start == 0 and unit.end is None:
                raise PreprocessError(f"{unit.path} holds no documents (an empty shard)")
            if why := limit.exceeded(len(bad), writer.documents + len(bad)):
                raise PreprocessError(f"{unit.describe()}: {len(bad)} bad records, {why}")
            writer.finish()
            for suffix in (".bin", ".idx"):
                os.replace(f"{temporary}{suffix}", f"{parts.prefix(unit)}{suffix}")
        except BaseException:
            writer.discard()
            raise
        receipt = {
            "encoder": "gigatoken" if isinstance(tokenizer, GigatokenTokenizer) else "standard",
            "documents": writer.documents,
            "tokens": writer.tokens,
            "max_token_id": max_token_id,
            "bad_records": bad,
            "input_bytes": unit.bytes,
            "seconds": round(time.monotonic() - started, 3),
        }
        return parts.write_receipt(unit, receipt)


def worker_main(
    spec: TokenizerSpec,
    output_prefix: str,
    json_key: str,
    limit: BadRecordLimit,
    threads: int,
    units,  # multiprocessing queue of Unit, then None
    results,  # multiprocessing queue of (kind, unit index, payload)
) -> None:
    """A worker process: tokenize units from ``units`` until None; every event goes to
    ``results``. Ctrl-C and SIGTERM, which reach the whole process group (a terminal,
    ``timeout``, srun), are the parent's to act on: it kills the workers and cleans up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, multiprocessing.parent_process().pid)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    try:
        tokenizer = spec.build()
    except Exception as err:
        results.put(("error", -1, _describe(err)))
        return
    units_of_this_run = UnitTokenizer(
        PartsDirectory(Path(output_prefix)), tokenizer, json_key, limit, threads
    )
    while (unit := units.get()) is not None:
        results.put(("start", unit.index, None))

        def report(kind: str, payload: object, index: int = unit.index) -> None:
            results.put((kind, index, payload))

        try:
            outcome = units_of_this_run.tokenize(unit, report)
        except Exception as err:
            results.put(("error", unit.index, _describe(err)))
            return
        results.put((outcome, unit.index, None))


def _describe(err: BaseException) -> tuple[bool, str]:
    """(whether it is the user's to fix, the one line or the traceback)."""
    from megatron_lns.base.disk import as_user_error

    user = as_user_error(err)  # a UserError itself, or a full disk as one
    if user is not None:
        return True, str(user)
    return False, "".join(traceback.format_exception(err))


def max_token_id(receipts: list[dict]) -> int:
    return int(np.max([r["max_token_id"] for r in receipts])) if receipts else -1
