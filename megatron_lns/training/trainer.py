"""The pretraining loop: a validated experiment config in, checkpoints and metrics out.

Thin by design: every distributed mechanism is megatron-core's (parallel_state,
DDP, the optimizer and its grad clipping, OptimizerParamScheduler, the
num-microbatches calculator, the pipeline schedules, dist_checkpointing, GPTDataset).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_num_microbatches,
    init_num_microbatches_calculator,
)
from megatron.core.transformer.module import Float16Module

from megatron_lns.analysis.depth import LayerStats, layer_statistics
from megatron_lns.config import ExperimentConfig, to_yaml
from megatron_lns.config.translate import model_config, optim_settings, parallel_layout
from megatron_lns.config.validate import BUILTIN_PREFIX, data_blend
from megatron_lns.data.datasets import build_gpt_datasets, check_dataset_fits, micro_batch_loader
from megatron_lns.data.demo_corpus import builtin_dataset_prefix
from megatron_lns.data.tokenizer import build_tokenizer
from megatron_lns.model import GPTModelConfig, build_model
from megatron_lns.runtime import init_distributed
from megatron_lns.training.checkpoint import (
    TrainingState,
    latest_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megatron_lns.training.logging import MetricsLogger
from megatron_lns.training.optim import build_optimizer_and_scheduler
from megatron_lns.training.run_status import write_run_status
from megatron_lns.training.step import forward_backward, train_step, wrap_with_ddp


@dataclass
class RunSummary:
    name: str
    run_dir: Path
    steps: int
    resumed_from: int
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    valid_loss: float = float("nan")
    tokens_per_second: float = 0.0
    tflops_per_device: float = 0.0
    layer_stats: list[LayerStats] = field(default_factory=list)
    stopped_early: bool = False


def model_flops_per_token(cfg: GPTModelConfig) -> float:
    """Forward+backward FLOPs per token: 6 x matmul parameters + causal attention."""
    h, layers, s = cfg.hidden_size, cfg.num_layers, cfg.seq_length
    ffn = cfg.ffn_hidden_size or 4 * h
    groups = cfg.num_query_groups or cfg.num_attention_heads
    kv = 2 * h * groups // cfg.num_attention_heads
    mlp_in = 2 * ffn if cfg.activation == "swiglu" else ffn
    per_layer = h * (h + kv) + h * h + h * mlp_in + ffn * h
    return 6.0 * (layers * per_layer + h * cfg.vocab_size) + 6.0 * layers * h * s


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _tflops(tokens_per_second: float, flops_per_token: float) -> float:
    """Model TFLOP/s per device (all ranks share the tokens)."""
    return tokens_per_second * flops_per_token / 1e12 / dist.get_world_size()


class _StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's pre-emption warning) ask for a checkpoint and a clean exit."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            # Only the main thread may install handlers (not so under some runners).
            with contextlib.suppress(ValueError):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Trainer:
    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.exp_manager.exp_dir or "runs") / cfg.exp_manager.name
        self.checkpoint_dir = self.run_dir / "checkpoints"

    def _device_setting(self) -> str:
        return {"auto": "auto", "cpu": "cpu", "gpu": "cuda"}[self.cfg.trainer.accelerator]

    def _dataset_prefixes(self) -> tuple[list[str], list[float] | None]:
        """The blend's prefixes and weights, built-in corpora prepared (by rank 0) first."""
        m = self.cfg.model
        prefixes, weights = data_blend(m.data.data_prefix)
        resolved = []
        for prefix in prefixes:
            if prefix.startswith(BUILTIN_PREFIX):
                args = (
                    prefix[len(BUILTIN_PREFIX) :],
                    m.tokenizer.library,
                    m.tokenizer.type,
                    m.tokenizer.model,
                )
                if dist.get_rank() == 0:
                    builtin_dataset_prefix(*args)  # tokenizes and caches on first use
                dist.barrier()
                prefix = str(builtin_dataset_prefix(*args))
            resolved.append(prefix)
        return resolved, weights

    def run(self) -> RunSummary:
        cfg, m, t = self.cfg, self.cfg.model, self.cfg.trainer
        # First, so a stop request during setup (a preemption warning while the
        # checkpoint loads) is kept and honoured at the first step boundary.
        stop = _StopRequest()
        layout = parallel_layout(cfg)
        device = init_distributed(layout, device=self._device_setting(), seed=m.seed)
        rank0 = dist.get_rank() == 0
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        config_yaml = to_yaml(cfg)
        if rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(config_yaml)

        tokenizer = build_tokenizer(m.tokenizer.library, m.tokenizer.type, m.tokenizer.model)
        gpt_config = model_config(cfg, tokenizer.vocab_size)
        prefixes, weights = self._dataset_prefixes()
        for prefix in prefixes:
            check_dataset_fits(prefix, tokenizer, gpt_config.vocab_size)

        chunks = build_model(gpt_config, layout, device)
        if gpt_config.precision != "fp32":
            chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=device.type == "cuda",
            use_distributed_optimizer=m.optim.name == "distributed_fused_adam",
        )
        model = wrap_with_ddp(chunks, ddp_config)
        settings = optim_settings(cfg)
        params_dtype = chunks[0].config.params_dtype
        optimizer, scheduler = build_optimizer_and_scheduler(
            model, settings, t.max_steps, params_dtype
        )

        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(
            dist.get_rank(), None, m.global_batch_size, m.micro_batch_size, dp_size
        )
        num_microbatches = get_num_microbatches()

        state = TrainingState()
        resumed_from = 0
        latest = (
            latest_complete_checkpoint(self.checkpoint_dir)
            if cfg.exp_manager.resume_if_exists
            else None
        )
        if latest is not None:
            state = load_checkpoint(latest, model, optimizer, scheduler)
            resumed_from = state.iteration
            if rank0:
                print(
                    f"[{cfg.exp_manager.name}] resumed from {latest} (step {state.iteration})",
                    flush=True,
                )

        num_evals = t.max_steps // t.val_check_interval + 1
        splits = build_gpt_datasets(
            prefixes,
            weights,
            m.data.splits_string,
            m.data.seq_length,
            tokenizer,
            m.seed,
            num_train_samples=t.max_steps * m.global_batch_size,
            num_valid_samples=max(t.limit_val_batches, 1) * m.global_batch_size * num_evals,
            cache_dir=m.data.index_mapping_dir,
            reset_position_ids=m.data.reset_position_ids,
            reset_attention_mask=m.data.reset_attention_mask,
            eod_mask_loss=m.data.eod_mask_loss,
        )
        train_batches = micro_batch_loader(
            splits.train,
            state.consumed_samples,
            m.micro_batch_size,
            dp_size,
            dp_rank,
            m.data.num_workers,
        )
        has_validation = splits.valid is not None and t.limit_val_batches > 0

        def validation_batches():
            """The first ``limit_val_batches`` global batches of the validation split, one
            global batch at a time (every validation sees the same samples)."""
            loader = micro_batch_loader(splits.valid, 0, m.micro_batch_size, dp_size, dp_rank, 0)
            for _ in range(t.limit_val_batches):
                yield [next(loader) for _ in range(num_microbatches)]

        logger = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.exp_manager.create_tensorboard_logger,
            wandb=cfg.exp_manager.create_wandb_logger,
            wandb_kwargs=cfg.exp_manager.wandb_logger_kwargs,
            run_name=cfg.exp_manager.name,
        )
        summary = RunSummary(cfg.exp_manager.name, self.run_dir, t.max_steps, resumed_from)
        flops_per_token = model_flops_per_token(gpt_config)
        every = cfg.exp_manager.checkpoint_callback_params.every_n_train_steps
        # Throughput counts training steps only (not validation or checkpoint saves).
        tokens_in_window, time_in_window, total_tokens, total_time = 0, 0.0, 0, 0.0

        def checkpoint() -> None:
            save_checkpoint(self.checkpoint_dir, model, optimizer, scheduler, state, config_yaml)

        def validate(step: int) -> float:
            for chunk in model:
                chunk.eval()
            loss_sum = tokens = 0.0
            for batches in validation_batches():
                result = forward_backward(model, batches, forward_only=True)
                loss_sum += result.loss * result.num_tokens
                tokens += result.num_tokens
            for chunk in model:
                chunk.train()
            loss = loss_sum / tokens
            logger.log(step, {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))})
            return loss

        try:
            while state.iteration < t.max_steps:
                step_start = time.perf_counter()
                microbatches = [next(train_batches) for _ in range(num_microbatches)]
                result = train_step(model, optimizer, microbatches)
                time_in_window += time.perf_counter() - step_start
                scheduler.step(increment=1)
                state.iteration += 1
                state.consumed_samples += m.global_batch_size
                summary.train_losses.append((state.iteration, result.loss))
                tokens_in_window += result.num_tokens

                if state.iteration % t.log_every_n_steps == 0 or state.iteration == t.max_steps:
                    tokens_per_second = tokens_in_window / time_in_window
                    total_tokens += tokens_in_window
                    total_time += time_in_window
                    logger.log(
                        state.iteration,
                        {
                            "loss": result.loss,
                            "ppl": math.exp(min(result.loss, 50.0)),
                            "lr": scheduler.get_lr(optimizer.param_groups[0]),
                            "grad_norm": _or_nan(result.grad_norm),
                            "tokens_per_s": tokens_per_second,
                            "tflops_per_device": _tflops(tokens_per_second, flops_per_token),
                        },
                    )
                    tokens_in_window, time_in_window = 0, 0.0
                if has_validation and state.iteration % t.val_check_interval == 0:
                    summary.valid_loss = validate(state.iteration)
                periodic = state.iteration % every == 0 and state.iteration < t.max_steps
                exit_interval = bool(t.exit_interval) and state.iteration % t.exit_interval == 0
                stop_now = (exit_interval and state.iteration < t.max_steps) or stop.agreed(device)
                if periodic or stop_now:
                    checkpoint()
                if stop_now:
                    if rank0:
                        print(
                            f"[{cfg.exp_manager.name}] stopping at step {state.iteration} "
                            "(checkpoint saved; rerun to resume)",
                            flush=True,
                        )
                    summary.stopped_early = True
                    break

            if not summary.stopped_early:
                if has_validation and state.iteration % t.val_check_interval != 0:
                    summary.valid_loss = validate(state.iteration)
                if cfg.exp_manager.checkpoint_callback_params.save_last:
                    checkpoint()
                if has_validation:
                    for chunk in model:
                        chunk.eval()
                    summary.layer_stats = layer_statistics(
                        model, [mb for batches in validation_batches() for mb in batches]
                    )
                    if rank0:
                        stats = [dataclasses.asdict(s) for s in summary.layer_stats]
                        (self.run_dir / "layer_stats.json").write_text(json.dumps(stats, indent=1))
        finally:
            logger.close()
        if rank0:
            write_run_status(self.run_dir, summary.stopped_early, state.iteration)
        summary.steps = state.iteration
        summary.tokens_per_second = total_tokens / total_time if total_time else 0.0
        summary.tflops_per_device = _tflops(summary.tokens_per_second, flops_per_token)
        return summary
