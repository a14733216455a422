"""Side-by-side demo: the same tiny model trained with LNS and with plain Pre-LN.

Both arms share everything (data order, init, optimizer, schedule) except
``norm_scaling``. The printed table reports what a few minutes of CPU training can
honestly show: throughput, train and held-out loss, and how fast hidden-state
variance grows with depth. Loss after a few hundred steps can favour either arm
(LNS trails early in the paper's OLMo-7B curve and in our own toy runs with
megatron's scaled init for Pre-LN); the variance growth is the signature to read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_lns.analysis.depth import LayerStats, layer_statistics, variance_growth
from megatron_lns.data.demo_corpus import VOCAB_SIZE, RandomWindows, demo_token_splits
from megatron_lns.model import GPTModelConfig, build_model, padded_vocab_size
from megatron_lns.runtime import ParallelLayout, init_distributed, spawn_local
from megatron_lns.training.optim import OptimSettings, build_optimizer_and_scheduler
from megatron_lns.training.step import forward_backward, make_batch, train_step, wrap_with_ddp


@dataclass
class DemoSettings:
    num_layers: int = 16
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int = 344
    seq_length: int = 128
    micro_batch_size: int = 4
    num_microbatches: int = 2
    steps: int = 300
    eval_batches: int = 8
    log_every: int = 50
    seed: int = 1234
    output_layer_init: str = "normal"
    optim: OptimSettings = field(
        default_factory=lambda: OptimSettings(lr=2e-3, min_lr=2e-4, warmup_steps=30, clip_grad=1.0)
    )
    layout: ParallelLayout = ParallelLayout()

    def model_config(self, norm_scaling: str) -> GPTModelConfig:
        return GPTModelConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            vocab_size=padded_vocab_size(VOCAB_SIZE, self.layout.tensor),
            seq_length=self.seq_length,
            norm_scaling=norm_scaling,
            output_layer_init=self.output_layer_init,
        )


@dataclass
class ArmResult:
    name: str
    steps: int
    tokens_per_second: float
    train_loss: float
    valid_loss: float
    layer_stats: list[LayerStats]

    @property
    def variance_growth(self) -> float:
        return variance_growth(self.layer_stats)


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def train_arm(settings: DemoSettings, norm_scaling: str) -> ArmResult:
    """Train one arm from scratch; every rank returns the same result."""
    init_distributed(settings.layout, seed=settings.seed)
    cfg = settings.model_config(norm_scaling)
    model = wrap_with_ddp(build_model(cfg, settings.layout))
    optimizer, scheduler = build_optimizer_and_scheduler(model, settings.optim, settings.steps)

    splits = demo_token_splits()
    dp_rank = parallel_state.get_data_parallel_rank()
    train = RandomWindows(splits.train, settings.seq_length, seed=settings.seed + dp_rank)
    valid = RandomWindows(splits.valid, settings.seq_length, seed=settings.seed + 10_000 + dp_rank)
    valid_batches = [
        make_batch(valid.sample(settings.micro_batch_size)) for _ in range(settings.eval_batches)
    ]

    recent: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for step in range(1, settings.steps + 1):
        microbatches = [
            make_batch(train.sample(settings.micro_batch_size))
            for _ in range(settings.num_microbatches)
        ]
        result = train_step(model, optimizer, microbatches)
        scheduler.step(increment=1)
        tokens += result.num_tokens
        recent = [*recent, result.loss][-20:]
        if step % settings.log_every == 0 or step == settings.steps:
            lr = scheduler.get_lr(optimizer.param_groups[0])
            _log(
                f"[{norm_scaling:>4}] step {step:5d}  loss {result.loss:.4f}  "
                f"grad_norm {result.grad_norm:.3f}  lr {lr:.2e}"
            )
    elapsed = time.perf_counter() - start

    for chunk in model:
        chunk.eval()
    valid_loss = forward_backward(model, valid_batches, forward_only=True).loss
    stats = layer_statistics(model, valid_batches)
    return ArmResult(
        name="LNS" if norm_scaling == "lns" else "Pre-LN",
        steps=settings.steps,
        tokens_per_second=tokens / elapsed,
        train_loss=sum(recent) / len(recent),
        valid_loss=valid_loss,
        layer_stats=stats,
    )


def format_table(results: list[ArmResult]) -> str:
    header = (
        f"{'arm':<8}{'steps':>7}{'tokens/s':>11}{'train loss':>12}{'held-out loss':>15}"
        f"{'held-out ppl':>14}{'var growth L/1':>16}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.name:<8}{r.steps:>7}{r.tokens_per_second:>11.0f}{r.train_loss:>12.4f}"
            f"{r.valid_loss:>15.4f}{torch.tensor(r.valid_loss).exp().item():>14.3f}"
            f"{r.variance_growth:>16.2f}"
        )
    return "\n".join(lines)


def run_demo(settings: DemoSettings) -> list[ArmResult]:
    """Both arms on this rank's process group; rank 0 prints the summary."""
    results = [train_arm(settings, "lns"), train_arm(settings, "none")]
    _log("\n" + format_table(results))
    lns, pre_ln = results
    leader = "LNS" if lns.valid_loss < pre_ln.valid_loss else "Pre-LN"
    _log(
        "\n'var growth L/1': hidden-state variance after the last layer relative to after the "
        "first,\nthe curse-of-depth signature LNS curbs. Train loss: mean of the last 20 steps. "
        "Held-out: last 5%\nof the corpus. "
        f"{leader} leads in held-out loss after {lns.steps} steps. One short run on one seed "
        "is\nnot a verdict: LNS can trail early and overtake with longer training "
        "(see docs/results.md)."
    )
    return results


def _demo_worker(settings: DemoSettings) -> None:
    run_demo(settings)


def launch_demo(settings: DemoSettings, world_size: int | None = None) -> None:
    """Run in this process (world size 1 or under torchrun), or spawn local ranks."""
    layout = settings.layout
    world_size = world_size or layout.tensor * layout.pipeline
    if "RANK" in os.environ or world_size == 1:
        run_demo(settings)
    else:
        spawn_local(_demo_worker, world_size, settings)


def settings_with(settings: DemoSettings, **overrides) -> DemoSettings:
    return replace(settings, **overrides)
