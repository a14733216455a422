"""``megatron-lns import-hf``: a Hugging Face model -> a run directory training resumes from.

The output directory is a megatron-lns run directory::

    OUT_DIR/config.yaml                          the run config (architecture from config.json)
    OUT_DIR/tokenizer/                           the Hugging Face tokenizer files, copied
    OUT_DIR/checkpoints/iter_0000000/            a weights-only checkpoint (torch_dist)

``megatron-lns train OUT_DIR/config.yaml`` resumes from it: weights from the model,
a fresh optimizer and schedule, iteration 0. The checkpoint stores global tensors, so
it loads at the TP/PP/VP layout the config asks for (``key=value`` overrides, checked
by the config validation like any run config). With ``model.architecture=hybrid`` the
checkpoint is the HybridModel's: each layer's attention and MLP under their sublayers'
keys; a ``model.hybrid_layer_pattern`` given must be the model's (``*-`` or ``*E`` per
layer, ``|`` where the layout needs them), and ``num_layers`` then counts sublayers.

With ``lns=True`` the Hugging Face pre-norm weights are taken to carry the folded LNS
factor (as :mod:`~megatron_lns.convert.hf_export` writes them); it is divided out so
that the megatron LNS model, which multiplies it back in at forward time, computes
bitwise the same norm weights. Without it the model is imported as Pre-LN
(``model.norm_scaling=none``), unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from megatron_lns.base.path_kind import not_a_directory, not_a_file
from megatron_lns.config import ConfigError, hybrid_pattern, model_derived, to_yaml, validate
from megatron_lns.config.loader import override_key, what_yaml_holds
from megatron_lns.config.norm_scalings import norm_scaling_info
from megatron_lns.config.schema import ExperimentConfig, ModelConfig
from megatron_lns.config.sources import RUN_CONFIG, config_file, load_run_config
from megatron_lns.convert.architectures import Architecture, architecture_for_hf_config
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.hf_fields import FieldReads, refuse_unaccounted_fields
from megatron_lns.convert.hf_settings import mapped_hf_fields, settings_from_hf_config
from megatron_lns.convert.hf_tokenizer import HF_TOKENIZER_FILES, training_tokenizer
from megatron_lns.convert.mapping import (
    EMBEDDING,
    FINAL_NORM_BIAS,
    FINAL_NORM_WEIGHT,
    HF_DERIVED_SUFFIXES,
    HF_EMBEDDING,
    HF_FINAL_NORM,
    HF_LM_HEAD,
    OUTPUT_LAYER,
)
from megatron_lns.convert.output import check_apart, check_output_dir, staged_output_dir
from megatron_lns.convert.safetensors_io import SafetensorsCheckpoint
from megatron_lns.convert.streaming_save import GroupedParameters, StreamingSaveStrategy
from megatron_lns.model.specs import LOCAL_TO_FUSED_NORM_NAMES
from megatron_lns.runtime.launcher_env import launcher_environment
from megatron_lns.training.build import build_weights_model, embedding_rows
from megatron_lns.training.checkpoint import save_weights_only_checkpoint

PRECISION_OF_DTYPE = {torch.float32: "32", torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
# Checkpoint (fused) norm names -> the local-backend parameter names import fills.
_FUSED_TO_LOCAL = {fused: local for local, fused in LOCAL_TO_FUSED_NORM_NAMES.items()}
# Set from OUT_DIR: a different value would point the run at another directory.
_OUT_DIR_KEYS = ("exp_manager.exp_dir", "exp_manager.name")
# A parameter of transformer layer N (GPT names): the layer's group of the import.
_LAYER_PARAMETER = re.compile(r"^decoder\.layers\.(\d+)\.")

# The sequence lengths config.json's max_position_embeddings gives an imported run, as
# defaults the user may lower.
_SEQUENCE_KEYS = ("max_position_embeddings", "encoder_seq_length")


def import_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    overrides: list[str] | None = None,
    lns: bool = False,
    base_config: str | Path | DictConfig | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Convert ``hf_dir`` into a run directory ``out_dir``; returns its config path.

    ``base_config`` (a YAML path or an OmegaConf mapping) gives the non-architecture keys.
    """
    say = progress or (lambda _: None)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    overrides = list(overrides or [])
    check_output_dir(out_dir, overwrite)
    check_apart(out_dir, hf_dir)
    hf_config = read_hf_config(hf_dir)
    arch, hf_vocab = _read_architecture(hf_dir, hf_config, lns)
    base = _read_base_config(base_config)
    copy_tokenizer = not _user_sets(base, overrides, "model.tokenizer")
    if copy_tokenizer and not _tokenizer_files(hf_dir):
        raise ConversionError(
            f"{hf_dir} has no tokenizer files; pass model.tokenizer.library=... (and its "
            "model.tokenizer.type or model.tokenizer.model)"
        )
    weights = SafetensorsCheckpoint(hf_dir)
    dtype = weights.dtype(HF_EMBEDDING)
    cfg = _run_config(arch, hf_config, dtype, hf_dir, out_dir, overrides, base, copy_tokenizer)
    arch = dataclasses.replace(arch, hybrid=cfg.model.architecture == "hybrid")
    source_tokenizer = copy.deepcopy(cfg.model.tokenizer)
    if copy_tokenizer:
        source_tokenizer.type = str(hf_dir)
    vocab = training_tokenizer(source_tokenizer).vocab_size
    padded = embedding_rows(cfg, vocab)
    if not vocab <= hf_vocab <= padded:
        raise ConversionError(
            f"{hf_dir}/config.json: vocab_size={hf_vocab} does not fit the tokenizer "
            f"({vocab} tokens, padded to {padded} with model.make_vocab_size_divisible_by="
            f"{cfg.model.make_vocab_size_divisible_by}); it must lie between the two"
        )
    check_hf_tensors(weights, arch, hf_vocab)
    configured = norm_scaling_info(cfg.model.norm_scaling)
    if configured.scales_pre_norms and configured.name != arch.norm_scaling:
        say(
            f"import-hf: note: model.norm_scaling={configured.name} without --lns: these "
            f"weights were trained without {configured.label}, and with it the model computes "
            "a different function"
        )
    with staged_output_dir(out_dir, overwrite) as stage:
        if copy_tokenizer:
            _copy_tokenizer(hf_dir, stage / "tokenizer")
        checkpoint = stage / "checkpoints" / "iter_0000000"
        with _single_process_megatron():
            # On the meta device: megatron's layout of the checkpoint, without its memory.
            with torch.device("meta"):
                model = build_weights_model(cfg, vocab)
            model_dtype = next(model.parameters()).dtype
            if model_dtype != dtype:
                say(
                    f"import-hf: note: casting {dtype} weights to {model_dtype} (trainer.precision)"
                )
            say(
                f"import-hf: {hf_dir} ({arch.hf_class}, {arch.num_layers} layers) -> "
                f"{out_dir} ({'LNS factors divided out' if lns else 'Pre-LN'})"
            )
            padding = padding_rows(hf_dir, hf_vocab, padded, arch.hidden_size, say)
            source = HfParameters(weights, arch, hf_vocab, padded, say, padding)
            parameters = GroupedParameters(model, source.group_of, source.produce)
            strategy = StreamingSaveStrategy(parameters)
            save_weights_only_checkpoint([model], checkpoint, to_yaml(cfg), strategy=strategy)
            if parameters.unwritten():
                raise AssertionError(f"import left parameters unset: {parameters.unwritten()}")
            if source.inexact:
                say(
                    f"import-hf: warning: {source.inexact} norm weight elements have no float "
                    "that the LNS factor maps back to them exactly; the nearest was taken"
                )
        (stage / RUN_CONFIG).write_text(to_yaml(cfg))
    say(f"import-hf: done: train with `megatron-lns train {out_dir / 'config.yaml'}`")
    return out_dir / RUN_CONFIG


