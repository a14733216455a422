"""import-hf accounts for every field of config.json (megatron_lns/convert/hf_fields.py):
a field it cannot map that is not at the config class's default is refused in one line
naming it; metadata, generation settings, inert fields and defaults pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import MIXTRAL, QWEN2_MOE, VOCAB, assert_nothing_written, run_config, silent
from test_convert import _tiny_hf_llama

from megatron_lns.config import load_config
from megatron_lns.convert import ConversionError, import_hf
from megatron_lns.convert.architectures import ARCHITECTURES
from megatron_lns.convert.architectures.mixtral import Mixtral
from megatron_lns.convert.architectures.qwen2_moe import Qwen2Moe
from megatron_lns.convert.hf_import import _read_architecture, read_hf_config


def _edited(source: Path, changes: dict, drop: tuple[str, ...] = ()) -> Path:
    """``source``'s config.json with ``changes`` written in and ``drop`` taken out."""
    path = source / "config.json"
    config = json.loads(path.read_text())
    for field in drop:
        config.pop(field, None)
    path.write_text(json.dumps(config | changes))
    return source


def test_import_refuses_unmapped_fields_away_from_their_defaults_in_one_line(seeded, tmp_path):
    source = _edited(_tiny_hf_llama(tmp_path / "source"), {"qk_norm": True, "pretraining_tp": 2})
    with pytest.raises(ConversionError) as refused:
        import_hf(source, tmp_path / "imported", progress=silent)
    assert str(refused.value) == (
        f"{source}/config.json: pretraining_tp=2, qk_norm=true: fields import-hf cannot map "
        "into a LlamaForCausalLM, not at LlamaConfig's defaults: the imported model would "
        "compute something else"
    )
    assert_nothing_written(tmp_path / "imported")


def test_import_takes_metadata_generation_settings_and_defaults(seeded, tmp_path):
    """A config.json as transformers 4 wrote them (rope_theta, a null rope_scaling,
    torch_dtype, sampling settings), with metadata, a field at its default and a null
    field LlamaConfig does not have."""
    source = _edited(
        _tiny_hf_llama(tmp_path / "source"),
        {
            "rope_theta": 50000.0,
            "rope_scaling": None,
            "torch_dtype": "float32",
            "transformers_version": "4.40.0",
            "use_cache": False,
            "temperature": 0.7,
            "max_length": 4096,
            "_name_or_path": "some/model",
            "pretraining_tp": 1,
            "sliding_window": None,
        },
        drop=("rope_parameters", "dtype"),
    )
    cfg = load_config(import_hf(source, tmp_path / "imported", progress=silent))
    assert cfg.model.rotary_base == 50000


def _exported_config(arch, tmp_path: Path) -> Path:
    """The config.json ``arch`` writes on export, alone in a directory."""
    moe = {}
    if arch.moe:
        moe = QWEN2_MOE | dict(moe_layer_freq=[0, 1, 1, 1]) if arch.hf_shared_expert else MIXTRAL
    model = run_config(**moe, normalization=arch.norm).model
    exported = arch.from_model_config(model)
    exported.hf_config(VOCAB, torch.float32, None, 0).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda arch: arch.hf_class)
def test_every_field_each_architecture_writes_is_accounted_for(tmp_path, arch):
    """What export writes imports, and an unknown field away from its default does not."""
    hf_dir = _exported_config(arch, tmp_path)
    _read_architecture(hf_dir, read_hf_config(hf_dir), lns=False)
    _edited(hf_dir, {"attn_logit_softcapping": 30.0})
    with pytest.raises(ConversionError, match=r"attn_logit_softcapping=30.0: a field import-hf"):
        _read_architecture(hf_dir, read_hf_config(hf_dir), lns=False)


def test_inert_fields_of_a_stock_qwen2_moe_config_are_accounted_for(tmp_path):
    """Qwen1.5-MoE's config.json keeps a sliding window it does not use
    (use_sliding_window false) and its window layers; Mixtral's router jitter acts in
    training mode only."""
    qwen = _edited(
        _exported_config(Qwen2Moe, tmp_path / "qwen"),
        {"sliding_window": 32768, "max_window_layers": 21, "output_router_logits": True},
    )
    _read_architecture(qwen, read_hf_config(qwen), lns=False)
    mixtral = _edited(_exported_config(Mixtral, tmp_path / "mixtral"), {"router_jitter_noise": 0.1})
    _read_architecture(mixtral, read_hf_config(mixtral), lns=False)
