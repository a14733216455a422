"""``exp_manager.fault_tolerance`` and ``exp_manager.straggler_detection_params``: how a
run watches itself for hung ranks and slow ranks, and how often it restarts in-job.

The names follow NeMo's ``exp_manager`` (``create_fault_tolerance_callback``,
``fault_tolerance.*``, ``create_straggler_detection_callback``) where the meaning is the
same; NeMo hands them to nvidia-resiliency-ext, megatron-lns to its own watchdog
(docs/resilience.md says why). Unlike NeMo, both are on by default, as in
Megatron-Bridge's recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lns.config.rules import non_negative, positive, safety_multiple
from megatron_lns.config.settings import setting


@dataclass
class FaultToleranceParams:
    initial_rank_heartbeat_timeout: float = setting(600.0, positive)
    """seconds a rank may spend starting (process group, data, model, checkpoint load) before the
    run is declared hung (Megatron-LM's integration uses 600 for its setup section)"""

    rank_heartbeat_timeout: float = setting(180.0, positive)
    """seconds a training step or an evaluation may take before the run is declared hung, until this
    attempt has measured one; with `calculate_timeouts` also the cap of the learnt timeout"""

    checkpoint_save_timeout: float = setting(420.0, positive)
    """not in NeMo: the same for a checkpoint save (its own phase: a stalled filesystem hangs
    there); Megatron-LM's integration uses 420"""

    calculate_timeouts: bool = setting(True)
    """learn each phase's timeout from this attempt: `safety_factor` x the slowest step, evaluation
    or save seen so far, at least `min_timeout` and at most the phase's timeout above; false keeps
    the configured ones"""

    safety_factor: float = setting(5.0, safety_multiple)
    """a learnt timeout is this multiple of the slowest time seen (at least 1)"""

    min_timeout: float = setting(30.0, positive)
    """not in NeMo: the least a learnt timeout may be, in seconds; with `calculate_timeouts` it may
    not exceed `rank_heartbeat_timeout` nor `checkpoint_save_timeout` (their caps)"""

    workload_check_interval: float = setting(1.0, positive)
    """seconds between two heartbeats of a rank's watchdog (each one also checks the phase's
    timeout): detection takes the timeout plus up to 4 of these (at least 1 s more)"""

    max_rank_restarts: int = setting(3, non_negative)
    """in-job restarts after a rank died or hung: every rank restarts in the same allocation from
    the newest complete checkpoint; 0 ends the attempt (a SLURM job then ends FAILED, not
    requeued)"""

    max_restarts_without_progress: int = setting(2, positive)
    """not in NeMo: restarts in a row after which no newer checkpoint was committed end the job with
    that cause, restarts left or not"""


@dataclass
class StragglerDetectionParams:
    report_every_n_steps: int = setting(50, positive)
    """not NeMo's time interval: every N steps the ranks share their compute time per step (one
    small collective)"""

    slower_than_median: float = setting(0.2, non_negative)
    """a rank whose compute time per step exceeds the median rank's by more than this fraction is
    named a straggler, with its host"""
