"""``megatron-lns export-hf``: a megatron checkpoint -> a stock Hugging Face model directory.

Everything comes from the checkpoint: its ``config.yaml`` (the resolved run config)
says the architecture and tokenizer, its tensors carry their global shapes. A hybrid run
with the GPT-equivalent pattern exports as the GPT run would (its sublayers' tensors
read under their own keys, ``Architecture.checkpoint_key``); other patterns are refused.
Tensors are read one transformer layer at a time straight from the ``torch_dist`` files (see
:mod:`~megatron_lns.convert.checkpoint_reader`), so a checkpoint saved at any
TP/PP/VP layout exports the same, on a CPU, without a process group, and peak memory
is one layer's tensors plus one output shard. The output is written into a hidden
sibling directory and renamed into place once complete and checked.

megatron pads the vocabulary (``model.make_vocab_size_divisible_by``, tensor
parallelism) and trains the padding rows like any other: the output layer's padded
logits are never targets, so training pushes them down, but they stay in the softmax of
the run's loss. A Hugging Face model has only the tokenizer's rows, so the padding rows
are written apart, in :data:`PADDING_FILE` (safetensors format under a name no Hugging
Face loader reads), for ``import-hf`` (and ``analyze``) to put back: the imported model
then computes the run's loss over the padded vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from megatron_lns.config import ConfigError
from megatron_lns.config.norm_scalings import norm_scaling_info
from megatron_lns.config.schema import ExperimentConfig, ModelConfig
from megatron_lns.config.sources import load_run_config, runs_inside_hint
from megatron_lns.convert.architectures import (
    Architecture,
    architecture_for_model_config,
    gpt_model_of,
)
from megatron_lns.convert.checkpoint_reader import CheckpointReader
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.hf_settings import apply_to_hf_config
from megatron_lns.convert.hf_tokenizer import TokenizerIds, training_tokenizer, write_tokenizer
from megatron_lns.convert.mapping import (
    EMBEDDING,
    FINAL_NORM_BIAS,
    FINAL_NORM_WEIGHT,
    HF_EMBEDDING,
    HF_FINAL_NORM,
    HF_LM_HEAD,
    OUTPUT_LAYER,
)
from megatron_lns.convert.output import check_apart, staged_output_dir
from megatron_lns.convert.safetensors_io import Group, write_sharded
from megatron_lns.training.build import embedding_rows
from megatron_lns.training.checkpoint import (
    CHECKPOINT_DIR_RE,
    COMPLETE_MARKER,
    checkpoint_problem,
    latest_complete_checkpoint,
)

DEFAULT_MAX_SHARD_BYTES = 2 * 10**9
# The trained vocabulary padding rows (embedding, and output layer when untied), beside
# the model; safetensors format, named so that no "*.safetensors" glob takes it for a
# shard of the model (vLLM loads every one it finds when there is no index).
PADDING_FILE = "vocab_padding.megatron_lns"


def resolve_checkpoint(path: str | Path) -> Path:
    """An ``iter_*`` directory as given, or the newest complete one of a run directory."""
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise ConversionError(f"checkpoint {path} is not a directory")
    if CHECKPOINT_DIR_RE.match(path.name) or path.name.endswith(".partial"):
        return _loadable(path)
    for root in (path / "checkpoints", path):
        latest = latest_complete_checkpoint(root)
        if latest is not None:
            return _loadable(latest)
    raise ConversionError(
        f"no complete checkpoint (iter_NNNNNNN with {COMPLETE_MARKER}) in {path} or "
        f"{path / 'checkpoints'}{runs_inside_hint(path)}"
    )


def _loadable(checkpoint: Path) -> Path:
    if problem := checkpoint_problem(checkpoint):
        raise ConversionError(f"{checkpoint} is not a complete checkpoint: it {problem}")
    return checkpoint


def run_config(checkpoint: Path) -> ExperimentConfig:
    """The run config ``checkpoint`` holds: it says the architecture and tokenizer."""
    try:
        return load_run_config(checkpoint)
    except ConfigError as err:
        raise ConversionError(str(err)) from err


def check_checkpoint_matches(reader: CheckpointReader, arch: Architecture, vocab_rows: int) -> None:
    """Every tensor the architecture needs is there with the right global shape, and no
    other model tensor is: the config and the checkpoint must describe the same model."""
    h = arch.hidden_size
    expected: dict[str, tuple[int, ...]] = {EMBEDDING: (vocab_rows, h)}
    expected |= arch.checkpoint_shapes()
    if arch.norm_affine:
        expected[arch.checkpoint_key(FINAL_NORM_WEIGHT)] = (h,)
        if arch.norm_has_bias:
            expected[arch.checkpoint_key(FINAL_NORM_BIAS)] = (h,)
    if not arch.tied_embeddings:
        expected[OUTPUT_LAYER] = (vocab_rows, h)
    where = reader.directory
    for key, shape in expected.items():
        if key not in reader:
            raise ConversionError(
                f"checkpoint {where} has no tensor '{key}', which its config.yaml's model needs"
            )
        if reader.shape(key) != shape:
            raise ConversionError(
                f"checkpoint {where}: '{key}' has shape {reader.shape(key)}, its config.yaml "
                f"implies {shape}"
            )
    model_prefixes = ("embedding.", "decoder.", "output_layer.")
    for key in reader.tensor_keys():
        if key.startswith(model_prefixes) and key not in expected:
            raise ConversionError(
                f"checkpoint {where} has tensor '{key}', which its config.yaml's model does "
                "not have"
            )
    dtypes = {reader.dtype(key) for key in expected}
    if len(dtypes) != 1:
        raise ConversionError(f"checkpoint {where} mixes weight dtypes {sorted(map(str, dtypes))}")


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[str], None] | None = print,
    tokenizer: bool = True,
) -> Path:
    """Write the Hugging Face model of ``checkpoint`` into ``out_dir``; returns ``out_dir``.

    ``tokenizer=False`` writes no tokenizer files (for a tokenizer ``transformers`` does
    not reproduce); the config's token ids are then the training tokenizer's.
    """
    say = progress or (lambda _: None)
    source = resolve_checkpoint(checkpoint)
    check_apart(Path(out_dir), source)
    cfg = run_config(source)
    m = cfg.model
    arch = architecture_for_model_config(m)
    reader = CheckpointReader(source)
    trained = training_tokenizer(m.tokenizer)
    vocab = trained.vocab_size
    padded = embedding_rows(cfg, vocab)
    check_checkpoint_matches(reader, arch, padded)
    dtype = reader.dtype(EMBEDDING)
    with staged_output_dir(out_dir, overwrite) as stage:
        from megatron_lns.data.demo_corpus import demo_documents

        if tokenizer:
            ids = write_tokenizer(m.tokenizer, trained, stage, demo_documents()[:32])
            if ids.warning:
                say(f"export-hf: warning: {ids.warning}")
        else:
            ids = TokenizerIds(vocab, None, trained.eod)
            say("export-hf: no tokenizer files written (--no-tokenizer)")
        scaling = norm_scaling_info(arch.norm_scaling)
        folds = (
            f"{scaling.label} folded into the pre-norms" if scaling.scales_pre_norms else "Pre-LN"
        )
        if arch.branch_gain is not None:
            folds += f", {arch.branch_gain} gains folded into o_proj/down_proj"
        say(
            f"export-hf: {source} -> {out_dir} as {arch.hf_class} ({arch.num_layers} layers, "
            f"{folds}, {dtype})"
        )
        hf_config_of(m, arch, vocab, dtype, ids.bos, ids.eos).save_pretrained(stage)
        _generation_config(ids.bos, ids.eos).save_pretrained(stage)
        write_sharded(stage, _groups(reader, arch, vocab, dtype, say), dtype, max_shard_bytes, say)
        if padded > vocab:
            _write_padding_rows(reader, arch, vocab, padded, stage / PADDING_FILE)
    say(f"export-hf: done: {out_dir}")
    return Path(out_dir)


def hf_config_of(
    m: ModelConfig, arch: Architecture, vocab: int, dtype: torch.dtype, bos: int | None, eos: int
):
    """The ``transformers`` config of the export: the architecture's, with every model
    setting declared with a ``config.json`` field written into it (``hf_settings``)."""
    config = arch.hf_config(vocab, dtype, bos, eos)
    apply_to_hf_config(gpt_model_of(m), config, arch.hf_class)
    return config


def _write_padding_rows(
    reader: CheckpointReader, arch: Architecture, vocab: int, padded: int, path: Path
) -> None:
    """Rows ``[vocab, padded)`` of the embedding (and of the untied output layer)."""
    from safetensors.torch import save_file

    shape = ((vocab, 0), (padded - vocab, arch.hidden_size))
    keys = [EMBEDDING] if arch.tied_embeddings else [EMBEDDING, OUTPUT_LAYER]
    rows = reader.read(dict.fromkeys(keys, shape))
    save_file({key: tensor.contiguous() for key, tensor in rows.items()}, str(path))


def _generation_config(bos: int | None, eos: int):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=bos, eos_token_id=eos)


def _groups(
    reader: CheckpointReader,
    arch: Architecture,
    vocab: int,
    dtype: torch.dtype,
    say: Callable[[str], None],
) -> list[Group]:
    """The export's tensors in write order: embedding, each layer, final norm and head."""
    h = arch.hidden_size
    groups: list[Group] = [
        ({HF_EMBEDDING: (vocab, h)}, lambda: {HF_EMBEDDING: reader.read_rows(EMBEDDING, vocab)})
    ]

    def layer(index: int) -> dict[str, torch.Tensor]:
        say(f"export-hf: layer {index + 1}/{arch.num_layers}")
        return arch.layer_to_hf(arch.read_layer(reader, index), index)

    for index in range(arch.num_layers):
        groups.append((arch.hf_layer_shapes(index), lambda index=index: layer(index)))

    head_shapes = {HF_FINAL_NORM + "weight": (h,)}
    if not arch.rmsnorm:
        head_shapes[HF_FINAL_NORM + "bias"] = (h,)
    if not arch.tied_embeddings:
        head_shapes[HF_LM_HEAD] = (vocab, h)

    def head() -> dict[str, torch.Tensor]:
        weight_key, bias_key = map(arch.checkpoint_key, (FINAL_NORM_WEIGHT, FINAL_NORM_BIAS))
        weight = reader.read({weight_key: ((0,), (h,))})[weight_key] if arch.norm_affine else None
        bias = reader.read({bias_key: ((0,), (h,))})[bias_key] if arch.norm_has_bias else None
        out = arch.final_norm_to_hf(weight, bias, dtype)
        if not arch.tied_embeddings:
            out[HF_LM_HEAD] = reader.read_rows(OUTPUT_LAYER, vocab)
        return out

    groups.append((head_shapes, head))
    return groups
