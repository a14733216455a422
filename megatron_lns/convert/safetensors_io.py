"""Safetensors on both sides: sharded writing in layer order, checked reading.

Writing: tensors come in groups (the embedding, one transformer layer, the head);
groups are packed in order into shards of at most ``max_shard_bytes`` (a larger group
gets a shard of its own), so only one shard's tensors are held at a time. The index
is made from what was written and checked against the files before it is kept.

Reading: ``model.safetensors`` or an index with its shards; every failure (missing
shard, truncated file, missing tensor, wrong shape) names the file or tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_lns.base.disk import disk_full_reported
from megatron_lns.convert.errors import ConversionError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MiB"``, ``"1000000"`` -> bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConversionError(f"--max-shard-size {text!r} is not a size like 2GB or 500MB")
    number, unit = match.groups()
    size = int(float(number) * _UNITS[(unit or "").lower()])
    if size <= 0:
        raise ConversionError(f"--max-shard-size must be positive, got {text!r}")
    return size


# A group: its tensors' names and shapes, and a function that produces the tensors.
Group = tuple[dict[str, tuple[int, ...]], Callable[[], dict[str, torch.Tensor]]]


def write_sharded(
    out_dir: Path,
    groups: list[Group],
    dtype: torch.dtype,
    max_shard_bytes: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """Write the groups' tensors as safetensors shards; returns the weight map."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[int]] = []
    shard_bytes = 0
    for i, (shapes, _) in enumerate(groups):
        size = sum(_numel(shape) for shape in shapes.values()) * itemsize
        if not shards or shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(i)
        shard_bytes += size
    planned_bytes = sum(
        _numel(shape) * itemsize for shapes, _ in groups for shape in shapes.values()
    )
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for shard_index, group_indices in enumerate(shards):
        tensors: dict[str, torch.Tensor] = {}
        for i in group_indices:
            shapes, produce = groups[i]
            produced = produce()
            if produced.keys() != shapes.keys():
                raise AssertionError(
                    f"group {i} produced {sorted(produced)}, planned {sorted(shapes)}"
                )
            for name, tensor in produced.items():
                if tuple(tensor.shape) != shapes[name] or tensor.dtype != dtype:
                    raise AssertionError(
                        f"{name}: {tensor.shape} {tensor.dtype}, planned {shapes[name]} {dtype}"
                    )
                tensors[name] = tensor.contiguous()
        path = out_dir / names[shard_index]
        with disk_full_reported(path, needed=planned_bytes):
            _save_file(tensors, path)
        total_bytes += sum(t.numel() * itemsize for t in tensors.values())
        weight_map |= dict.fromkeys(tensors, names[shard_index])
        if progress is not None:
            progress(f"wrote {names[shard_index]} ({len(tensors)} tensors)")
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    check_written(out_dir, weight_map)
    return weight_map


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file``, whose I/O errors carry only text ("... (os error 28)"): raised as
    the ``OSError`` they were, so that a full disk is told apart."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from err


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_written(out_dir: Path, weight_map: dict[str, str]) -> None:
    """Reopen every shard: each must hold exactly the tensors the weight map gives it."""
    by_file: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, set()).add(name)
    for file, expected in by_file.items():
        with safe_open(str(out_dir / file), framework="pt") as f:
            stored = set(f.keys())
        if stored != expected:
            raise ConversionError(
                f"{file} holds {sorted(stored ^ expected)[:3]} unlike the index (write failed?)"
            )


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face model directory (safetensors only), read lazily.

    Names, shapes and dtypes come from the file headers, read once. No file stays open:
    :meth:`read` opens the files its tensors lie in and closes them again. safetensors'
    tensors are views of the file's memory mapping, so the pages a read touched are
    given back with its tensors, and reading a model group by group holds one group.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index_path, single = directory / INDEX_FILE, directory / SINGLE_FILE
        # name -> (shape, safetensors dtype code), of the tensors of every file
        self._header: dict[str, tuple[tuple[int, ...], str]] = {}
        if index_path.is_file():
            try:
                self.weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise ConversionError(f"{index_path} is not a safetensors index: {err}") from err
        elif single.is_file():
            self.weight_map = dict.fromkeys(self._read_header(single), SINGLE_FILE)
        else:
            pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(
                p.name for p in directory.glob("*.pt")
            )
            hint = f" (found {pickles[0]}: pickled weights are not read)" if pickles else ""
            raise ConversionError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")
        for file in sorted(set(self.weight_map.values())):
            stored = set(self._read_header(directory / file))
            listed = {name for name, f in self.weight_map.items() if f == file}
            if listed - stored:
                raise ConversionError(
                    f"{directory / file} lacks {sorted(listed - stored)[0]} which the index "
                    "lists there"
                )

    def _read_header(self, path: Path) -> list[str]:
        """The names of the tensors in ``path``; records their shapes and dtypes."""
        if not path.is_file():
            raise ConversionError(f"safetensors file {path} is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                for name in names:
                    part = f.get_slice(name)
                    self._header.setdefault(name, (tuple(part.get_shape()), part.get_dtype()))
        except (SafetensorError, OSError) as err:
            raise ConversionError(f"{path} is not a readable safetensors file: {err}") from err
        return names

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> Iterator[str]:
        return iter(self.weight_map)

    def _path(self, name: str) -> Path:
        if name not in self.weight_map:
            raise ConversionError(f"{self.directory}: tensor '{name}' is missing")
        return self.directory / self.weight_map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name``, from the file header (nothing is read)."""
        self._path(name)
        return self._header[name][0]

    def dtype(self, name: str) -> torch.dtype:
        """dtype of tensor ``name``, from the file header (nothing is read)."""
        self._path(name)
        code = self._header[name][1]
        if code not in _DTYPES:
            raise ConversionError(f"{self.directory}: tensor '{name}' has dtype {code}")
        return _DTYPES[code]

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Tensor ``name`` exists with shape ``shape`` (from the header)."""
        if self.shape(name) != tuple(shape):
            raise ConversionError(
                f"{self._path(name)}: tensor '{name}' has shape {self.shape(name)}, "
                f"config.json implies {tuple(shape)}"
            )

    def read(self, shapes: dict[str, tuple[int, ...] | None]) -> dict[str, torch.Tensor]:
        """The tensors named by ``shapes``, each of its shape where one is given; each
        file they lie in is opened once."""
        by_file: dict[Path, list[str]] = {}
        for name, shape in shapes.items():
            if shape is not None:
                self.check(name, shape)
            by_file.setdefault(self._path(name), []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, names in by_file.items():
            name = names[0]
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in names:
                        out[name] = f.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as err:
                raise ConversionError(f"{path}: cannot read tensor '{name}': {err}") from err
        return {name: out[name] for name in shapes}

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor ``name``; its shape must be ``shape`` when given."""
        return self.read({name: shape})[name]
