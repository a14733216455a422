"""Depth diagnostics of trained models on held-out data (``megatron-lns analyze``).

Each input is a run directory (its newest complete checkpoint), one ``iter_NNNNNNN``
checkpoint, or a Hugging Face model written by ``megatron-lns export-hf``. A megatron
checkpoint carries its run config, and the held-out data is that run's validation
split, exactly as the trainer drew it (same data, split, seed and sample counts, so
the full-model loss over the run's ``trainer.limit_val_batches`` batches is the run's
last ``val_loss``). A Hugging Face directory says only the architecture: the held-out
data comes from ``--config`` (e.g. the training run's ``config.yaml``) and/or
``key=value`` overrides, and the model is imported into a temporary weights-only
checkpoint (``convert.hf_import``) which is then analysed like any other.

Every input is measured by :func:`~megatron_lns.analysis.depth.depth_diagnostics` at
the parallel layout of its config (overridable), on ``trainer.devices`` local
processes or under an external launcher (torchrun, srun). A Hugging Face model has no
layout: it is measured at TP=PP=EP=1 on one device unless ``key=value`` settings say
otherwise, whatever its ``--config`` says. Besides the validation-style loss, each input
gets the once-per-document loss of :mod:`~megatron_lns.analysis.documents` (what an
outside evaluator such as lm-eval computes). The output directory gets
``analysis.json`` and PNG plots overlaying all inputs; it is written all at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from megatron_lns.analysis.depth import DepthReport, LayerDiagnostics, depth_diagnostics
from megatron_lns.analysis.plots import plot_depth_reports
from megatron_lns.base import json_numbers
from megatron_lns.base.errors import UserError
from megatron_lns.config import ConfigError, ExperimentConfig, hybrid_pattern, validate
from megatron_lns.config.layout import micro_batches_per_step
from megatron_lns.config.loader import override_key
from megatron_lns.config.sources import RUN_CONFIG, config_file, load_run_config
from megatron_lns.convert.errors import ConversionError
from megatron_lns.convert.hf_export import resolve_checkpoint
from megatron_lns.convert.hf_import import import_hf
from megatron_lns.convert.output import check_apart, check_output_dir, staged_output_dir
from megatron_lns.runtime.launcher_env import launcher_environment
from megatron_lns.training.checkpoint_dirs import MarkerError, read_marker
from megatron_lns.training.machine import check_environment

REPORT_NAME = "analysis.json"
# What an analysis may change in a run's config: where the held-out data comes from and
# how much of it, how the model is laid out on devices, and the backend. Anything else
# would describe another model than the one the checkpoint holds.
# How a model is laid out on devices: a run's config says the layout it was trained at;
# a Hugging Face model has none, so these keys of a --config base are not used for it.
LAYOUT = (
    "trainer.devices",
    "trainer.num_nodes",
    "model.tensor_model_parallel_size",
    "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.sequence_parallel",
    "model.expert_model_parallel_size",
    "model.expert_tensor_parallel_size",
)
OVERRIDABLE = (
    "trainer.",
    "model.data.",
    "model.tokenizer.",
    "model.seed",
    "model.micro_batch_size",
    "model.global_batch_size",
    *LAYOUT,
    "model.transformer_engine",
    "model.fp8",
)
# Keys of a --config base that describe a training run rather than the imported model:
# its directory, its layout, and the LNS/variant choice, which a Hugging Face export has
# folded in. (The architecture keys config.json gives are dropped too: _hf_base.)
_NOT_FROM_BASE = ("exp_manager", "model.norm_scaling", "model.layer_variant", *LAYOUT)
_OVERRIDE = re.compile(r"^\+?[A-Za-z_][\w.]*=")


class AnalysisError(UserError, ValueError):
    """An input, label or setting that ``analyze`` cannot use; the message names it."""


def is_override(arg: str) -> bool:
    """Whether a command-line argument is a ``key=value`` setting rather than a path."""
    return bool(_OVERRIDE.match(arg)) and not Path(arg).exists()


def check_overrides(overrides: Sequence[str]) -> None:
    for override in overrides:
        key = override_key(override)
        if not key.startswith(OVERRIDABLE):
            raise AnalysisError(
                f"{key}: analyze does not change the trained model; it accepts settings of "
                "the held-out data, batch sizes, parallel layout and devices (trainer.*, "
                "model.data.*, model.tokenizer.*, model.*_parallel_size, ...)"
            )


def is_hf_model(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


@dataclass
class Input:
    """One model to analyse and where it came from."""

    label: str
    source: Path
    kind: str  # "run", "checkpoint" or "huggingface"
    checkpoint: Path | None = None  # for "huggingface": set once imported
    cfg: ExperimentConfig | None = None


def _default_label(path: Path, kind: str) -> str:
    path = path.absolute()
    if kind == "checkpoint":
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return f"{run.name}/{path.name}"
    return path.name


def resolve_inputs(paths: Sequence[str | Path], labels: Sequence[str] | None) -> list[Input]:
    """Classify every input (checking it exists and holds a model) and label it."""
    if not paths:
        raise AnalysisError("give at least one run directory, checkpoint or Hugging Face model")
    if labels and len(labels) != len(paths):
        raise AnalysisError(
            f"--labels gives {len(labels)} labels for {len(paths)} inputs; give one per input"
        )
    inputs = []
    for path in map(Path, paths):
        if not path.exists():
            raise AnalysisError(f"{path} does not exist")
        if not path.is_dir():
            raise AnalysisError(
                f"{path} is not a directory (a run directory, an iter_NNNNNNN checkpoint or "
                "a Hugging Face model directory)"
            )
        if is_hf_model(path):
            inputs.append(Input(_default_label(path, "huggingface"), path, "huggingface"))
            continue
        checkpoint = resolve_checkpoint(path)
        kind = "checkpoint" if checkpoint == path else "run"
        inputs.append(Input(_default_label(path, kind), path, kind, checkpoint))
    if labels:
        for item, label in zip(inputs, labels, strict=True):
            item.label = label
    seen = [item.label for item in inputs]
    repeated = sorted({label for label in seen if seen.count(label) > 1})
    if repeated:
        raise AnalysisError(
            f"inputs share the label {repeated[0]!r}; name them apart with --labels"
        )
    return inputs


def _is_layout(override: str) -> bool:
    return override_key(override) in LAYOUT


def _hf_base(config: str | Path | None, hf_dir: Path):
    """The --config YAML (a file, bundled name or run directory) without the keys an
    imported model sets itself: its layout, and the architecture config.json gives (a run
    config may say what the export cannot: the dense ``ffn_hidden_size`` of a run whose
    every layer is MoE, which its model never uses)."""
    from megatron_lns.convert.architectures import architecture_for_hf_config
    from megatron_lns.convert.hf_import import read_base_config_file, read_hf_config

    if config is None:
        return OmegaConf.create({})
    try:
        base = read_base_config_file(config_file(config))  # as import-hf reads its --config
        settings = architecture_for_hf_config(read_hf_config(hf_dir), False).model_settings()
    except ConversionError as err:
        raise AnalysisError(str(err)) from err
    for key in (*_NOT_FROM_BASE, *(f"model.{key}" for key in settings)):
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(base, parent) if parent else base
        if node is not None and leaf in node:
            del node[leaf]
    return base


def _import_hf(item: Input, work: Path, overrides: list[str], config: str | Path | None) -> None:
    """Import ``item`` into a weights-only checkpoint under ``work``.

    It is imported as plain Pre-LN: an exported model has any LNS factors folded into
    its norm weights, so that model computes exactly what the trained one did.
    """
    base = _hf_base(config, item.source)
    has_data = OmegaConf.select(base, "model.data.data_prefix", default=None) or any(
        override_key(o) == "model.data.data_prefix" and not o.startswith("~") for o in overrides
    )
    if not has_data:
        raise AnalysisError(
            f"{item.source} is a Hugging Face model, which does not say its held-out data: "
            "pass --config RUN/config.yaml (the training run's config) or "
            "model.data.data_prefix=..."
        )
    run_dir = work / f"hf-import-{len(list(work.iterdir()))}"
    # Imported in one process at TP=PP=EP=1 (a checkpoint loads at any layout): the layout
    # settings apply when it is analysed (input_config).
    imported = [o for o in overrides if not _is_layout(o)]
    import_hf(item.source, run_dir, imported, lns=False, base_config=base, progress=None)
    item.checkpoint = resolve_checkpoint(run_dir)


def input_config(item: Input, overrides: list[str], work: Path, world: int | None):
    """The checkpoint's run config with the analysis overrides, validated for this world.

    The run directory is pointed at ``work``: an analysis writes nothing into the run
    it reads (which may be read-only, or still training).
    """
    path = item.checkpoint / RUN_CONFIG
    try:
        cfg = load_run_config(item.checkpoint, overrides)
    except ConfigError as err:
        raise AnalysisError(f"{item.label}: {err}") from err
    exp = dataclasses.replace(cfg.exp_manager, exp_dir=str(work), name="analysis")
    cfg = dataclasses.replace(cfg, exp_manager=exp)
    try:
        validate(cfg, world, held_out_only=True)
        check_environment(cfg)
    except ConfigError as err:
        raise AnalysisError(f"{item.label} ({path}): {err}") from err
    split = block_split_by_pipeline(cfg.model)
    if split is not None:
        raise AnalysisError(
            f"{item.label}: model.hybrid_layer_pattern={cfg.model.hybrid_layer_pattern!r} "
            f"splits block {split} between pipeline stages, and analyze measures each block "
            "on one; set a pattern whose '|' fall before an attention ('*') for this layout"
        )
    return cfg


def num_blocks(m) -> int:
    """The paper's depth ``L`` of a ``model:`` section: its layers, or a hybrid pattern's
    blocks (the rows of the depth report)."""
    if m.architecture == "hybrid" and m.hybrid_layer_pattern:
        return hybrid_pattern.num_blocks(m.hybrid_layer_pattern)
    return m.num_layers


def block_split_by_pipeline(m) -> int | None:
    """The first block of a hybrid pattern whose sublayers a ``|`` separates, or None."""
    if m.architecture != "hybrid" or not m.hybrid_layer_pattern:
        return None
    segments = m.hybrid_layer_pattern.split(hybrid_pattern.PIPE)
    numbers = hybrid_pattern.block_numbers(m.hybrid_layer_pattern)
    end = 0
    for segment in segments[:-1]:
        end += len(segment)
        if 0 < end < len(numbers) and numbers[end - 1] == numbers[end]:
            return numbers[end]
    return None


def _iteration(checkpoint: Path) -> int | None:
    try:
        return read_marker(checkpoint).get("iteration")
    except MarkerError:
        return None


def _check_out_apart(out_dir: Path, item: Input, config: str | Path | None) -> None:
    """Refuse an OUT_DIR that is or holds what ``item`` reads (the directory given, its
    checkpoint, the --config file), or lies inside the checkpoint, a ``checkpoints``
    directory or a Hugging Face model: --overwrite replaced it, the inputs with it."""
    read = item.checkpoint or item.source
    check_apart(out_dir, item.source, within=read)
    check_apart(out_dir, read)
    if read.absolute().parent.name == "checkpoints":
        check_apart(out_dir, read, within=read.absolute().parent)
    if config is not None and Path(config).exists():
        check_apart(out_dir, Path(config))


def _data_prefixes(cfg) -> tuple[str, ...]:
    """The token files' prefixes of ``cfg``'s blend, a built-in corpus's prepared ones
    included (``data.blend``): what analyze holds out, checks and keeps apart."""
    from megatron_lns.data.blend import DataBlend

    tok = cfg.model.tokenizer
    blend = DataBlend.parse(cfg.model.data.data_prefix)
    return blend.resolved(tok.library, tok.type, tok.model).prefixes


def _files_read(cfg) -> list[Path]:
    """The held-out data files and the local tokenizer files a config reads."""
    tok = cfg.model.tokenizer
    files = [Path(f"{prefix}{ext}") for prefix in _data_prefixes(cfg) for ext in (".bin", ".idx")]
    return files + [Path(p) for p in (tok.type, tok.model) if p and Path(p).exists()]


def analyze(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    labels: Sequence[str] | None = None,
    batches: int | None = None,
    overrides: Sequence[str] = (),
    config: str | Path | None = None,
    prune: bool = True,
    overwrite: bool = False,
) -> Path:
    """Analyse every input and write ``out_dir`` (report and plots); returns its report.

    ``batches`` is the number of held-out global batches (default: each run's
    ``trainer.limit_val_batches``); ``overrides`` are ``key=value`` settings applied to
    every input's config (see ``OVERRIDABLE``); ``config`` is the base config of
    Hugging Face inputs; ``prune=False`` skips the layer-removal measurements.
    """
    overrides = list(overrides)
    check_overrides(overrides)
    if batches is not None and batches < 1:
        raise AnalysisError(f"--batches {batches}: give at least 1 held-out batch")
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    items = resolve_inputs(inputs, labels)
    for item in items:
        _check_out_apart(out_dir, item, config)
    if config is not None and not any(item.kind == "huggingface" for item in items):
        raise AnalysisError(
            f"--config {config} is for Hugging Face inputs; a run or checkpoint is analysed "
            "with its own config.yaml (change its data or layout with key=value settings)"
        )
    launch = launcher_environment()
    external = launch is not None
    world = launch.world_size if launch is not None else None
    with tempfile.TemporaryDirectory(prefix="megatron-lns-analyze-") as scratch:
        work = Path(scratch)
        for item in items:
            if item.kind == "huggingface":
                if external and world != 1:
                    raise AnalysisError(
                        f"{item.source}: a Hugging Face input is imported in one process; run "
                        "analyze without torchrun/srun (it starts trainer.devices processes "
                        "itself), or import-hf it first and analyze that run directory"
                    )
                _import_hf(item, work, overrides, config)
            item.cfg = input_config(item, overrides, work, world)
            for path in _files_read(item.cfg):
                check_apart(out_dir, path)
            if batches is None and item.cfg.trainer.limit_val_batches < 1:
                raise AnalysisError(
                    f"{item.label}: its trainer.limit_val_batches is 0; say how many held-out "
                    "batches to use with --batches N"
                )
        results = []
        for index, item in enumerate(items):
            cfg = item.cfg
            num_batches = batches or cfg.trainer.limit_val_batches
            if batches is not None:
                num_batches = _capped_to_the_split(item, batches)
            result_path = work / f"result-{index}.json"
            _say(
                f"analyze: {item.label}: {item.checkpoint} ({num_blocks(cfg.model)} layers, "
                f"{num_batches} held-out batches of {cfg.model.global_batch_size} sequences)"
            )
            _run(cfg, item.checkpoint, num_batches, prune, str(result_path))
            if result_path.is_file():  # under an external launcher, on rank 0 only
                results.append((item, num_batches, json.loads(result_path.read_text())))
        if not results:
            return out_dir / REPORT_NAME
        reports = {item.label: _report_from_dict(result) for item, _, result in results}
        with staged_output_dir(out_dir, overwrite) as stage:
            report = {
                "inputs": [_input_entry(item, n, result) for item, n, result in results],
            }
            (stage / REPORT_NAME).write_text(json_numbers.dumps(report, indent=1) + "\n")
            plots = plot_depth_reports(reports, stage)
    for item, _, result in results:
        _say(summary_line(item.label, reports[item.label], result))
    _say(f"analyze: wrote {out_dir / REPORT_NAME} and {', '.join(p.name for p in plots)}")
    return out_dir / REPORT_NAME


def _number(value: float | str | None, form: str = ".4f", measured: bool = True) -> str:
    """``value`` formatted; "not computed" for a value not measured (None, or not
    ``measured``); "NaN (non-finite)" for a measured NaN (a diverged model's), and so on."""
    if not measured or value is None:
        return "not computed"
    value = json_numbers.number(value)
    if not math.isfinite(value):
        return f"{json_numbers.json_safe(value)} (non-finite)"
    return format(value, form)


def summary_line(label: str, report: DepthReport, result: dict) -> str:
    """The line ``analyze`` prints per input: both held-out losses and the last layer."""
    deepest = report.layers[-1]
    measured = report.num_tokens > 0
    documents = _number(result.get("document_loss"))
    if result.get("document_loss") is not None:
        documents += (
            f" ({result['documents']} documents, {result['document_tokens']} tokens, "
            f"context {result['context_length']})"
        )
    return (
        f"analyze: {label}: held-out loss {_number(report.loss, measured=measured)} "
        f"(validation-style: packed samples, ppl "
        f"{_number(report.perplexity, '.3f', measured)}, {report.num_tokens} tokens); "
        f"once per document {documents}; variance growth L/1 "
        f"{_number(report.variance_growth(), '.3g')}; last layer: angular distance "
        f"{_number(deepest.angular_distance)}, pruning drop "
        f"{_number(deepest.pruning_drop, measured=report.pruned)}"
    )


def _capped_to_the_split(item: Input, batches: int) -> int:
    """``--batches``, or the global batches the validation split holds where it holds
    fewer (said): megatron repeats a split to fill what is asked, so more batches measured
    the same sequences again, for minutes or hours."""
    from megatron_lns.data.splits import samples_in_split

    m = item.cfg.model
    samples = samples_in_split(
        _data_prefixes(item.cfg), m.data.splits_string, "valid", m.data.seq_length
    )
    held = max(1, samples // m.global_batch_size)
    if batches <= held:
        return batches
    _say(
        f"analyze: {item.label}: --batches {batches} is more than the validation split holds "
        f"({samples} sequences: {held} global batches of {m.global_batch_size}); measuring on "
        f"{held}"
    )
    return held


def _say(message: str) -> None:
    print(message, flush=True)


def _input_entry(item: Input, num_batches: int, result: dict) -> dict:
    m = item.cfg.model
    return {
        "label": item.label,
        "kind": item.kind,
        "source": str(item.source.absolute()),
        "checkpoint": None if item.kind == "huggingface" else str(item.checkpoint.absolute()),
        "iteration": None if item.kind == "huggingface" else _iteration(item.checkpoint),
        "model": {
            "architecture": m.architecture,
            "num_layers": num_blocks(m),
            "hidden_size": m.hidden_size,
            "norm_scaling": m.norm_scaling,
            "layer_variant": m.layer_variant,
        },
        "held_out": {
            "data_prefix": [str(p) for p in m.data.data_prefix],
            "splits_string": m.data.splits_string,
            "batches": num_batches,
            "sequences": num_batches * m.global_batch_size,
            "seq_length": m.data.seq_length,
        },
        **result,
    }


def _report_from_dict(result: dict) -> DepthReport:
    return DepthReport(
        loss=json_numbers.number(result["loss"]),
        num_tokens=result["num_tokens"],
        layers=[
            LayerDiagnostics(**{k: json_numbers.number(v) for k, v in row.items()})
            for row in result["layers"]
        ],
        pruned=any(row.get("pruning_drop") is not None for row in result["layers"]),
    )


def _run(cfg, *args) -> None:
    from megatron_lns.training.entry_point import run_on_every_rank

    run_on_every_rank(
        cfg, analysis_job, *args,
        multi_node_hint=" (torchrun or srun starting `megatron-lns analyze` on every rank), "
        "or set trainer.num_nodes=1",
    )  # fmt: skip


def analysis_job(
    cfg: ExperimentConfig,
    checkpoint: Path,
    num_batches: int,
    prune: bool,
    result_path: str,
) -> None:
    """On every rank: build the model at the config's layout, load ``checkpoint``, measure
    it on ``num_batches`` held-out batches; rank 0 writes the report to ``result_path``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_lns.analysis.documents import document_batches, document_loss, held_out_documents
    from megatron_lns.config.data_checks import dataset_num_samples
    from megatron_lns.data.datasets import held_out_batches
    from megatron_lns.data.tokenizer import build_tokenizer
    from megatron_lns.runtime import init_distributed
    from megatron_lns.training.build import (
        build_model_chunks,
        dataset_settings,
        device_setting,
        model_config,
        parallel_layout,
        tokenizer_spec,
    )
    from megatron_lns.training.checkpoint import load_model_weights

    layout = parallel_layout(cfg)
    device = init_distributed(
        layout,
        device=device_setting(cfg),
        seed=cfg.model.seed,
        rendezvous_timeout_s=cfg.trainer.rendezvous_timeout_s,
    )
    m = cfg.model
    tokenizer = build_tokenizer(*tokenizer_spec(cfg))
    gpt = model_config(cfg, tokenizer.vocab_size)
    _, valid, test = dataset_num_samples(cfg)
    valid = max(valid, num_batches * m.global_batch_size)
    # No training split: analyze reads only held-out data (the validation split's samples
    # do not depend on how many training samples the run drew).
    splits = dataset_settings(cfg).build(
        tokenizer_spec(cfg), gpt.vocab_size, (0, valid, test), held_out_only=True
    )
    if splits.valid is None:
        raise AnalysisError(
            f"model.data.splits_string={m.data.splits_string} gives the validation split no "
            "data: there is nothing held out to measure on"
        )
    chunks = build_model_chunks(gpt, layout, device)
    load_model_weights(chunks, checkpoint)

    dp_size = parallel_state.get_data_parallel_world_size()
    num_microbatches = micro_batches_per_step(m.global_batch_size, m.micro_batch_size, dp_size)
    batches = [
        [{key: value.to(device) for key, value in mb.items()} for mb in batch]
        for batch in held_out_batches(
            splits.valid,
            num_batches,
            m.micro_batch_size,
            num_microbatches,
            dp_size,
            parallel_state.get_data_parallel_rank(),
        )
    ]
    rank0 = dist.get_rank() == 0
    bar = None
    if prune and rank0:
        from tqdm import tqdm

        bar = tqdm(total=num_blocks(m), desc="layer removal", unit="layer", file=sys.stderr)
    try:
        report = depth_diagnostics(
            chunks, batches, prune=prune, progress=None if bar is None else lambda _: bar.update()
        )
    finally:
        if bar is not None:
            bar.close()
    scored = document_batches(
        held_out_documents(_data_prefixes(cfg), m.data.splits_string, tokenizer.eod),
        tokenizer.eod,
        m.data.seq_length,
        num_batches * m.global_batch_size,
        m.micro_batch_size,
        num_microbatches,
        dp_size,
        parallel_state.get_data_parallel_rank(),
    )
    doc_loss, doc_tokens = document_loss(chunks, scored.batches, tokenizer.vocab_size)
    if rank0:
        result = report.to_dict() | {
            "document_loss": doc_loss,
            "document_perplexity": math.exp(min(doc_loss, 50.0)),
            "document_tokens": doc_tokens,
            "documents": scored.documents,
            "context_length": m.data.seq_length,
        }
        Path(result_path).write_text(json_numbers.dumps(result))