def read_hf_config(hf_dir: Path):
    if problem := not_a_directory(hf_dir):
        raise ConversionError(f"Hugging Face directory {hf_dir} {problem}")
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{hf_dir} has no config.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    try:  # what transformers raises for a field it checks (a recent huggingface_hub)
        from huggingface_hub.errors import StrictDataclassError

        refused_fields: tuple[type[Exception], ...] = (StrictDataclassError,)
    except ImportError:
        refused_fields = ()
    try:
        return AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConversionError(f"{hf_dir}/config.json: {message}") from err
    except refused_fields as err:
        # A field of the wrong type, or fields that do not fit together: a header line,
        # then the validator's own, which names the field.
        message = " ".join(str(err).split())
        raise ConversionError(f"{hf_dir}/config.json: {message}") from err


def _read_architecture(hf_dir: Path, hf_config, lns: bool) -> tuple[Architecture, int]:
    """The architecture of ``hf_config`` and its vocabulary size, once every field of
    ``config.json`` is accounted for: read by the converter or here, mapped by a model
    setting's declaration, or inert (:mod:`~megatron_lns.convert.hf_fields`)."""
    reads = FieldReads(hf_config)
    arch = architecture_for_hf_config(reads, lns)
    vocab = reads.vocab_size
    accounted = reads.read | mapped_hf_fields(ModelConfig) | set(arch.hf_inert_fields)
    refuse_unaccounted_fields(hf_dir, hf_config, accounted, arch.hf_class)
    return arch, vocab


