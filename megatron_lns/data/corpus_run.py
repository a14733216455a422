"""One run of ``megatron-lns preprocess`` over a corpus: plan, tokenize, merge, publish.

A plain run holds ``PREFIX.parts/lock`` throughout (a second run on the same output is
refused, naming who holds it), compares the plan with the one an earlier run left
(other settings are refused, naming what differs; a changed input is redone, named),
tokenizes every unfinished unit in worker processes, and merges the units into one
``PREFIX.bin/.idx``: training then opens one dataset, whatever the number of shards.

With ``task=(i, n)`` it tokenizes task ``i``'s share of the plan only and merges nothing:
the tasks of a SLURM job (``docs/preprocessing.md``), after which a plain run merges.
An existing published dataset is replaced only with ``overwrite``: a training run may
be reading it.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import queue
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lns.base.disk import disk_full_reported
from megatron_lns.data.corpus_inputs import PreprocessError, expand_inputs
from megatron_lns.data.errors import DataError
from megatron_lns.data.index_file import check_token_file
from megatron_lns.data.metadata import DatasetMetadata
from megatron_lns.data.output_files import (
    StopSignals,
    check_output_place,
    check_output_prefix,
    publish,
    remove_temporaries,
    temporary_prefix,
)
from megatron_lns.data.preprocess_plan import (
    UNIT_BYTES,
    FileLock,
    PartsDirectory,
    Settings,
    Unit,
    plan_digest,
    plan_units,
    task_share,
    write_json_atomically,
)
from megatron_lns.data.token_files import merge_token_files, token_dtype
from megatron_lns.data.unit_worker import (
    DONE_ELSEWHERE,
    HELD,
    TOKENIZED,
    UNIT_OUTCOMES,
    BadRecordLimit,
    TokenizerSpec,
    UnitTokenizer,
    max_token_id,
    worker_main,
)


@dataclass
class CorpusRun:
    """One ``megatron-lns preprocess`` invocation, as the command line gives it."""

    inputs: list[str]
    output_prefix: Path
    tokenizer: TokenizerSpec = field(default_factory=lambda: TokenizerSpec("byte"))
    json_key: str = "text"
    workers: int = 1
    bad_records: BadRecordLimit = field(default_factory=BadRecordLimit)
    overwrite: bool = False
    progress: bool = False
    task: tuple[int, int] | None = None  # (task, tasks): tokenize this task's share only
    plan_only: bool = False
    unit_bytes: int = UNIT_BYTES


@dataclass
class Outcome:
    """What a run did: the lines the command prints, and the dataset if published."""

    lines: list[str]
    metadata: DatasetMetadata | None = None


def preprocess_corpus(run: CorpusRun) -> Outcome:
    return _Runner(run).execute()


class _Progress:
    """A bar over the input bytes of the units to do, with documents and tokens per
    second, on a terminal; in a log (a SLURM job's: srun passes a task's output on line by
    line, and a bar redraws with carriage returns) a line every 30 s instead. And the
    figures for the summary line."""

    LOG_LINE_SECONDS = 30.0

    def __init__(self, total_bytes: int, label: str, show: bool) -> None:
        self.started = self.last_line = time.monotonic()
        self.total = total_bytes
        self.label = label
        self.bytes = self.documents = self.tokens = 0
        self.show = show
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes, unit="B", unit_scale=True, desc=label, file=sys.stderr
            )

    def rates(self) -> str:
        seconds = max(time.monotonic() - self.started, 1e-9)
        return (
            f"{self.documents / seconds:,.0f} docs/s, {self.tokens / seconds:,.0f} tokens/s, "
            f"{self.bytes / 1e6 / seconds:,.1f} MB/s"
        )

    def update(self, input_bytes: int, documents: int, tokens: int) -> None:
        self.bytes += input_bytes
        self.documents += documents
        self.tokens += tokens
        if self.bar is not None:
            self.bar.set_postfix_str(self.rates(), refresh=False)
            self.bar.update(input_bytes)
        elif self.show and time.monotonic() - self.last_line >= self.LOG_LINE_SECONDS:
            self.last_line = time.monotonic()
            share = self.bytes / max(self.total, 1)
            print(
                f"{self.label}: {share:.0%} of {self.total / 1e6:,.1f} MB, {self.rates()}",
                file=sys.stderr,
                flush=True,
            )

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def summary(self) -> str:
        seconds = max(time.monotonic() - self.started, 1e-9)
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens, {self.bytes / 1e6:,.1f} MB "
            f"in {seconds:.1f} s ({self.rates()})"
        )


class _Runner:
    def __init__(self, run: CorpusRun) -> None:
        self.run = run
        self.prefix = Path(run.output_prefix)
        check_output_prefix(self.prefix)
        self.parts = PartsDirectory(self.prefix)
        self.lines: list[str] = []

    def execute(self) -> Outcome:
        run = self.run
        if run.workers <= 1:  # this process tokenizes: on one core, as asked
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        tokenizer = self.tokenizer = run.tokenizer.build()
        files = expand_inputs(run.inputs, self.prefix)
        settings = Settings(
            tokenizer=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            eod=tokenizer.eod,
            json_key=run.json_key,
            unit_bytes=run.unit_bytes,
            inputs=tuple(str(p.resolve()) for p in files),
        )
        units = plan_units(files, run.unit_bytes)
        # A task makes nothing before it has found the plan that --plan-only wrote.
        check_output_place(self.prefix, create=run.task is None)
        if run.task is not None:
            return self._task(settings, units)
        self.parts.create()
        lock = FileLock(self.parts.root / "lock")
        if not lock.acquire():
            raise PreprocessError(
                f"another preprocess ({lock.holder()}) is writing {self.prefix}: wait for it "
                "to end, or stop it"
            )
        try:
            return self._plain(settings, units)
        finally:
            lock.release()

    # -- a plain run --------------------------------------------------------------------

    def _plain(self, settings: Settings, units: list[Unit]) -> Outcome:
        run, prefix = self.run, self.prefix
        self._remove_stale_merges()
        digest = plan_digest(settings, units)
        up_to_date = self._published_digest() == digest
        # Read where it decides: whether it is up to date, or why it is refused.
        damage = self._damage_to_published() if up_to_date or not run.overwrite else None
        if up_to_date and damage is None:
            metadata = DatasetMetadata.load(prefix)
            self.lines.append(f"{prefix}.bin/.idx are up to date: nothing to do")
            return Outcome(self.lines, metadata)
        start_over = self._compare_with_earlier_plan(settings, units)
        published = [s for s in (".bin", ".idx") if Path(f"{prefix}{s}").exists()]
        if published and not run.overwrite:
            if damage is not None:
                raise PreprocessError(f"{damage} (--overwrite writes {prefix}.bin/.idx again)")
            raise PreprocessError(
                f"{prefix}.bin/.idx exist and are not this run's output: --overwrite replaces "
                "them (a training run reading them keeps its open files, and its resume then "
                "refuses the new data)"
            )
        if start_over:
            shutil.rmtree(self.parts.units)
            self.parts.create()
        self._forget_extra_units(len(units))
        self.parts.save_plan(settings, units)
        todo = [u for u in units if self.parts.receipt(u) is None]
        done_before = len(units) - len(todo)
        if run.plan_only:
            self.lines.append(
                f"planned {len(units)} units of {len(settings.inputs)} inputs in "
                f"{self.parts.root} ({done_before} done)"
            )
            return Outcome(self.lines)
        held = self._tokenize(todo, f"tokenizing -> {prefix.name}")[HELD]
        if held:
            raise PreprocessError(
                f"{len(held)} units of {prefix} are being tokenized by another process "
                f"(e.g. {held[0].describe()}): rerun once it has ended"
            )
        if done_before:
            self.lines.insert(0, f"resumed: {done_before} of {len(units)} units were done before")
        return self._merge(settings, units, digest)

    def _remove_stale_merges(self) -> None:
        # Escaped: a prefix 'out[1]' would match another run's 'out1.tmp-*' as a pattern.
        pattern = f"{glob.escape(self.prefix.name)}.tmp-*"
        for stale in sorted(self.prefix.parent.glob(pattern)):
            stale.unlink(missing_ok=True)
            self.lines.append(f"removed {stale}: left by a run that stopped before publishing")

    def _damage_to_published(self) -> str | None:
        """What is wrong with the published ``PREFIX.bin/.idx`` (cut short by an
        interrupted copy, say), which the digest of their plan cannot tell; None when both
        are whole or there are none."""
        if not all(Path(f"{self.prefix}{s}").is_file() for s in (".bin", ".idx")):
            return None
        try:
            check_token_file(str(self.prefix))
        except DataError as err:
            return str(err)
        return None

    def _published_digest(self) -> str | None:
        import json

        if not all(Path(f"{self.prefix}{s}").is_file() for s in (".bin", ".idx", ".json")):
            return None
        try:
            return json.loads(Path(f"{self.prefix}.manifest.json").read_text()).get("plan")
        except (OSError, ValueError, AttributeError):
            return None

    def _compare_with_earlier_plan(self, settings: Settings, units: list[Unit]) -> bool:
        """Whether to start over (other settings, with ``overwrite``; refused without);
        names the inputs that changed since an earlier run tokenized them. An earlier plan
        this version cannot read is refused likewise, and started over with ``overwrite``."""
        try:
            earlier = self.parts.load_plan()
        except PreprocessError:
            if not self.run.overwrite:
                raise
            plan = self.parts.root / "plan.json"
            self.lines.append(f"{plan} is not a plan this version can read: started over")
            return True
        if earlier is None:
            return False
        old_settings, old_units = earlier
        if differences := settings.differences(old_settings):
            if not self.run.overwrite:
                raise PreprocessError(
                    f"{self.parts.root} holds a run with other settings ("
                    f"{'; '.join(differences)}): rerun with its settings to continue it, "
                    "or --overwrite to start over"
                )
            return True
        now = {u.path: u for u in units}
        for old in {u.path: u for u in old_units}.values():
            new = now[old.path]
            if (old.size, old.mtime_ns) != (new.size, new.mtime_ns):
                self.lines.append(
                    f"{old.path} changed since it was tokenized (size {old.size} -> "
                    f"{new.size} bytes, modified {time.ctime(new.mtime_ns / 1e9)}): redoing it"
                )
        return False

    def _forget_extra_units(self, count: int) -> None:
        for path in self.parts.units.iterdir():
            stem = path.name.split(".")[0]
            if stem.isdigit() and int(stem) >= count and not path.name.endswith(".lock"):
                path.unlink(missing_ok=True)

    def _merge(self, settings: Settings, units: list[Unit], digest: str) -> Outcome:
        from megatron_lns.data.preprocess_manifest import manifest

        prefix = self.prefix
        receipts = [self.parts.receipt(u) for u in units]
        assert all(receipts)
        bad = sum(len(r["bad_records"]) for r in receipts)
        records = sum(r["documents"] for r in receipts) + bad
        if why := self.run.bad_records.exceeded(bad, records):
            raise PreprocessError(
                f"{bad} bad records in all, {why} (listed in {self.parts.units}/*.json); "
                "nothing published"
            )
        if records == bad:  # as preprocess() refuses: a dataset training cannot sample
            inputs = ", ".join(settings.inputs[:3])
            more = f" and {len(settings.inputs) - 3} more" if len(settings.inputs) > 3 else ""
            why = "the input is empty"
            if bad:
                why = f"every record is bad ({bad}, listed in {self.parts.units}/*.json)"
            raise PreprocessError(f"no documents in {inputs}{more}: {why}; nothing published")
        temporary = temporary_prefix(prefix)
        untouched = (
            f"; {prefix}.bin/.idx left as they were"
            if Path(f"{prefix}.bin").exists()
            else "; nothing published (the units are kept)"
        )
        started = time.monotonic()
        with (
            StopSignals() as stop,
            disk_full_reported(
                f"{prefix}.bin", then=untouched, cleanup=lambda: remove_temporaries(temporary)
            ),
        ):
            try:
                parts = [self.parts.prefix(u) for u in units]
                dataset_id = merge_token_files(parts, temporary, token_dtype(settings.vocab_size))
                metadata = DatasetMetadata(
                    tokenizer=settings.tokenizer,
                    vocab_size=settings.vocab_size,
                    eod=settings.eod,
                    max_token_id=max_token_id(receipts),
                    num_documents=sum(r["documents"] for r in receipts),
                    num_tokens=sum(r["tokens"] for r in receipts),
                    dataset_id=dataset_id,
                )
                metadata.save(f"{temporary}.json")
                write_json_atomically(
                    Path(f"{temporary}.manifest.json"),
                    manifest(settings, digest, units, receipts),
                )
                stop.check()
                publish(temporary, prefix, (".bin", ".idx", ".manifest.json", ".json"))
            finally:
                remove_temporaries(temporary)
        skipped = f"; {bad} bad records skipped (listed in {prefix}.manifest.json)" if bad else ""
        self.lines.append(
            f"wrote {prefix}.bin/.idx: {metadata.num_documents:,} documents, "
            f"{metadata.num_tokens:,} tokens from {len(settings.inputs)} inputs ({len(units)} "
            f"units, merged in {time.monotonic() - started:.1f} s), tokenizer "
            f"{metadata.tokenizer} (vocab {metadata.vocab_size}){skipped}"
        )
        return Outcome(self.lines, metadata)

    # -- one task of several ------------------------------------------------------------

    def _task(self, settings: Settings, units: list[Unit]) -> Outcome:
        task, tasks = self.run.task
        earlier = self.parts.load_plan()
        if earlier is None or earlier != (settings, units):
            why = "is missing" if earlier is None else "is another run's or outdated"
            raise PreprocessError(
                f"--task {task}/{tasks}: the plan {self.parts.root}/plan.json {why}: run the "
                "same command with --plan-only first (the SLURM job does)"
            )
        self.parts.create()
        share = task_share(units, task, tasks)
        todo = [u for u in share if self.parts.receipt(u) is None]
        outcomes = self._tokenize(todo, f"task {task}/{tasks}")
        elsewhere, held = outcomes[DONE_ELSEWHERE], outcomes[HELD]
        self.lines.append(
            f"task {task}/{tasks}: {len(share)} units, {len(outcomes[TOKENIZED])} tokenized "
            f"now, {len(share) - len(todo)} done before"
            + (f", {len(elsewhere)} done by another process" if elsewhere else "")
            + (f", {len(held)} held by another process" if held else "")
        )
        return Outcome(self.lines)

    # -- tokenizing units ---------------------------------------------------------------

    def _tokenize(self, todo: list[Unit], label: str) -> dict[str, list[Unit]]:
        """Tokenize ``todo``: its units by what became of each (``UNIT_OUTCOMES``)."""
        outcomes: dict[str, list[Unit]] = {outcome: [] for outcome in UNIT_OUTCOMES}
        if not todo:
            return outcomes
        progress = _Progress(sum(u.bytes for u in todo), label, self.run.progress)
        try:
            if self.run.workers <= 1:
                self._tokenize_here(todo, progress, outcomes)
            else:
                self._tokenize_in_workers(todo, progress, outcomes)
        except (KeyboardInterrupt, SystemExit):
            progress.close()
            kept = sum(self.parts.receipt(u) is not None for u in todo)
            print(
                f"stopped: {kept} of the {len(todo)} units to do were finished and are kept in "
                f"{self.parts.units}; rerun the same command to continue",
                file=sys.stderr,
            )
            raise
        finally:
            progress.close()
        elsewhere = outcomes[DONE_ELSEWHERE]
        finished = f" ({len(elsewhere)} more finished by another process)" if elsewhere else ""
        self.lines.append(
            f"tokenized {len(outcomes[TOKENIZED])} units{finished}: {progress.summary()}"
        )
        return outcomes

    def _event(self, progress: _Progress, kind: str, payload: object) -> None:
        if kind == "progress":
            progress.update(*payload)
        elif kind == "bad":
            progress.write(f"warning: {payload}")
        elif kind == "removed":
            progress.write(f"removed {payload}: left by a run that stopped before finishing it")

    def _tokenize_here(
        self, todo: list[Unit], progress: _Progress, outcomes: dict[str, list[Unit]]
    ) -> None:
        run = self.run
        units = UnitTokenizer(self.parts, self.tokenizer, run.json_key, run.bad_records)
        with StopSignals() as stop:

            def report(kind: str, payload: object) -> None:
                stop.check()
                self._event(progress, kind, payload)

            for unit in todo:
                outcomes[units.tokenize(unit, report)].append(unit)

    def _tokenize_in_workers(
        self, todo: list[Unit], progress: _Progress, outcomes: dict[str, list[Unit]]
    ) -> None:
        run = self.run
        processes = min(run.workers, len(todo))
        threads = max(1, run.workers // processes)
        context = multiprocessing.get_context("spawn")
        pending, results = context.Queue(), context.Queue()
        for unit in todo:
            pending.put(unit)
        for _ in range(processes):
            pending.put(None)
        spec = run.tokenizer.for_workers(self.tokenizer)
        arguments = (spec, str(self.prefix), run.json_key, run.bad_records, threads)
        workers = [
            context.Process(target=worker_main, args=(*arguments, pending, results), daemon=True)
            for _ in range(processes)
        ]
        by_index = {u.index: u for u in todo}
        in_flight: set[int] = set()
        remaining = len(todo)
        finished = False
        with StopSignals() as stop:
            try:
                for worker in workers:
                    worker.start()
                while remaining:
                    stop.check()
                    try:
                        kind, index, payload = results.get(timeout=0.2)
                    except queue.Empty:
                        stop.check()  # a signal to the group may have reached a worker first
                        self._check_workers(workers, in_flight, by_index)
                        continue
                    if kind == "start":
                        in_flight.add(index)
                    elif kind in UNIT_OUTCOMES:
                        in_flight.discard(index)
                        remaining -= 1
                        outcomes[kind].append(by_index[index])
                    elif kind == "error":
                        user, text = payload
                        if user:
                            raise PreprocessError(text)
                        where = by_index[index].describe() if index in by_index else "start-up"
                        raise RuntimeError(f"a worker failed ({where}):\n{text}")
                    else:
                        self._event(progress, kind, payload)
                finished = True
            finally:
                for worker in workers:  # they ignore SIGTERM (see worker_main)
                    if worker.is_alive():
                        worker.kill()
                for worker in workers:
                    worker.join()
                for channel in (pending, results):
                    channel.cancel_join_thread()
                    channel.close()
                if not finished:  # what the killed workers were writing
                    for unit in todo:
                        self.parts.remove_abandoned(unit)

    @staticmethod
    def _check_workers(workers, in_flight: set[int], by_index: dict[int, Unit]) -> None:
        for worker in workers:
            code = worker.exitcode
            if code is not None and code != 0:
                how = f"signal {-code}" if code < 0 else f"exit status {code}"
                where = ", ".join(by_index[i].describe() for i in sorted(in_flight)) or "a unit"
                raise PreprocessError(
                    f"a worker process died ({how}) while tokenizing {where}; the finished "
                    "units are kept: rerun the same command to continue"
                )
