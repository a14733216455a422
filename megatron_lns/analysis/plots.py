"""Loss curves from the ``metrics.jsonl`` files the trainer writes."""

from __future__ import annotations

import json
from pathlib import Path


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
