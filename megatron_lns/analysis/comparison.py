"""Train the LNS paper's variants side by side over several seeds, then tabulate and plot.

``megatron-lns compare CONFIG --variants lns pre_ln post_ln --seeds 3`` trains one run per
variant and seed from the same YAML. Within a seed every variant starts from the same seed
(``model.seed``: init and data order); the variants differ only in the keys their name
sets (:data:`VARIANTS`, plus an optional init suffix). ``megatron-lns demo`` is the
default case: LNS and Pre-LN, one seed, on ``tiny_cpu_demo``.

Runs live in ``<out>/<variant>/seed<seed>/``, ordinary run directories: a comparison that
is interrupted resumes every run from its last checkpoint when started again with the
same ``--out``, and a finished run is not trained again (its ``compare_result.json`` holds
what the table needs; one that cannot be read is said, and its arm resumed and measured
again). Runs started with other ``model`` or ``trainer`` settings than the
arm's are refused by name (:func:`check_existing_runs`), and so are command-line
overrides of the keys each arm sets itself (:func:`check_overrides`): either would put
arms trained otherwise into one table.

The table reports, per variant, the mean and the sample standard deviation over seeds of
the held-out loss and perplexity, hidden-state variance growth (last layer / first), and
the angular distance of the last quarter of the layers (how much the deep layers still
change their input). A run that diverges is reported as such, not averaged.

Mixture-of-experts configs compare the same way: the variant keys apply to every layer,
dense or MoE, and the losses are the language-model loss alone (megatron adds the router
losses to the gradients, not to the reported loss). Where the runs' ``metrics.jsonl``
holds the router losses the trainer logs (:data:`ROUTER_LOSS_COLUMNS`), the table adds
their values at the end of training, so one sees whether an arm paid for its loss with
worse load balance.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from megatron_lns.analysis.depth import LayerStats, layer_statistics, variance_growth
from megatron_lns.analysis.plots import plot_depth_profiles, plot_seed_bands, read_metrics
from megatron_lns.base import json_numbers
from megatron_lns.base.disk import write_text_atomically
from megatron_lns.base.errors import UserError
from megatron_lns.base.json_numbers import json_safe, number
from megatron_lns.config import ConfigError, ExperimentConfig, to_yaml, validate
from megatron_lns.config.layer_variants import REGISTRY as LAYER_VARIANT_REGISTRY
from megatron_lns.config.layer_variants import lns_combines_with
from megatron_lns.config.loader import override_key
from megatron_lns.config.norm_scalings import REGISTRY as NORM_SCALING_REGISTRY
from megatron_lns.config.output_inits import REGISTRY as OUTPUT_INIT_REGISTRY
from megatron_lns.config.rules import rng_seed
from megatron_lns.config.sources import RUN_CONFIG
from megatron_lns.runtime.job import JobEnvironment
from megatron_lns.training.divergence import TrainingStopped
from megatron_lns.training.metrics import warn
from megatron_lns.training.provenance import changed_config_keys
from megatron_lns.training.run_dir import holds_a_run
from megatron_lns.training.trainer import Trainer


def _arms() -> dict[str, tuple[str, dict[str, str]]]:
    """Arm name -> (label, model keys), from the norm scaling and layer variant registries.

    A layer variant on a model without a scaling rule is named and labelled by the variant
    (``pre_ln``, "Pre-LN"); a scaling rule on the plain layer by the rule (``lns``, "LNS");
    a rule on any other variant it combines with by both (``lns_gpas``, "LNS + GPAS"). The
    keys are the only difference between arms. Listed in that order (rules, variants,
    combinations)."""
    rules, variants, combined = {}, {}, {}
    for scaling in NORM_SCALING_REGISTRY.values():
        for name, variant in LAYER_VARIANT_REGISTRY.items():
            keys = {"norm_scaling": scaling.name, "layer_variant": name}
            if scaling.arm is None:
                variants[name] = (variant.label, keys)
            elif not variant.changes_layer:
                rules[scaling.arm] = (scaling.label, keys)
            elif lns_combines_with(scaling.name, name):
                combined[f"{scaling.arm}_{name}"] = (f"{scaling.label} + {variant.label}", keys)
    return rules | variants | combined


VARIANTS: dict[str, tuple[str, dict[str, str]]] = _arms()
# ``<variant>+<suffix>`` sets the init of the residual output projections: suffix ->
# (label, output_layer_init), from the output init registry.
INIT_SUFFIXES: dict[str, tuple[str, str]] = {
    info.compare_suffix: (info.label, name) for name, info in OUTPUT_INIT_REGISTRY.items()
}
DEFAULT_VARIANTS = ("lns", "pre_ln")
RESULT_FILE = "compare_result.json"
TRAIN_LOSS_WINDOW = 20  # the table's train loss: mean over the last steps
# MoE router losses the trainer logs (without their coefficients; one name per
# moe_router_load_balancing_type) -> the table's column.
ROUTER_LOSS_COLUMNS: dict[str, str] = {
    "moe/load_balancing_loss": "load-balancing loss",
    "moe/seq_load_balancing_loss": "seq. load-balancing loss",
    "moe/global_load_balancing_loss": "global load-balancing loss",
    "moe/z_loss": "router z-loss",
}


class CompareError(UserError, ValueError):
    """A comparison that cannot run as asked (unknown variant, bad seed count)."""


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    model_settings: dict[str, str]

    @classmethod
    def parse(cls, name: str) -> Variant:
        base, _, suffix = name.partition("+")
        if base not in VARIANTS:
            raise CompareError(
                f"unknown variant {name!r}: variants are {', '.join(VARIANTS)}, optionally "
                f"with +{' / +'.join(INIT_SUFFIXES)}"
            )
        label, settings = VARIANTS[base]
        settings = dict(settings)
        if suffix:
            if suffix not in INIT_SUFFIXES:
                raise CompareError(
                    f"unknown init suffix in variant {name!r}: use one of "
                    + ", ".join("+" + s for s in INIT_SUFFIXES)
                )
            init_label, init = INIT_SUFFIXES[suffix]
            label, settings["output_layer_init"] = f"{label} + {init_label}", init
        return cls(name, label, settings)


def parse_variants(names: Sequence[str]) -> list[Variant]:
    variants = [Variant.parse(name) for name in names]
    repeated = sorted({v.name for v in variants if [w.name for w in variants].count(v.name) > 1})
    if repeated:
        raise CompareError(f"variant(s) given twice: {', '.join(repeated)}")
    return variants


def check_arms(cfg: ExperimentConfig, variants: Sequence[Variant]) -> None:
    """Refuse, before anything trains, an arm whose config is not a valid run: a variant's
    keys may contradict the base config's (a paper variant's layers with
    ``model.architecture=hybrid``, whose sublayers are Pre-LN with or without LNS)."""
    for variant in variants:
        arm = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, **variant.model_settings)
        )
        try:
            validate(arm, check_files=False)
        except ConfigError as err:
            raise CompareError(f"variant {variant.name}: {err}") from err


# What ``run_config`` sets for each arm besides the variant's model keys, and why.
ARM_KEYS = {"exp_manager.name": "the run's name by its seed"}


def check_overrides(
    overrides: Sequence[str], variants: Sequence[Variant], command: str, out: str | None = None
) -> None:
    """Refuse command-line overrides of keys each arm sets itself: the user's value would
    be dropped without a word (a YAML's value is the base the arms replace, as meant).
    With ``out``, ``exp_manager.exp_dir`` is one: each arm runs in ``<out>/<variant>``
    (without it, exp_dir is honoured: the comparison goes to ``<exp_dir>/<time>``)."""
    variant_keys = {f"model.{key}" for v in variants for key in v.model_settings}
    given = [override_key(o) for o in overrides]
    ours = list(dict.fromkeys(k for k in given if k in variant_keys or k in ARM_KEYS))
    if ours:
        why = ["the layers by the variant"] if any(k in variant_keys for k in ours) else []
        why += [ARM_KEYS[k] for k in ours if k in ARM_KEYS]
        raise CompareError(
            f"{', '.join(ours)}: {command} sets these for each arm ({', '.join(why)}); "
            "choose the arms with `compare --variants` instead"
        )
    if out is not None:
        for override in overrides:
            if override_key(override) == "exp_manager.exp_dir":
                raise CompareError(
                    f"{override}: {command} sets exp_manager.exp_dir from --out (each arm's "
                    f"run directory is {out}/<variant>); choose --out instead"
                )


# Keys a resume honours that do not change what an arm trains: where it runs (the
# parallel layout, docs/resuming.md) and when it stops or logs. A run stopped with
# ``trainer.exit_interval`` may be resumed without it, on more devices, and so on.
MAY_DIFFER_ON_RESUME = frozenset(
    {
        "trainer.devices",
        "trainer.num_nodes",
        "trainer.exit_interval",
        "trainer.log_every_n_steps",
        "model.tensor_model_parallel_size",
        "model.pipeline_model_parallel_size",
        "model.virtual_pipeline_model_parallel_size",
        "model.sequence_parallel",
        "model.context_parallel_size",
        "model.expert_model_parallel_size",
        "model.expert_tensor_parallel_size",
    }
)


def check_existing_runs(
    cfg: ExperimentConfig, variants: Sequence[Variant], seeds: Sequence[int], out: Path
) -> None:
    """Refuse a comparison into an ``out`` whose runs were started with other settings:
    their results (or checkpoints) would go into one table with arms trained otherwise.
    Compares each existing run's ``config.yaml`` with the arm's, over the sections a
    checkpoint's config hash covers (``provenance.py``: ``model`` and ``trainer``), but
    for :data:`MAY_DIFFER_ON_RESUME`."""
    for seed in seeds:
        for variant in variants:
            run_dir = out / variant.name / f"seed{seed}"
            stored = run_dir / RUN_CONFIG
            if not stored.is_file() or not (
                (run_dir / RESULT_FILE).is_file() or holds_a_run(run_dir)
            ):
                continue  # nothing kept that would be reused: the arm starts afresh
            arm = to_yaml(run_config(cfg, variant, seed, out))
            changed = changed_config_keys(stored.read_text(), arm)
            keys = [key for key in changed if key not in MAY_DIFFER_ON_RESUME]
            if keys:
                raise CompareError(
                    f"{run_dir} was trained with other settings than this comparison's "
                    f"({', '.join(keys)}): rerun with the settings it was started with, or "
                    "choose another --out"
                )


def seeds_for(cfg: ExperimentConfig, num_seeds: int) -> list[int]:
    """``num_seeds`` consecutive seeds starting at the config's ``model.seed``."""
    if num_seeds < 1:
        raise CompareError(f"--seeds must be at least 1, got {num_seeds}")
    seeds = [cfg.model.seed + k for k in range(num_seeds)]
    if not rng_seed.holds(seeds[-1]):
        # Only the first seed is the config's (validated); a later one out of range failed
        # in megatron's data shuffling, after the arms before it had trained.
        raise CompareError(
            f"--seeds {num_seeds} from model.seed={cfg.model.seed} reaches seed {seeds[-1]}: "
            f"seeds must be {rng_seed.expected}; lower model.seed or --seeds"
        )
    return seeds


def run_config(cfg: ExperimentConfig, variant: Variant, seed: int, out: Path) -> ExperimentConfig:
    model = dataclasses.replace(cfg.model, seed=seed, **variant.model_settings)
    exp = dataclasses.replace(cfg.exp_manager, exp_dir=str(out / variant.name), name=f"seed{seed}")
    return dataclasses.replace(cfg, model=model, exp_manager=exp)


@dataclass
class RunResult:
    """What the table and plots need from one trained run (``compare_result.json``)."""

    variant: str
    seed: int
    steps: int
    held_out_loss: float = math.nan
    train_loss: float = math.nan
    tokens_per_second: float = math.nan
    layer_stats: list[LayerStats] = field(default_factory=list)
    diverged: str | None = None  # the trainer's message when the run could not go on
    # MoE: each logged router loss at the end of training (empty for a dense run).
    router_losses: dict[str, float] = field(default_factory=dict)

    @property
    def variance_growth(self) -> float:
        return variance_growth(self.layer_stats) if self.layer_stats else math.nan

    @property
    def deep_angular_distance(self) -> float:
        """Mean angular distance of the last quarter of the layers (at least one layer)."""
        if not self.layer_stats:
            return math.nan
        deep = self.layer_stats[-max(1, len(self.layer_stats) // 4) :]
        return statistics.fmean(s.angular_distance for s in deep)

    def to_json(self) -> dict:
        """Strict JSON: a non-finite number (a diverged run's) is a string of
        ``json_numbers.NON_FINITE``, which :meth:`from_json` reads back."""
        return json_safe(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: dict) -> RunResult:
        data = {k: number(v) if k in _NUMBERS else v for k, v in data.items()}
        data["layer_stats"] = [
            LayerStats(**{k: number(v) for k, v in s.items()}) for s in data["layer_stats"]
        ]
        data["router_losses"] = {k: number(v) for k, v in data.get("router_losses", {}).items()}
        return cls(**data)


_NUMBERS = ("held_out_loss", "train_loss", "tokens_per_second")


def _metrics_summary(run_dir: Path) -> tuple[float, float, float, dict[str, float]]:
    """Held-out loss at the end, mean train loss of the last steps, mean logged tokens/s
    and the router losses at the end, read from the run's ``metrics.jsonl`` (which spans
    resumes)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    held_out = [r["val_loss"] for r in records if "val_loss" in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return (
        held_out[-1] if held_out else math.nan,
        statistics.fmean(losses[-TRAIN_LOSS_WINDOW:]) if losses else math.nan,
        statistics.fmean(speeds) if speeds else math.nan,
        _final_router_losses(records),
    )


def _final_router_losses(records: list[dict]) -> dict[str, float]:
    """Each router loss averaged over the steps logged in the last ``TRAIN_LOSS_WINDOW``
    steps (the trainer logs them only every ``log_every_n_steps``; the last step always)."""
    final = {}
    for key in ROUTER_LOSS_COLUMNS:
        logged = [(r["step"], r[key]) for r in records if key in r]
        if logged:
            last_step = logged[-1][0]
            window = [v for step, v in logged if step > last_step - TRAIN_LOSS_WINDOW]
            final[key] = statistics.fmean(window)
    return final


def train_and_measure(
    cfg: ExperimentConfig,
    variant: str,
    seed: int,
    job: JobEnvironment | None = None,
    started_at: float | None = None,
) -> RunResult | None:
    """Train one run to ``trainer.max_steps`` (resuming it if it has checkpoints), then
    measure its layers on the held-out batches. A run that diverges is a result; a run
    asked to stop (signal, ``trainer.exit_interval``) returns None, checkpointed.
    ``started_at``: the run's start, where not the job's (an arm after the first).

    On rank 0 the result also holds what ``metrics.jsonl`` says (losses, tokens/s) and is
    written to the run directory."""
    out = Path(cfg.exp_manager.exp_dir).parent  # run_config: <out>/<variant>/seed<seed>
    elsewhere = f"wait for the comparison writing {out} to end, or choose another --out"
    trainer = Trainer(cfg, f"{variant} seed{seed}", job, elsewhere=elsewhere, started_at=started_at)
    run_dir = trainer.run_dir
    try:
        summary = trainer.fit()
    except TrainingStopped as stop:
        result = RunResult(variant, seed, trainer.state.iteration, diverged=str(stop))
    else:
        if summary.stopped_early:
            return None
        result = RunResult(variant, seed, summary.steps)
        if trainer.has_validation:
            for chunk in trainer.model:
                chunk.eval()
            batches = [mb for batch in trainer.validation_microbatches() for mb in batch]
            result.layer_stats = layer_statistics(trainer.model, batches)
    if dist.get_rank() == 0:
        held_out, train_loss, speed, router_losses = _metrics_summary(run_dir)
        result.held_out_loss = math.nan if result.diverged else held_out
        result.train_loss, result.tokens_per_second = train_loss, speed
        result.router_losses = {} if result.diverged else router_losses
        # Whole or not at all: a comparison killed here resumes from a readable result.
        text = json_numbers.dumps(result.to_json(), indent=1)
        write_text_atomically(run_dir / RESULT_FILE, text)
    return result


def _is_rank0() -> bool:
    """Rank 0, also before a process group exists: a comparison whose runs have all
    finished starts none (no Trainer), and its launcher's ranks still know their RANK."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _finished(cfg: ExperimentConfig, run_dir: Path) -> RunResult | None:
    path = run_dir / RESULT_FILE
    if not path.is_file():
        return None
    try:
        result = RunResult.from_json(json.loads(path.read_text()))
        done = bool(result.diverged) or result.steps >= cfg.trainer.max_steps
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        # Half-written (an older version wrote it in place) or edited: the arm is redone,
        # resuming from its checkpoints, which is all the result was made from.
        if _is_rank0():
            warn(
                f"{path} cannot be read ({type(err).__name__}: {err}); training and "
                "measuring that arm again from its last checkpoint"
            )
        return None
    return result if done else None


@dataclass
class Comparison:
    """Every run's result, by variant, in the order asked for."""

    variants: list[Variant]
    seeds: list[int]
    results: dict[str, list[RunResult]]
    stopped: bool = False  # asked to stop before every run finished


def _mean_sd(values: Sequence[float]) -> str:
    """Over the values that were measured: a run without validation has NaN there, and
    ``statistics.stdev`` raises on more than one NaN rather than returning NaN."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}"


def format_table(comparison: Comparison) -> str:
    """A Markdown table: mean ± sample standard deviation over the seeds that finished;
    a column per router loss that some run logged (MoE)."""
    logged = {key for runs in comparison.results.values() for r in runs for key in r.router_losses}
    router_keys = [key for key in ROUTER_LOSS_COLUMNS if key in logged]
    rows = [
        "| variant | seeds | diverged | tokens/s | train loss | held-out loss | held-out ppl "
        "| var growth L/1 | angular dist. last 1/4 |"
        + "".join(f" {ROUTER_LOSS_COLUMNS[key]} |" for key in router_keys),
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(router_keys),
    ]
    for variant in comparison.variants:
        runs = comparison.results[variant.name]
        ok = [r for r in runs if not r.diverged]

        def col(values: list[float], fmt: str = "mean_sd") -> str:
            if fmt == "int":
                values = [v for v in values if math.isfinite(v)]
                return f"{statistics.fmean(values):.0f}" if values else "-"
            return _mean_sd(values)

        rows.append(
            f"| {variant.label} | {len(runs)} | {len(runs) - len(ok)} "
            f"| {col([r.tokens_per_second for r in ok], 'int')} "
            f"| {col([r.train_loss for r in ok])} | {col([r.held_out_loss for r in ok])} "
            f"| {col([math.exp(r.held_out_loss) for r in ok])} "
            f"| {col([r.variance_growth for r in ok])} "
            f"| {col([r.deep_angular_distance for r in ok])} |"
            + "".join(
                f" {col([r.router_losses[key] for r in ok if key in r.router_losses])} |"
                for key in router_keys
            )
        )
    return "\n".join(rows)


def _write_outputs(comparison: Comparison, out: Path, title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "seeds": comparison.seeds,
        "variants": {
            v.name: {
                "label": v.label,
                "model_settings": v.model_settings,
                "runs": [r.to_json() for r in comparison.results[v.name]],
            }
            for v in comparison.variants
        },
    }
    (out / "comparison.json").write_text(json_numbers.dumps(report, indent=1))
    (out / "comparison.md").write_text(format_table(comparison) + "\n")
    curves = {
        v.label: [
            out / v.name / f"seed{r.seed}" / "metrics.jsonl" for r in comparison.results[v.name]
        ]
        for v in comparison.variants
    }
    depth = {
        v.label: [r.layer_stats for r in comparison.results[v.name] if r.layer_stats]
        for v in comparison.variants
    }
    return [
        plot_seed_bands(curves, out / "loss_curves.png", title=title),
        plot_depth_profiles(depth, out / "depth_profiles.png", title=title),
    ]


def run_comparison(
    cfg: ExperimentConfig,
    variants: Sequence[Variant],
    num_seeds: int,
    out: Path,
    job: JobEnvironment | None = None,
) -> Comparison:
    """Train (or resume, or reuse) every run, seed by seed, then rank 0 writes
    ``comparison.json``, ``comparison.md`` and the plots under ``out`` and prints the table.
    ``job`` is the job the runs belong to, as for :class:`Trainer` (default: a local run)."""
    seeds = seeds_for(cfg, num_seeds)
    results: dict[str, list[RunResult]] = {v.name: [] for v in variants}
    # The process's start is the first arm's start-up; each later arm starts when it does.
    trained_one = False
    for seed in seeds:  # seed-major: an interrupted comparison has every variant early
        for variant in variants:
            run_cfg = run_config(cfg, variant, seed, out)
            run_dir = out / variant.name / f"seed{seed}"
            result = _finished(run_cfg, run_dir)
            if result is None:
                started_at = time.time() if trained_one else None
                result = train_and_measure(run_cfg, variant.name, seed, job, started_at)
                trained_one = True
            if result is None:
                if _is_rank0():
                    print(f"comparison stopped; rerun with --out {out} to resume", flush=True)
                return Comparison(list(variants), seeds, results, stopped=True)
            results[variant.name].append(result)
    comparison = Comparison(list(variants), seeds, results)
    if _is_rank0():
        pngs = _write_outputs(comparison, out, title=f"{cfg.name}: {len(seeds)} seed(s)")
        print("\n" + format_table(comparison), flush=True)
        print(
            "\nMean ± sample standard deviation over seeds. Train loss: mean of the last "
            f"{TRAIN_LOSS_WINDOW} steps. 'var growth L/1': hidden-state variance after the "
            "last layer\nrelative to after the first (held-out data), the curse-of-depth "
            "signature LNS curbs. 'angular dist.':\nhow far the last quarter of the layers "
            "turn their input (0: the layer does nothing).\n"
            + (
                "Router losses (MoE): as the trainer logs them, without their coefficients, "
                "averaged over the MoE layers\nand the steps logged in the last "
                f"{TRAIN_LOSS_WINDOW}; the load-balancing loss is 1 when the experts are "
                "evenly loaded.\n"
                if any(r.router_losses for runs in results.values() for r in runs)
                else ""
            )
            + (
                "One seed is not a verdict: differences between variants need --seeds N "
                "to be read against their spread.\n"
                if len(seeds) == 1
                else ""
            )
            + f"Runs, TensorBoard logs and checkpoints: {out} (rerun with --out {out} to "
            "resume)\nTable: "
            + str(out / "comparison.md")
            + "\nPlots: "
            + ", ".join(str(p) for p in pngs),
            flush=True,
        )
    return comparison