def _read_base_config(path: str | Path | DictConfig | None) -> DictConfig:
    if path is None:
        return OmegaConf.create({})
    if isinstance(path, DictConfig):
        return path.copy()
    if Path(path).is_dir():  # a run directory or checkpoint: the config it keeps
        path = config_file(path)
    return read_base_config_file(Path(path))


def read_base_config_file(path: Path) -> DictConfig:
    """The ``--config`` YAML file ``path`` (of import-hf, and analyze's for a Hugging Face
    input), refused in one line unless it is a mapping: OmegaConf loads a list as a
    ListConfig and a file of one word as a mapping with that word as its key."""
    if problem := not_a_file(path):
        raise ConversionError(f"--config {path} {problem}")
    try:
        held = what_yaml_holds(path)
        raw = OmegaConf.load(path) if held == "a mapping" else None
    except Exception as err:  # YAML syntax errors come in several types
        raise ConversionError(f"--config {path}: {str(err).splitlines()[0]}") from err
    if not isinstance(raw, DictConfig):
        raise ConversionError(
            f"--config {path} is not a mapping of config sections (it holds {held})"
        )
    return raw


def _user_sets(base: DictConfig, overrides: list[str], section: str) -> bool:
    if any(override_key(o).startswith(section) for o in overrides):
        return True
    return OmegaConf.select(base, section, default=None) is not None


def _run_config(
    arch: Architecture,
    hf_config,
    dtype: torch.dtype,
    hf_dir: Path,
    out_dir: Path,
    overrides: list[str],
    base: DictConfig,
    copy_tokenizer: bool,
) -> ExperimentConfig:
    """The run config: the user's base and overrides, with the architecture from config.json.

    An architecture key the user sets to another value is an error, not overwritten. A
    model setting declared with a ``config.json`` field the architecture does not read
    itself is read from that field (``hf_settings``).
    """
    raw = base.copy()
    settings = arch.model_settings()
    own = {*settings, *arch.training_settings(), *_SEQUENCE_KEYS}
    settings |= settings_from_hf_config(hf_config, ModelConfig, own)
    twin = _hybrid_twin_pattern(arch) if _sets_hybrid_pattern(base, overrides) else None
    if twin is not None:  # the pattern's num_layers counts sublayers; its 'E's are the MoEs
        settings["num_layers"] = len(twin)
        settings.pop("moe_layer_freq", None)
    fixed = {f"model.{key}": value for key, value in settings.items()}
    fixed["exp_manager.exp_dir"] = str(out_dir.parent)
    fixed["exp_manager.name"] = out_dir.name
    if copy_tokenizer:
        fixed["model.tokenizer.library"] = "huggingface"
        fixed["model.tokenizer.type"] = str(out_dir / "tokenizer")
    for key, value in fixed.items():
        given = OmegaConf.select(raw, key, default=None)
        if given is not None and given != value:
            raise ConversionError(_conflict(key, given, value, hf_dir))
        OmegaConf.update(raw, key, value, force_add=True)
    defaults = {
        "model.norm_scaling": arch.norm_scaling,
        **{f"model.{key}": arch.max_position_embeddings for key in _SEQUENCE_KEYS},
        "model.data.seq_length": "${model.encoder_seq_length}",
        "trainer.precision": PRECISION_OF_DTYPE.get(dtype, "32"),
    }
    defaults |= {f"model.{key}": value for key, value in arch.training_settings().items()}
    for key, value in defaults.items():
        if OmegaConf.select(raw, key, default=None) is None:
            OmegaConf.update(raw, key, value, force_add=True)
    try:
        cfg = load_run_config(raw, overrides)
    except ConfigError as err:
        raise ConversionError(str(err)) from err
    typed = OmegaConf.structured(cfg)
    for key, value in fixed.items():
        got = OmegaConf.select(typed, key)
        if got != value and not (got is None and _null_means(key, arch) == value):
            raise ConversionError(_conflict(key, got, value, hf_dir))
    pattern, model_pattern = cfg.model.hybrid_layer_pattern, _hybrid_twin_pattern(arch)
    if pattern is not None and hybrid_pattern.sublayers(pattern) != model_pattern:
        raise ConversionError(
            f"model.hybrid_layer_pattern={pattern!r} conflicts with {hf_dir}/config.json, "
            f"whose model is the pattern {model_pattern!r} (one attention and one MLP or MoE "
            "per layer)"
        )
    carried = norm_scaling_info(arch.norm_scaling)
    if carried.scales_pre_norms and cfg.model.norm_scaling != carried.name:
        raise ConversionError(
            f"--lns says the weights carry {carried.label} factors, but model.norm_scaling="
            f"{cfg.model.norm_scaling}; drop one of the two"
        )
    # The data blend is chosen at train time; validate the rest without it.
    probe = copy.deepcopy(cfg)
    if not probe.model.data.data_prefix:
        probe.model.data.data_prefix = ["builtin:pydoc"]
    try:
        validate(probe, check_files=False)
    except ConfigError as err:
        raise ConversionError(str(err)) from err
    return cfg


