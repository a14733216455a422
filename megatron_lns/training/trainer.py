"""The pretraining loop: a validated experiment config in, checkpoints and metrics out.

Thin by design: every distributed mechanism is megatron-core's (parallel_state,
DDP, the optimizer and its grad clipping, OptimizerParamScheduler, the
num-microbatches calculator, the pipeline schedules, dist_checkpointing, GPTDataset).
:class:`Trainer` builds the run once from the config and :meth:`Trainer.fit` runs it;
``train_step``, ``evaluate`` and ``save`` are the pieces, usable on their own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import (
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.utils import get_model_config

from megatron_lns.base.errors import UserError
from megatron_lns.config import ExperimentConfig, to_yaml
from megatron_lns.config.cluster import time_limit_seconds
from megatron_lns.config.data_checks import dataset_num_samples
from megatron_lns.config.layout import micro_batches_per_step
from megatron_lns.config.paths import run_directory
from megatron_lns.data.datasets import held_out_batches, micro_batch_loader
from megatron_lns.data.tokenizer import build_tokenizer
from megatron_lns.runtime import init_distributed
from megatron_lns.runtime.job import JobEnvironment, LocalJob, ProgressRecords, ProgressSettings
from megatron_lns.training.attempt_recorder import AttemptRecorder
from megatron_lns.training.batch_size import init_batch_size_calculator
from megatron_lns.training.build import (
    build_trainable_from_config,
    dataset_settings,
    device_setting,
    fast_paths,
    model_config,
    parallel_layout,
    tokenizer_spec,
)
from megatron_lns.training.checkpoint_dirs import checkpoint_step, latest_complete_checkpoint
from megatron_lns.training.checkpoint_writer import CheckpointWriter
from megatron_lns.training.data_change import data_in_use
from megatron_lns.training.divergence import (
    MAX_CONSECUTIVE_SKIPPED_STEPS,
    TrainingStopped,
    diverged_message,
    every_update_skipped,
    non_finite_step,
)
from megatron_lns.training.hang_watchdog import HangWatch
from megatron_lns.training.manual_gc import ManualGarbageCollection
from megatron_lns.training.metrics import MetricsLogger, Throughput, say
from megatron_lns.training.moe_metrics import MoEMetrics
from megatron_lns.training.profiling import StepProfiler, profile_window
from megatron_lns.training.resume import (
    changes_since_checkpoint,
    interrupted_save_note,
    resume,
)
from megatron_lns.training.run_dir import ELSEWHERE
from megatron_lns.training.run_report import run_report
from megatron_lns.training.run_start import claim_run_directory, set_abandoned_branch_aside
from megatron_lns.training.run_status import write_run_status
from megatron_lns.training.step import (
    Batch,
    StepResult,
    forward_backward,
    sync_parameters,
    train_step,
)
from megatron_lns.training.step_log import StepLog
from megatron_lns.training.stop_request import StopRequest
from megatron_lns.training.stragglers import StragglerReport
from megatron_lns.training.timers import MegatronTimers, timer_settings


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
    skipped_steps: int = 0
    stopped_early: bool = False


def _count(parameters: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6)):
        if parameters >= size:
            return f"{parameters / size:.2f} {unit}"
    return f"{parameters:,}"


class Trainer:
    """One pretraining run, built from a validated :class:`ExperimentConfig`.

    Construction starts the process group, locks the run directory, builds the
    datasets (failing early on data that does not fit the tokenizer or model), the
    model, optimizer and schedule, and resumes (see ``resume.py``). :meth:`fit` releases
    the run directory when it returns; so does :meth:`close`.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        log_label: str | None = None,
        job: JobEnvironment | None = None,
        elsewhere: str = ELSEWHERE,
        started_at: float | None = None,
    ) -> None:
        """``log_label`` prefixes the run's console lines (default: ``exp_manager.name``);
        a comparison's runs share their names (``seed1234``) and say their variant too.
        ``job`` is the job the run belongs to, which its launcher knows (default: a
        :class:`~megatron_lns.runtime.job.LocalJob`, which no scheduler watches).
        ``elsewhere``: how the command writes to another run directory, for a refusal;
        ``started_at``: this run's start where it is not the job's (compare's later arms)."""
        self.job = job or LocalJob()
        # First, so that a stop signal arriving while the checkpoint loads is kept.
        self.stop_request = StopRequest(self.job.stop_signals())
        self.cfg = cfg
        self.log_label = log_label or cfg.exp_manager.name
        self.run_claim = None
        # A failure from here on releases what was taken (the run's lock, signal handlers)
        # and, before resume accepts the start, puts back the last run's config and status.
        try:
            self.run_dir = run_directory(cfg)
            self.checkpoint_dir = self.run_dir / "checkpoints"
            self.layout = parallel_layout(cfg)
            self.device = init_distributed(
                self.layout,
                device=device_setting(cfg),
                seed=cfg.model.seed,
                rendezvous_timeout_s=cfg.trainer.rendezvous_timeout_s,
                collective_timeout_minutes=cfg.trainer.distributed_timeout_minutes,
            )
            self.is_rank0 = dist.get_rank() == 0
            self.config_yaml = to_yaml(cfg)
            self.run_claim = claim_run_directory(
                self.run_dir,
                cfg.exp_manager.resume_if_exists,
                self.config_yaml,
                self.job,
                self.device,
                self._print,
                elsewhere,
            )
            self.progress = self._progress_recorder() if self.is_rank0 else None
            # This attempt's wall time, for goodput (rank 0 writes it to run_progress).
            self.attempt = AttemptRecorder(
                self.run_dir, self.job, self._print, self.is_rank0, started_at
            )
            self.checkpoints = CheckpointWriter(
                self.checkpoint_dir,
                asynchronous=cfg.exp_manager.checkpoint_callback_params.async_save,
                parallel=cfg.model.dist_ckpt_parallel_save,
                on_commit=self._checkpoint_committed,
            )
            # Phases and their timeouts from here to close() (hang_watchdog.py).
            self.hangs = HangWatch(
                cfg.exp_manager, dist.get_rank(), dist.get_world_size(), self._print,
                self.attempt.timeouts, self.attempt.hung)  # fmt: skip
            self._build()
        except BaseException:
            self.close()
            raise

    def _progress_recorder(self) -> ProgressRecords | None:
        """Records for whatever restarts the run (a batch script's progress guard), where
        the job environment keeps any."""
        c, saves = self.cfg.cluster, self.cfg.exp_manager.checkpoint_callback_params
        configured = time_limit_seconds(c.time_limit) if c.time_limit is not None else None
        settings = ProgressSettings(
            lead_s=c.preemption_signal_lead_s,
            time_limit_s=self.job.time_limit_s(configured),
            every=saves.every_n_train_steps,
            async_save=saves.async_save,
        )
        return self.job.progress_records(self.run_dir, settings)

    def _checkpoint_committed(self, path: Path, seconds: float) -> None:
        self.attempt.committed()
        if self.progress is not None:
            step = checkpoint_step(path)
            for line in self.progress.committed(step, seconds):
                self._print(f"warning: {line}")

    def _build(self) -> None:
        cfg = self.cfg
        m, t = cfg.model, cfg.trainer
        tokenizer = build_tokenizer(*tokenizer_spec(cfg))
        self.fast_paths = fast_paths(cfg, self.device)
        self.model_config = model_config(cfg, tokenizer.vocab_size, self.fast_paths)
        data = dataset_settings(cfg)
        self.splits = data.build(
            tokenizer_spec(cfg), self.model_config.vocab_size, dataset_num_samples(cfg)
        )
        # What each checkpoint records of the data, and a resume compares (issue 34).
        self.data_in_use = data_in_use(data.blend, data.blend.resolved(*tokenizer_spec(cfg)))

        trainable = build_trainable_from_config(
            cfg, self.model_config, self.device, self.fast_paths
        )
        self.model, self.optimizer, self.scheduler = (
            trainable.model,
            trainable.optimizer,
            trainable.scheduler,
        )
        self.megatron_timers = MegatronTimers(timer_settings(cfg))
        self.megatron_timers.install(get_model_config(self.model[0]), self.optimizer)
        self.moe_metrics = MoEMetrics.for_model(self.model, get_model_config(self.model[0]))
        if self.moe_metrics is not None:
            counts = self.model_config.parameter_counts()
            self._print(
                f"mixture of experts: {_count(counts.total)} parameters in all, "
                f"{_count(counts.active)} active per token"
            )
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        init_batch_size_calculator(
            dist.get_rank(),
            m.global_batch_size,
            m.micro_batch_size,
            self.dp_size,
            m.rampup_batch_size,
        )
        if m.rampup_batch_size is not None:
            start, increment, samples = m.rampup_batch_size
            self._print(
                f"batch-size ramp-up: {start} to {m.global_batch_size} sequences per step, "
                f"in increments of {increment}, over the first {samples} samples"
            )
        # Validation always uses full global batches, as Megatron-LM's evaluation does.
        self.validation_num_microbatches = micro_batches_per_step(
            m.global_batch_size, m.micro_batch_size, self.dp_size
        )

        with self.attempt.timing("load"), self.hangs.during("load"):
            self.state, self.resumed_path = resume(
                cfg,
                self.checkpoint_dir,
                self.model,
                self.optimizer,
                self.scheduler,
                self.data_in_use,
                self._print,
            )
        self.resumed_from = self.state.iteration
        if self.run_claim is not None:  # rank 0: from here on the run directory is this run's
            self.run_claim.commit()
        set_abandoned_branch_aside(
            self.checkpoint_dir,
            self.resumed_path,
            self.state.iteration,
            cfg.exp_manager.resume_from_checkpoint,
            self.device,
            self._print,
        )
        if note := interrupted_save_note(self.checkpoint_dir, self.resumed_path):
            self._print(note)
        if self.resumed_path is not None:
            self._print(f"resumed from {self.resumed_path} (step {self.state.iteration})")
            changes = changes_since_checkpoint(self.resumed_path, self.config_yaml)
            if changes is not None:
                self._print(changes)
        self.consecutive_skips = 0
        self.manual_gc = ManualGarbageCollection(m.gc_interval)
        self.profiler = StepProfiler(
            profile_window(cfg), dist.get_rank(), self.device, self.run_dir / "profile"
        )

        self.train_batches = micro_batch_loader(
            self.splits.train,
            self.state.consumed_samples,
            m.micro_batch_size,
            self.dp_size,
            self.dp_rank,
            m.data.num_workers,
        )
        self.has_validation = self.splits.valid is not None and t.limit_val_batches > 0
        self.logger = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.exp_manager.create_tensorboard_logger,
            wandb=cfg.exp_manager.create_wandb_logger,
            wandb_kwargs=cfg.exp_manager.wandb_logger_kwargs,
            run_name=cfg.exp_manager.name,
            console_label=self.log_label,
            resume_step=self.state.iteration,
        )
        self.stragglers = StragglerReport.for_run(
            cfg, self.model, self.device, self.logger, self._print
        )
        self.step_log = StepLog(
            self.logger,
            self.attempt,
            self.moe_metrics,
            self.model_config.flops_per_token(),
            t.log_every_n_steps,
            t.max_steps,
            self._print,
        )

    def close(self) -> None:
        """Close the logs, release the run directory, restore the signal handlers
        (idempotent). A checkpoint still being written in the background is abandoned
        (left ``.partial``) unless :meth:`wait_for_checkpoints` ran first on every rank."""
        for part, finish in (
            ("hangs", "close"),  # first: what follows cannot hang on a stalled peer
            ("checkpoints", "close"),
            ("stop_request", "restore"),
            ("manual_gc", "stop"),
            ("profiler", "close"),
            ("moe_metrics", "close"),
            ("logger", "close"),
        ):
            made = getattr(self, part, None)  # None where __init__ failed before making it
            if made is not None:
                getattr(made, finish)()
        if self.run_claim is not None:
            self.run_claim.release()

    def _attempt_ended(self, summary: RunSummary, how: str) -> None:
        """Write ``run_status`` (which tells a launcher, a scheduler's batch script, whether
        to requeue), record how this attempt ended, and print where the run is and its
        goodput so far (rank 0; what ``megatron-lns status`` prints)."""
        if self.is_rank0:
            try:
                write_run_status(self.run_dir, summary.stopped_early, self.state.iteration)
            except BaseException:
                self.attempt.ended("failed")  # else `status` calls the attempt killed
                raise
        self.attempt.ended(how)
        self.stragglers.summary()
        if self.is_rank0:
            try:
                lines = run_report(self.run_dir).lines()
            except (UserError, OSError) as err:
                lines = [f"warning: no goodput report: {err}"]
            for line in lines:
                self._print(line)

    def _print(self, message: str) -> None:
        if self.is_rank0:
            say(f"[{self.log_label}] {message}")

    def validation_microbatches(self) -> Iterator[list[Batch]]:
        """The first ``limit_val_batches`` global batches of the validation split, one
        global batch (this rank's micro-batches) at a time; every call yields the same."""
        return held_out_batches(
            self.splits.valid,
            self.cfg.trainer.limit_val_batches,
            self.cfg.model.micro_batch_size,
            self.validation_num_microbatches,
            self.dp_size,
            self.dp_rank,
        )

    def train_step(self) -> StepResult:
        """One global batch: forward/backward, optimizer step, schedule.

        megatron's num-microbatches calculator sets the batch size from the samples
        consumed so far (it changes only during a batch-size ramp-up). The data position
        always advances; the iteration counter and the LR schedule advance only when the
        optimizer applied the update (an fp16 loss-scale overflow skips it, as in
        Megatron-LM). The LR schedule counts optimizer steps, as NeMo's does, also
        during a ramp-up (docs/configuration.md).
        """
        update_num_microbatches(self.state.consumed_samples, consistency_check=True)
        with self.megatron_timers.timing("batch-generator", log_level=2):
            microbatches = [next(self.train_batches) for _ in range(get_num_microbatches())]
        if self.moe_metrics is not None:
            self.moe_metrics.start_step()  # every step, logged or not
        result = train_step(self.model, self.optimizer, microbatches, self.state.iteration + 1)
        self.state.consumed_samples += result.num_samples
        if not result.update_successful:
            self.consecutive_skips += 1
            if self.consecutive_skips >= MAX_CONSECUTIVE_SKIPPED_STEPS:
                self.wait_for_checkpoints()  # every rank stops here
                raise every_update_skipped(self.consecutive_skips, self.state.iteration)
            return result
        if what := non_finite_step(self.state.iteration + 1, result.loss, result.grad_norm):
            raise self._diverged(what)  # every rank stops here (loss and norm are global)
        self.consecutive_skips = 0
        self.scheduler.step(increment=1)
        self.state.iteration += 1
        return result

    def _diverged(self, what: str) -> TrainingStopped:
        """The error that ends a diverged run (``what``: the non-finite values), raised
        before the step's checkpoint, so that the newest checkpoint a rerun resumes from
        is one taken before the divergence. Call it on every rank: it waits for the
        background saves."""
        self.wait_for_checkpoints()
        return TrainingStopped(
            diverged_message(what, latest_complete_checkpoint(self.checkpoint_dir))
        )

    def evaluate(self) -> float:
        """Token-mean loss over the validation batches; logged at the current step.

        A non-finite loss ends the run as a non-finite training loss does: the weights
        just updated are what it measured, and they must not be checkpointed."""
        for chunk in self.model:
            chunk.eval()
        loss_sum = tokens = 0.0
        with self.megatron_timers.paused(), self.attempt.timing("eval"), self.hangs.during("eval"):
            for batches in self.validation_microbatches():
                result = forward_backward(self.model, batches, forward_only=True)
                loss_sum += result.loss * result.num_tokens
                tokens += result.num_tokens
        for chunk in self.model:
            chunk.train()
        loss = loss_sum / tokens
        self.logger.log(
            self.state.iteration, {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
        )
        if not math.isfinite(loss):  # the same on every rank: the loss is reduced
            raise self._diverged(f"step {self.state.iteration}: validation loss {loss}")
        return loss

    def save(self) -> Path:
        """Checkpoint the current step (all ranks must call it); returns its directory.

        With ``async_save`` the checkpoint is written in the background and counts once
        :meth:`wait_for_checkpoints` (or a later step's poll) has committed it.
        """
        with self.attempt.timing("save"):
            if self.checkpoints.asynchronous:  # the previous save is committed first
                with self.hangs.during("commit"):
                    self.checkpoints.wait()
            with self.hangs.during("save"):
                sync_parameters(self.model)  # with overlap_param_sync the weights lag
                return self.checkpoints.save(
                    self.model, self.optimizer, self.scheduler, self.state, self.config_yaml
                )

    def wait_for_checkpoints(self) -> None:
        """Wait for checkpoints being written in the background and commit them (all
        ranks must call it)."""
        with self.attempt.timing("save"), self.hangs.during("commit"):
            self.checkpoints.wait()

    def fit(self) -> RunSummary:
        """Train to ``trainer.max_steps`` (or until asked to stop), validating, logging and
        checkpointing on the configured intervals."""
        cfg, t = self.cfg, self.cfg.trainer
        summary = RunSummary(cfg.exp_manager.name, self.run_dir, t.max_steps, self.resumed_from)
        self.attempt.began(
            self.state.iteration, self.state.consumed_samples, self.logger.dropped_up_to
        )
        if self.state.iteration >= t.max_steps:
            self._print(
                f"nothing to do: {self.resumed_path} is at step {self.state.iteration} and "
                f"trainer.max_steps is {t.max_steps} (raise it to train further)"
            )
            self.close()
            summary.steps = self.state.iteration
            self._attempt_ended(summary, "finished")
            return summary
        stop = self.stop_request
        every = cfg.exp_manager.checkpoint_callback_params.every_n_train_steps
        throughput = Throughput()
        if self.progress is not None:
            for line in self.progress.resumed(self.state.iteration):
                self._print(f"warning: {line}")
        self.manual_gc.start()
        try:
            while self.state.iteration < t.max_steps:
                # The LR this step uses: the schedule sets the next one after the update.
                lr = self.optimizer.param_groups[0]["lr"]
                start = time.perf_counter()
                self.hangs.step(self.state.iteration + 1)
                with self.profiler.step(self.state.iteration + 1), self.stragglers.step():
                    result = self.train_step()
                # Every rank ends the step here, so a step's time includes waiting for a
                # slower rank: that is training at the slowest rank's pace, not lost time.
                stop_agreed = stop.agreed(self.device)
                seconds = time.perf_counter() - start
                throughput.add(result.num_tokens, seconds)
                self.attempt.step_done(self.state.iteration, seconds, self.state.consumed_samples)
                if self.progress is not None:
                    self.progress.step_done(seconds)
                step, advanced = self.state.iteration, result.update_successful
                with self.attempt.timing("save"):  # commit a save every rank has written
                    self.checkpoints.poll()
                if advanced:
                    self.manual_gc.after_step(step)
                    summary.train_losses.append((step, result.loss))
                    self.step_log.trained(step, result, lr, self.state.consumed_samples, throughput)
                    if self.has_validation and step % t.val_check_interval == 0:
                        summary.valid_loss = self.evaluate()
                else:
                    summary.skipped_steps += 1
                    self.step_log.skipped(step, summary.skipped_steps)
                self.step_log.timers(step, self.megatron_timers.step_done(step, advanced))
                self.stragglers.step_done(step, advanced)
                periodic = advanced and step % every == 0 and step < t.max_steps
                exit_interval = advanced and bool(t.exit_interval) and step % t.exit_interval == 0
                stop_now = (exit_interval and step < t.max_steps) or stop_agreed
                if periodic or stop_now:
                    self.save()
                if stop_now:
                    summary.stopped_early = True
                    break

            if not summary.stopped_early:
                if self.has_validation and self.state.iteration % t.val_check_interval != 0:
                    summary.valid_loss = self.evaluate()
                if cfg.exp_manager.checkpoint_callback_params.save_last:
                    self.save()
            # Before run_status says the run is resumable (or done).
            self.wait_for_checkpoints()
            if summary.stopped_early:
                step = self.state.iteration
                self._print(f"stopping at step {step} (checkpoint saved; rerun to resume)")
        except BaseException:
            self.stragglers.summary()
            self.attempt.ended("failed")
            raise
        finally:
            self.close()
        self._attempt_ended(summary, "stopped" if summary.stopped_early else "finished")
        summary.steps = self.state.iteration
        throughput.close_window()
        summary.tokens_per_second = throughput.overall
        summary.tflops_per_device = self.step_log.tflops_per_device(summary.tokens_per_second)
        return summary
