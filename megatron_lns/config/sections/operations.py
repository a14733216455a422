"""Keys of ``model`` that run the job rather than shape the model: garbage collection,
profiling, parallel checkpoint I/O and megatron-core's timers."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lns.config.rules import (
    global_ranks,
    non_negative,
    one_of,
    positive,
)
from megatron_lns.config.settings import listed_in, setting

# megatron.core.timers.Timers' log_option: the maximum over ranks, the minimum and maximum,
# or every rank's time.
TIMER_LOG_OPTIONS = ("max", "minmax", "all")


@listed_in("operations")
@dataclass
class NsysProfileConfig:
    """A profiling window over training steps (``training/profiling.py``)."""

    enabled: bool = setting(False)
    """profile the window below (`training/profiling.py`). On CUDA:
    `torch.cuda.profiler.start()`/`stop()` around the window, for `nsys profile
    --capture-range=cudaProfilerApi --capture-range-end=stop`, an NVTX range `step N` per step and,
    via `torch.autograd.profiler.emit_nvtx`, one per operator. A PyTorch profiler trace (Chrome
    trace format; Perfetto or chrome://tracing) goes to
    `<run_dir>/profile/rank<R>_steps<A>-<B>.json`, see `torch_trace`"""

    start_step: int = setting(10, positive)
    """first profiled step, numbered as the log numbers steps (the first step is 1; NeMo counts
    completed steps, so its 10 is step 11 here). A run resumed inside the window profiles the rest
    of it; one stopped inside it writes what it profiled"""

    end_step: int = setting(10, positive)
    """last profiled step (inclusive); refused if before `start_step`, and a `start_step` after
    `trainer.max_steps` is refused"""

    ranks: list[int] = setting(check=global_ranks, default_factory=lambda: [0])
    """global ranks that profile; refused if not ranks of the run"""

    gen_shape: bool = setting(False)
    """record operator input shapes (`record_shapes` of the NVTX ranges and of the torch trace)"""

    torch_trace: bool | None = setting(None)
    """not in NeMo: write the torch profiler trace (CPU and CUDA activity on a GPU). null: on CPU
    yes, on CUDA no (nsys records the window). The autograd profiler records one way at a time, so
    with a torch trace on CUDA the per-operator NVTX ranges are left out (the step ranges and the
    capture window stay)"""


@listed_in("operations")
@dataclass
class MegatronTimerKwargs:
    """How megatron-core's own timers are reported (``training/timers.py``)."""

    log_every_n_steps: int | None = setting(None, positive)
    """report after every N-th applied update (step numbers, so a resumed run keeps the grid); null:
    `trainer.log_every_n_steps`. An interval longer than `trainer.max_steps` is refused (no report
    would be made)"""

    log_mode: str | None = setting(None, one_of(TIMER_LOG_OPTIONS))
    """megatron's `log_option`: `minmax` (the fastest and slowest rank), `max`, or `all` (every
    rank); null: `minmax`. NeMo's YAML spells the key `log_mode` while NeMo's code reads
    `log_option`: either key sets it, and the two set differently are refused"""

    log_option: str | None = setting(None, one_of(TIMER_LOG_OPTIONS))
    """the same setting as `log_mode`"""

    barrier: bool = setting(False)
    """a barrier across all ranks before the times are read (megatron's
    `get_all_timers_string(barrier=...)`)"""


@listed_in("operations")
@dataclass
class OperationsSettings:
    """``model``'s operations keys (the ``operations`` table)."""

    gc_interval: int = setting(0, non_negative)
    """Megatron-LM's manual garbage collection (`--manual-gc --manual-gc-interval`): with N > 0
    Python's automatic collector is off for the run and every rank runs `gc.collect()` after every
    N-th step (step numbers, so a resumed run keeps the grid), so that no rank stalls the others at
    a collective by collecting on its own; 0 leaves Python's automatic collection on"""

    nsys_profile: NsysProfileConfig = field(default_factory=NsysProfileConfig)
    dist_ckpt_parallel_save: bool = setting(
        False, target="dist_checkpointing.FullyParallelSaveStrategyWrapper"
    )
    """megatron-core's `FullyParallelSaveStrategyWrapper` over the data-parallel group
    (Megatron-LM's `--ckpt-fully-parallel-save`): the shards every data-parallel rank holds a copy
    of (weights; optimizer state without the distributed optimizer) are written by all of them, each
    a share, instead of all by the first; the checkpoint holds the same tensors and loads at any
    layout"""

    dist_ckpt_parallel_load: bool = setting(
        False, target="dist_checkpointing.FullyParallelLoadStrategyWrapper"
    )
    """megatron-core's `FullyParallelLoadStrategyWrapper` over the data-parallel group
    (Megatron-LM's `--ckpt-fully-parallel-load`): each data-parallel rank reads a share of the
    replicated shards and they exchange the rest (more communication, less storage traffic); the
    loaded state is the same"""

    enable_megatron_timers: bool = setting(False, target="timers.Timers")
    """megatron-core's own timers (`megatron.core.timers.Timers` at log level 2, as NeMo builds
    them, set as the model config's and optimizer config's `timers`): the pipeline schedule
    (`forward-backward`, `forward-compute`, `backward-compute`), pipeline send and receive
    (`forward-recv`, `backward-send`, `forward-send-backward-recv`, ...), `finalize_model_grads`
    (`all-grads-sync`, `embedding-grads-all-reduce`, ...), the optimizer (`optimizer-inner-step`,
    `optimizer-clip-main-grad`, ...; `params-all-gather` with the distributed optimizer), and
    Megatron-LM's `optimizer` (the whole `optimizer.step()`) and `batch-generator` (reading the
    step's micro-batches). Validation is not timed. megatron-core's `barrier_with_L1_time` stays at
    its default (true): the level-1 timers start with a barrier across ranks, as in Megatron-LM"""

    megatron_timer_kwargs: MegatronTimerKwargs = field(default_factory=MegatronTimerKwargs)
