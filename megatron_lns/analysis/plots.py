"""Plots: loss curves from the ``metrics.jsonl`` files the trainer writes, and the
per-layer diagnostics of :mod:`~megatron_lns.analysis.depth` for several models."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lns.analysis.depth import DepthReport


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curves(runs: dict[str, Path], output: str | Path, title: str = "") -> Path:
    """Training loss and held-out loss per step for each run, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for (label, metrics_path), color in zip(
        runs.items(), ("tab:blue", "tab:orange", "tab:green"), strict=False
    ):
        records = read_metrics(metrics_path)
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        valid = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if train:
            ax.plot(*zip(*train, strict=True), color=color, label=f"{label} train")
        if valid:
            ax.plot(*zip(*valid, strict=True), "o--", color=color, label=f"{label} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output = Path(output)
    fig.savefig(output)
    plt.close(fig)
    return output


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
