"""What the conversion tests share: the byte vocabulary they train on, sample tokens, the
logits of a megatron checkpoint and of a Hugging Face directory, and the parity check
between them (fp32 on both sides, which compute in different orders)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import TINY_MODEL

from megatron_lns.config import to_yaml
from megatron_lns.data.tokenizer import ByteTokenizer
from megatron_lns.model.language_model import build_model
from megatron_lns.training.build import model_config
from megatron_lns.training.checkpoint import load_model_weights, save_model_weights

VOCAB = ByteTokenizer().vocab_size  # 257, padded to 384 in the checkpoints
SEQ = 16
# Tiny mixture-of-experts settings (model.* keys) that export as Mixtral and Qwen2-MoE.
MIXTRAL = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
QWEN2_MOE = dict(MIXTRAL, moe_shared_expert_intermediate_size=80, moe_shared_expert_gate=True)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# What the tiny Hugging Face models the import tests save share: the byte vocabulary, the
# tiny model's width and attention (4 heads, 2 KV groups), its context, no BOS.
HF_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    bos_token_id=None,
    eos_token_id=ByteTokenizer().eod,
)


def sample_tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def megatron_logits(checkpoint: Path, cfg, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the megatron model (TP=PP=1) loaded from ``checkpoint``, padding trimmed."""
    model = build_model(model_config(cfg, VOCAB))
    load_model_weights(model, checkpoint)
    model[0].eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model[0](tokens, positions, None)[..., :VOCAB]


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def assert_parity(checkpoint: Path, cfg, hf_dir: Path) -> None:
    tokens = sample_tokens()
    torch.testing.assert_close(
        hf_logits(hf_dir, tokens), megatron_logits(checkpoint, cfg, tokens), **TOLERANCE
    )


def safetensors_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def silent(_: str) -> None:
    pass


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*")), "a staging directory was left behind"


def import_refuses_edited_config(source: Path, changes: dict, message: str) -> None:
    """``import_hf`` of ``source`` with ``changes`` written into its config.json fails
    with an error matching ``message``, and writes nothing (to ``imported`` beside it)."""
    import pytest

    from megatron_lns.convert import ConversionError, import_hf

    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (source / "config.json").write_text(json.dumps(config))
    out = source.parent / "imported"
    with pytest.raises(ConversionError, match=message):
        import_hf(source, out, progress=silent)
    assert_nothing_written(out)


def assert_architecture_round_trips(arch, model_config, out: Path) -> None:
    """``arch`` exports ``model_config`` (a run's model section) as a ``config.json`` of its
    Hugging Face class, and reading that file back gives the same architecture, with or
    without LNS."""
    import dataclasses

    from transformers import AutoConfig

    from megatron_lns.config.norm_scalings import imported_norm_scaling
    from megatron_lns.convert.architectures import architecture_for_hf_config

    exported = arch.from_model_config(model_config)
    exported.hf_config(VOCAB, torch.float32, None, ByteTokenizer().eod).save_pretrained(out)
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    assert config.architectures == [arch.hf_class]
    for lns in (False, True):
        assert architecture_for_hf_config(config, lns) == dataclasses.replace(
            exported, norm_scaling=imported_norm_scaling(lns)
        )


def export_then_import(run: Path, tmp_path: Path):
    """``run`` exported to ``tmp_path/hf`` and that export imported back as an LNS run to
    ``tmp_path/imported``: the export and the imported run's config."""
    from megatron_lns.config import load_config
    from megatron_lns.convert import export_hf, import_hf

    first = export_hf(run, tmp_path / "hf", progress=silent)
    return first, load_config(import_hf(first, tmp_path / "imported", lns=True, progress=silent))


def reexported_tensors(run: Path, source: Path, out: Path):
    """The tensors of the Hugging Face directory ``source`` and of ``run``'s export to
    ``out``, which has the same names."""
    from megatron_lns.convert import export_hf

    exported = safetensors_tensors(export_hf(run, out, progress=silent))
    original = safetensors_tensors(source)
    assert original.keys() == exported.keys()
    return original, exported


def run_config(precision: str = "32", **model):
    """A tiny run config (4 layers, hidden 64, byte tokenizer); ``model`` overrides
    ``model.*`` keys."""
    from megatron_lns.config import load_config

    values = dict(
        TINY_MODEL,
        encoder_seq_length=SEQ,
        data={"seq_length": SEQ, "data_prefix": ["builtin:pydoc"]},
    )
    values.update(model)
    return load_config({"trainer": {"precision": precision}, "model": values})


def save_checkpoint(chunks, root: Path, cfg, iteration: int = 1) -> Path:
    """``chunks`` saved as training saves a checkpoint of ``cfg`` at step ``iteration``
    under the run directory ``root``: weights, config and the completion marker."""
    path = root / "checkpoints" / f"iter_{iteration:07d}"
    save_model_weights(chunks, path)
    (path / "config.yaml").write_text(to_yaml(cfg))
    complete = {"iteration": iteration, "consumed_samples": 8 * iteration}
    (path / "complete.json").write_text(json.dumps(complete) + "\n")
    return path
