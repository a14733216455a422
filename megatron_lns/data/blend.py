"""The data blend: which token files a run reads, and in what proportions.

NeMo's ``model.data.data_prefix`` is ``[path, ...]`` or ``[weight, path, weight, path,
...]``; a path may name a built-in corpus (``builtin:pydoc``), which is tokenized with
the run's tokenizer and cached on first use. This module is the one owner of that
syntax: parsing it, checking its files exist, and preparing built-in corpora.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_lns.base.path_kind import not_a_file
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.errors import DataError

BUILTIN_PREFIX = "builtin:"
BUILTIN_CORPORA: dict[str, Callable[[], list[str]]] = {"pydoc": demo_documents}


class DataBlendError(DataError):
    """A data prefix list that cannot be read as a blend, or names missing files."""


def cache_dir() -> Path:
    """Where built-in corpora are cached (``$MEGATRON_LNS_CACHE``, default ~/.cache)."""
    root = os.environ.get("MEGATRON_LNS_CACHE") or Path.home() / ".cache" / "megatron_lns"
    return Path(root)


def _unknown_builtin(name: str) -> str:
    return f"unknown built-in corpus '{BUILTIN_PREFIX}{name}'; available: " + ", ".join(
        BUILTIN_PREFIX + n for n in BUILTIN_CORPORA
    )


def builtin_dataset_prefix(
    name: str, library: str, tokenizer_type: str | None, tokenizer_model: str | None
) -> Path:
    """Prefix of the prepared built-in corpus ``name``, preprocessing it on first use."""
    if name not in BUILTIN_CORPORA:
        raise DataBlendError(_unknown_builtin(name))
    key = hashlib.sha256(f"{library}|{tokenizer_type}|{tokenizer_model}".encode()).hexdigest()[:12]
    prefix = cache_dir() / f"{name}_{library}_{key}"
    # preprocess() writes under a name unique to the process and renames the .json into
    # place last: processes preparing at once each publish a complete (and identical)
    # dataset, and an interrupted preparation leaves nothing that looks prepared.
    if not all(Path(f"{prefix}{suffix}").is_file() for suffix in (".bin", ".idx", ".json")):
        # Imported here: the config layer parses blends without importing torch.
        from megatron_lns.data.preprocess import preprocess

        preprocess(BUILTIN_CORPORA[name](), prefix, library, tokenizer_type, tokenizer_model)
    return prefix


@dataclass(frozen=True)
class DataBlend:
    """Dataset prefixes and their sampling weights (``None``: proportional to size)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None = None

    @classmethod
    def parse(cls, data_prefix: list | tuple | str) -> DataBlend:
        """NeMo's ``data_prefix``: ``[path, ...]``, ``[w, path, w, path, ...]`` or one path."""
        items = [data_prefix] if isinstance(data_prefix, str) else list(data_prefix)
        if not items:
            raise DataBlendError("data_prefix is empty: give at least one dataset prefix")
        if all(isinstance(x, str) for x in items):
            return cls(tuple(items))
        if len(items) % 2 or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in items[0::2]
        ):
            raise DataBlendError(
                "data_prefix must be [path, ...] or [weight, path, weight, path, ...]"
            )
        weights = tuple(float(w) for w in items[0::2])
        if any(w <= 0 for w in weights):
            raise DataBlendError(f"data_prefix weights must be positive, got {list(weights)}")
        return cls(tuple(str(p) for p in items[1::2]), weights)

    def check_builtin_names(self) -> None:
        """Refuse a ``builtin:`` name no corpus has: known without preparing anything, so
        it is refused before a job is queued, not when its ranks start."""
        for prefix in self.prefixes:
            name = prefix[len(BUILTIN_PREFIX) :]
            if prefix.startswith(BUILTIN_PREFIX) and name not in BUILTIN_CORPORA:
                raise DataBlendError(f"data_prefix: {_unknown_builtin(name)}")

    def file_problems(self) -> list[str]:
        """What is wrong with each ``.bin``/``.idx`` file of the non-built-in prefixes
        that is not a regular file: ``"PATH does not exist"``, ``"PATH is a directory,
        not a file"``. A prefix that names a directory gets a hint: the prefix is the
        files' path without its suffix, not the directory that holds them."""
        problems = []
        for prefix in self.prefixes:
            if prefix.startswith(BUILTIN_PREFIX):
                continue
            for suffix in (".bin", ".idx"):
                if problem := not_a_file(prefix + suffix):
                    hint = (
                        f" ({prefix} is a directory: give the path of its files without "
                        f".bin/.idx, e.g. {Path(prefix) / 'NAME'})"
                        if Path(prefix).is_dir()
                        else ""
                    )
                    problems.append(f"{prefix}{suffix} {problem}{hint}")
        return problems

    def resolved(
        self, library: str, tokenizer_type: str | None, tokenizer_model: str | None
    ) -> DataBlend:
        """The blend with built-in corpora replaced by their prepared prefixes.

        Rank 0 tokenizes a built-in corpus that is not cached yet while the other ranks
        wait, then every rank reads the cache; if rank 0 fails, every rank raises its
        error instead of waiting forever.
        """
        tokenizer = (library, tokenizer_type, tokenizer_model)
        prefixes = []
        for prefix in self.prefixes:
            if prefix.startswith(BUILTIN_PREFIX):
                name = prefix[len(BUILTIN_PREFIX) :]
                _prepare_on_rank_zero(builtin_dataset_prefix, name, *tokenizer)
                prefix = str(builtin_dataset_prefix(name, *tokenizer))
            prefixes.append(prefix)
        return DataBlend(tuple(prefixes), self.weights)


def _prepare_on_rank_zero(prepare: Callable[..., object], *args: object) -> None:
    """Run ``prepare(*args)`` on rank 0 only; the other ranks learn whether it succeeded."""
    import torch.distributed as dist

    if not dist.is_initialized():
        prepare(*args)
        return
    outcome: list[str | None] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            prepare(*args)
        except Exception as err:
            failure, outcome[0] = err, str(err) or type(err).__name__
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise DataBlendError(f"rank 0 could not prepare the built-in corpus: {outcome[0]}")
