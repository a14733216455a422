"""import-hf in bounded memory: the checkpoint is streamed one layer at a time
(megatron_lns/convert/streaming_save.py), holds what megatron's own writer writes, and a
model larger than the memory the import may use converts."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from hf_parity import import_refuses_edited_config, silent
from safetensors import safe_open
from test_convert import _tiny_hf_llama

from megatron_lns.config import load_config, to_yaml
from megatron_lns.convert import import_hf
from megatron_lns.convert.checkpoint_reader import CheckpointReader

sys.path.insert(0, str(ROOT / "benchmarks"))
import convert_peak_rss as peak_rss


def _items(directory: Path) -> tuple[dict, dict[str, bytes]]:
    """A checkpoint's DCP metadata by key, and the stored bytes of every item."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata()
    stored = {}
    for index, info in metadata.storage_data.items():
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            stored[f"{index.fqn}@{tuple(index.offset or ())}"] = f.read(info.length)
    return metadata.state_dict_metadata, stored


def test_streamed_checkpoint_holds_what_megatrons_writer_writes(seeded, tmp_path):
    """Loaded into a real model and saved again by megatron's own writer, the imported
    checkpoint gives the same tensors, chunks, objects and bytes item for item."""
    from megatron_lns.convert.hf_import import _single_process_megatron
    from megatron_lns.training.build import build_weights_model
    from megatron_lns.training.checkpoint import load_model_weights, save_weights_only_checkpoint

    source = _tiny_hf_llama(tmp_path / "source")
    cfg = load_config(import_hf(source, tmp_path / "imported", progress=silent))
    streamed = tmp_path / "imported" / "checkpoints" / "iter_0000000"
    resaved = tmp_path / "resaved"
    with _single_process_megatron():
        model = build_weights_model(cfg, 257)
        load_model_weights([model], streamed)
        save_weights_only_checkpoint([model], resaved, to_yaml(cfg))
    (streamed_md, streamed_bytes), (resaved_md, resaved_bytes) = map(_items, (streamed, resaved))
    assert streamed_md == resaved_md
    assert streamed_bytes.keys() == resaved_bytes.keys()
    for item, data in streamed_bytes.items():
        assert data == resaved_bytes[item], item


def test_import_reads_each_layer_once_in_order(seeded, tmp_path, monkeypatch):
    """Each layer's Hugging Face tensors are read in one read of their own, once, in
    layer order (the slow test below shows what that does to memory)."""
    from megatron_lns.convert import hf_import

    source = _tiny_hf_llama(tmp_path / "source")
    reads: list[list[str]] = []
    original = hf_import.SafetensorsCheckpoint.read

    def read(self, shapes):
        reads.append(sorted(shapes))
        return original(self, shapes)

    monkeypatch.setattr(hf_import.SafetensorsCheckpoint, "read", read)
    import_hf(source, tmp_path / "imported", progress=silent)
    layers = [r for r in reads if any(".layers." in name for name in r)]
    assert [r[0].split(".")[2] for r in layers] == ["0", "1", "2"]
    assert all(len({name.split(".")[2] for name in r}) == 1 for r in layers)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny Hugging Face Llama (hidden size 64, 4 heads, 3 layers): copy it to edit it."""
    return _tiny_hf_llama(tmp_path_factory.mktemp("llama") / "source")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_attention_heads": 5},
            r"config.json: Class validation error for validator 'validate_architecture': "
            r"ValueError: The hidden size \(64\) is not a multiple of the number of attention "
            r"heads \(5\)",
        ),
        (
            {"hidden_size": "64"},
            r"config.json: Validation error for field 'hidden_size': TypeError: Field "
            r"'hidden_size' expected int, got str",
        ),
        (
            {"num_hidden_layers": 0},
            r"config.json: num_hidden_layers=0 is not a model's: give a whole number of at "
            r"least 1$",
        ),
    ],
    ids=["heads-do-not-divide-hidden", "hidden-size-a-string", "no-layers"],
)
def test_impossible_config_json_values_are_one_line_naming_the_field(
    seeded, tmp_path, tiny_llama, changes, message
):
    """transformers' strict field checks (huggingface_hub's StrictDataclass errors, which
    are no ValueError) and a model of zero layers (a range of step 0 in the hybrid twin
    pattern) ended in tracebacks."""
    source = shutil.copytree(tiny_llama, tmp_path / "source")
    import_refuses_edited_config(source, changes, message)


@pytest.mark.long
@pytest.mark.slow
def test_import_fits_an_address_space_smaller_than_the_model(tmp_path):
    """A model larger than the memory the import may use beyond what an import of a tiny
    model maps converts; with less room than one layer the same import fails.

    The limit is RLIMIT_AS (the address space: every heap, stack and file mapping), set
    in the importing process: it needs no privileges, and resident memory is a part of
    the address space, so it is bounded too (cgroup memory limits are not available
    to an unprivileged test). The baseline is the peak address space of the same
    command importing a one-layer model of width 64."""
    tiny = tmp_path / "tiny"
    peak_rss.write_synthetic_llama(tiny, layers=1, hidden=64, ffn=128, heads=4)
    baseline = peak_rss.run_cli(["import-hf", str(tiny), str(tmp_path / "tiny-run")])
    assert baseline["returncode"] == 0, baseline["output_tail"]
    hf = tmp_path / "hf"
    sizes = peak_rss.write_synthetic_llama(hf, layers=LAYERS, hidden=1024, ffn=4096, heads=8)
    assert sizes["model_bytes"] - sizes["layer_bytes"] > BUDGET
    limit = baseline["vm_peak_bytes"] + BUDGET
    run = tmp_path / "run"
    done = peak_rss.run_cli(["import-hf", str(hf), str(run)], limit_as=limit)
    assert done["returncode"] == 0, done["output_tail"]
    reader = CheckpointReader(run / "checkpoints" / "iter_0000000")
    down = reader.read_layer(["decoder.layers.mlp.linear_fc2.weight"], LAYERS - 1)
    last = f"model.layers.{LAYERS - 1}.mlp.down_proj.weight"
    with safe_open(str(hf / f"model-{LAYERS + 1:05d}-of-{LAYERS + 2:05d}.safetensors"), "pt") as f:
        assert torch.equal(down["decoder.layers.mlp.linear_fc2.weight"], f.get_tensor(last))
    starved = peak_rss.run_cli(
        ["import-hf", str(hf), str(tmp_path / "starved")], limit_as=baseline["vm_peak_bytes"]
    )
    assert starved["returncode"] != 0
    assert "MemoryError" in starved["output_tail"] or "memory" in starved["output_tail"].lower()


# The model: LAYERS wide layers of 64 MiB in fp32; the import may map BUDGET bytes more
# than the tiny import did.
LAYERS = 8
BUDGET = 400 * 2**20
