"""Plots: loss curves with their spread over seeds (``compare``), and per-layer diagnostics
of :mod:`~megatron_lns.analysis.depth` overlaid for several models (``analyze``)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_lns.analysis.depth import DepthReport, LayerStats

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:gray", "tab:olive", "tab:cyan")  # fmt: skip


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def trailing_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    x = np.asarray(values, dtype=np.float64)
    sums = np.cumsum(np.insert(x, 0, 0.0))
    ends = np.arange(1, len(x) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _series(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}  # a replayed step: the last row


def _band(curves: list[dict[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The steps every curve has, and the values there (one row per curve)."""
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return np.asarray(steps), np.asarray([[c[s] for s in steps] for c in curves])


def plot_seed_bands(
    runs: dict[str, Sequence[Path]], output: str | Path, title: str = "", window: int = 0
) -> Path:
    """Per label: every step's training loss (``metrics.jsonl``), smoothed by a trailing
    mean, averaged over the label's seeds with their min-max range as a band; held-out
    loss as markers. ``window`` 0 picks 1/50 of the run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for (label, paths), color in zip(runs.items(), COLORS * 4, strict=False):
        records = [read_metrics(p) for p in paths if Path(p).is_file()]
        train = [_series(r, "loss") for r in records if _series(r, "loss")]
        if train:
            steps, values = _band(train)
            w = window or max(1, len(steps) // 50)
            smooth = np.stack([trailing_mean(row, w) for row in values])
            ax.plot(steps, smooth.mean(axis=0), color=color, label=f"{label} train")
            if len(train) > 1:
                ax.fill_between(steps, smooth.min(axis=0), smooth.max(axis=0), color=color,
                                alpha=0.2, linewidth=0)  # fmt: skip
        held_out = [_series(r, "val_loss") for r in records if _series(r, "val_loss")]
        if held_out:
            steps, values = _band(held_out)
            ax.plot(steps, values.mean(axis=0), "o--", color=color, label=f"{label} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    return _save(fig, output)


def plot_depth_profiles(
    runs: dict[str, Sequence[Sequence[LayerStats]]], output: str | Path, title: str = ""
) -> Path:
    """Per label: hidden-state variance (log scale) and angular distance by layer, mean over
    seeds with the min-max range as a band."""
    plt = _pyplot()
    fig, (var_ax, ang_ax) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    for (label, seeds), color in zip(runs.items(), COLORS * 4, strict=False):
        if not seeds:
            continue
        layers = [s.layer_number for s in seeds[0]]
        for ax, key in ((var_ax, "output_variance"), (ang_ax, "angular_distance")):
            values = np.asarray([[getattr(s, key) for s in stats] for stats in seeds])
            ax.plot(layers, values.mean(axis=0), "o-", color=color, markersize=3, label=label)
            if len(seeds) > 1:
                ax.fill_between(layers, values.min(axis=0), values.max(axis=0), color=color,
                                alpha=0.2, linewidth=0)  # fmt: skip
    var_ax.set_yscale("log")
    var_ax.set_ylabel("hidden-state variance after the layer")
    ang_ax.set_ylabel("angular distance, layer input to output")
    for ax in (var_ax, ang_ax):
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    ang_ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, output)


def _depth_axes(ax, ylabel: str, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def plot_depth_reports(reports: dict[str, DepthReport], out_dir: str | Path) -> list[Path]:
    """One PNG per diagnostic, every report overlaid: angular distance (all tokens and
    last token), output variance (log scale) and pruning drop, against the layer number."""
    plt = _pyplot()
    out_dir = Path(out_dir)

    def curve(report: DepthReport, field: str) -> tuple[list[int], list[float]]:
        return [r.layer_number for r in report.layers], [getattr(r, field) for r in report.layers]

    written = []
    fig, (all_tokens, last_token) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120, sharey=True)
    for label, report in reports.items():
        all_tokens.plot(*curve(report, "angular_distance"), "o-", label=label)
        last_token.plot(*curve(report, "angular_distance_last_token"), "o-", label=label)
    _depth_axes(all_tokens, "arccos(cos(input, output)) / pi", "angular distance, all tokens")
    _depth_axes(last_token, "", "angular distance, last token")
    written.append(_save(fig, out_dir / "angular_distance.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, report in reports.items():
        ax.plot(*curve(report, "output_variance"), "o-", label=label)
    ax.set_yscale("log")
    _depth_axes(ax, "variance of the layer's output", "hidden-state variance")
    written.append(_save(fig, out_dir / "variance.png"))

    pruned = {
        label: report
        for label, report in reports.items()
        if any(not math.isnan(row.pruning_drop) for row in report.layers)
    }
    if pruned:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        for label, report in pruned.items():
            ax.plot(*curve(report, "pruning_drop"), "o-", label=label)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        _depth_axes(
            ax, "held-out loss without the layer - full model", "pruning drop (layer removed)"
        )
        written.append(_save(fig, out_dir / "pruning_drop.png"))
    return written


def _save(fig, output: str | Path) -> Path:
    output = Path(output)
    fig.tight_layout()
    fig.savefig(output)
    _pyplot().close(fig)
    return output