def _sets_hybrid_pattern(base: DictConfig, overrides: list[str]) -> bool:
    return any(
        _user_sets(base, overrides, f"model.{key}")
        for key in ("hybrid_layer_pattern", "hybrid_override_pattern")
    )


def _hybrid_twin_pattern(arch: Architecture) -> str:
    """The hybrid pattern of the Hugging Face model: ``*-`` per layer, ``*E`` for MoE."""
    moe = getattr(arch, "moe_pattern", None) or (0,) * arch.num_layers
    return hybrid_pattern.gpt_equivalent_pattern(moe)


def _null_means(key: str, arch: Architecture) -> int | None:
    """What null stands for in an architecture key whose null is derived (the head size,
    the number of key/value groups), so that a user's null agrees with config.json."""
    sizes = ModelConfig(hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads)
    derived = {
        "model.kv_channels": model_derived.head_size(sizes),
        "model.num_query_groups": model_derived.query_groups(sizes),
    }
    return derived.get(key)


def _conflict(key: str, given, value, hf_dir: Path) -> str:
    if key in _OUT_DIR_KEYS:
        return f"{key}={given}: import-hf sets it from OUT_DIR ({value}); choose OUT_DIR instead"
    return (
        f"{key}={given} conflicts with {hf_dir}/config.json, which gives {value}; the "
        "architecture comes from the Hugging Face model"
    )


def _tokenizer_files(hf_dir: Path) -> list[Path]:
    return [hf_dir / name for name in HF_TOKENIZER_FILES if (hf_dir / name).is_file()]


def _copy_tokenizer(hf_dir: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for path in _tokenizer_files(hf_dir):
        shutil.copy2(path, target / path.name)


@contextlib.contextmanager
def _single_process_megatron() -> Iterator[None]:
    """megatron's parallel state for one CPU process (TP=PP=1), the weights' home while
    they are assembled; torn down again unless the caller had one already."""
    import torch.distributed as dist

    from megatron_lns.runtime import ParallelLayout, destroy_distributed, init_distributed

    launch = launcher_environment()
    world = dist.get_world_size() if dist.is_initialized() else launch.world_size if launch else 1
    if world != 1:
        raise ConversionError(
            f"import-hf runs in one process; it was started in a world of {world}"
        )
    owned = not dist.is_initialized()
    init_distributed(ParallelLayout(), device="cpu")
    try:
        yield
    finally:
        if owned:
            destroy_distributed()


def check_hf_tensors(weights: SafetensorsCheckpoint, arch: Architecture, vocab: int) -> None:
    """Every tensor the model needs is there with the shape config.json implies, and no
    other: checked from the file headers, before anything is read or written."""
    h = arch.hidden_size
    needed: dict[str, tuple[int, ...]] = {HF_EMBEDDING: (vocab, h)}
    for index in range(arch.num_layers):
        needed |= arch.hf_layer_shapes(index)
    needed |= _hf_head_shapes(arch, vocab, HF_LM_HEAD in weights)
    for name, shape in needed.items():
        weights.check(name, shape)
    unused = [
        name
        for name in weights.names()
        if name not in needed and not name.endswith(HF_DERIVED_SUFFIXES)
    ]
    if unused:
        raise ConversionError(
            f"{weights.directory}: tensor '{unused[0]}' has no place in a {arch.hf_class} of this "
            f"config ({len(unused)} such tensors)"
        )


def _hf_head_shapes(arch: Architecture, vocab: int, has_lm_head: bool) -> dict:
    """The final norm and, untied or given anyway, the LM head."""
    h = arch.hidden_size
    shapes = {HF_FINAL_NORM + "weight": (h,)}
    if not arch.rmsnorm:
        shapes[HF_FINAL_NORM + "bias"] = (h,)
    if not arch.tied_embeddings or has_lm_head:
        shapes[HF_LM_HEAD] = (vocab, h)
    return shapes


class HfParameters:
    """The megatron model's parameters made from the Hugging Face tensors, one group at
    a time (the save streams them, :mod:`~megatron_lns.convert.streaming_save`): group 0
    is the embedding, group ``i + 1`` transformer layer ``i``, the last the final norm
    and the output layer. A group reads only its own tensors."""

    def __init__(
        self,
        weights: SafetensorsCheckpoint,
        arch: Architecture,
        vocab: int,
        padded: int,
        say: Callable[[str], None],
        padding: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.weights, self.arch, self.vocab, self.padded, self.say = (
            weights,
            arch,
            vocab,
            padded,
            say,
        )
        self.padding = padding or {}  # the export's trained padding rows, by megatron key
        self.inexact = 0  # norm elements without an exact preimage (--lns)

    def group_of(self, name: str) -> int:
        """The group of the model parameter ``name``."""
        gpt_name = hybrid_pattern.hybrid_key_to_gpt(name) if self.arch.hybrid else name
        if gpt_name == EMBEDDING:
            return 0
        layer = _LAYER_PARAMETER.match(gpt_name)
        return 1 + int(layer.group(1)) if layer else self.arch.num_layers + 1

    def produce(self, group: int) -> dict[str, torch.Tensor]:
        """Group ``group``'s parameters by their model names."""
        arch, h = self.arch, self.arch.hidden_size
        if group == 0:
            embedding = self.weights.get(HF_EMBEDDING, (self.vocab, h))
            return {EMBEDDING: _pad_rows(embedding, self.padded, self.padding.get(EMBEDDING))}
        if group <= arch.num_layers:
            index = group - 1
            self.say(f"import-hf: layer {group}/{arch.num_layers}")
            tensors, missed = arch.layer_from_hf(
                self.weights.read(arch.hf_layer_shapes(index)), index
            )
            self.inexact += missed
            return {
                arch.checkpoint_key(f"decoder.layers.{index}.{_FUSED_TO_LOCAL.get(key, key)}"): t
                for key, t in tensors.items()
            }
        hf = self.weights.read(_hf_head_shapes(arch, self.vocab, HF_LM_HEAD in self.weights))
        out = {arch.checkpoint_key(FINAL_NORM_WEIGHT): hf[HF_FINAL_NORM + "weight"]}
        if not arch.rmsnorm:
            out[arch.checkpoint_key(FINAL_NORM_BIAS)] = hf[HF_FINAL_NORM + "bias"]
        if not arch.tied_embeddings:
            out[OUTPUT_LAYER] = _pad_rows(
                hf[HF_LM_HEAD], self.padded, self.padding.get(OUTPUT_LAYER)
            )
        elif HF_LM_HEAD in hf and not torch.equal(hf[HF_LM_HEAD], self.weights.get(HF_EMBEDDING)):
            raise ConversionError(
                f"{self.weights.directory}: tie_word_embeddings is true but '{HF_LM_HEAD}' "
                f"differs from '{HF_EMBEDDING}'"
            )
        return out


def _pad_rows(tensor: torch.Tensor, rows: int, trained: torch.Tensor | None = None) -> torch.Tensor:
    """Vocabulary rows padded up to megatron's padded vocabulary size: with the trained
    padding rows an export kept (``trained``), else with zeros."""
    if trained is not None:
        return torch.cat([tensor, trained.to(tensor.dtype)])
    padding = torch.zeros(rows - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
    return torch.cat([tensor, padding])


def padding_rows(
    hf_dir: Path, vocab: int, padded: int, hidden: int, say: Callable[[str], None]
) -> dict[str, torch.Tensor]:
    """The trained vocabulary padding rows ``export-hf`` wrote beside the model
    (``hf_export.PADDING_FILE``), by megatron key, where they fill exactly the rows this
    import pads; none (zero rows) otherwise, said when the file is there but does not fit."""
    from megatron_lns.convert.hf_export import PADDING_FILE

    path = hf_dir / PADDING_FILE
    if not path.is_file() or padded == vocab:
        return {}
    from safetensors.torch import load_file

    try:
        rows = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types
        raise ConversionError(f"{path}: {str(err).splitlines()[0]}") from err
    if any(tuple(t.shape) != (padded - vocab, hidden) for t in rows.values()):
        shapes = sorted({tuple(t.shape) for t in rows.values()})
        say(
            f"import-hf: note: {path} holds padding rows of shape {shapes}, this import pads "
            f"{vocab} rows to {padded}: its padding rows are zeros"
        )
        return {}
    return {key: rows[key] for key in (EMBEDDING, OUTPUT_LAYER) if key in rows}
