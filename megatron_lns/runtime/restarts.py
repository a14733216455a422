"""In-job restart of a local multi-process run: a dead or hung rank costs a restart from
the newest complete checkpoint, not the run.

:func:`spawn_with_restarts` wraps :func:`~megatron_lns.runtime.local_ranks.spawn_local`,
which is left as it is (one launch, a failure raised) for the callers that want no
restart: ``compare`` and the tests. When a rank of an attempt ends with an exit that
:func:`~megatron_lns.base.errors.restartable_exit` accepts (a crash, a kill, the
watchdog's hang exit), every rank of the attempt is already stopped and reaped by
``spawn_local`` (SIGKILL reaches a stopped rank too, and each rank's process group is
killed with it), and all of them start again: a fresh rendezvous port, and
``MEGATRON_LNS_ATTEMPT=n`` in their environment, from which the trainer's records tell
the attempts apart (``training/goodput.py``) and fault injection picks its attempt. The
ranks resume from the newest complete checkpoint as any rerun does.

Never restarted: a success, an input error (exit 2: a restart would repeat it), and any
failure after the user's stop signal (Ctrl-C, SIGTERM: the ranks were asked to end).
The restarts end the run, with one line naming the failure, when
``max_rank_restarts`` are used up or when ``max_restarts_without_progress`` restarts in a
row committed no newer checkpoint: a failure that recurs at the same place would
otherwise be retried for the whole allocation. When one failure reaches both limits, the
line names the second, as the batch script does (``slurm/sbatch.template``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_lns.base.errors import HUNG_EXIT_CODE, RankFailed, rank_ended, restartable_exit
from megatron_lns.runtime.fault_injection import ATTEMPT_ENV
from megatron_lns.runtime.local_ranks import spawn_local, stop_signals_recorded

# The exit code torch's rank wrapper gives a rank whose function raised.
_RAISED_EXIT_CODE = 1


@dataclass(frozen=True)
class RestartPolicy:
    """How often the ranks of a run restart in-job (``exp_manager.fault_tolerance``)."""

    max_rank_restarts: int
    max_restarts_without_progress: int
    # The step of the run's newest complete checkpoint (0: none): progress between restarts.
    newest_checkpoint_step: Callable[[], int]


@dataclass(frozen=True)
class _Failure:
    """How the first rank of an attempt to fail ended."""

    rank: int
    exit_code: int  # negative: killed by that signal
    raised: bool = False  # its function raised (the traceback has been printed)

    def __str__(self) -> str:
        """``rank 1 was killed by SIGKILL``, ``rank 0 found the run hung (exit code 75)``."""
        if self.exit_code == HUNG_EXIT_CODE:
            return f"rank {self.rank} found the run hung (exit code {self.exit_code})"
        return rank_ended(self.rank, self.exit_code, self.raised)


class RestartsEnded(RankFailed):
    """A rank failed and the policy allows no further in-job restart; the message names
    the failure and why, in one line."""

    explained = True

    def __init__(self, failure: _Failure, why: str) -> None:
        super().__init__(failure.rank, failure.exit_code)
        self.args = (f"{failure}; {why}",)


def _checkpoint_name(step: int) -> str:
    return f"the checkpoint of step {step}" if step else "the start (no checkpoint yet)"


def spawn_with_restarts(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    policy: RestartPolicy,
    restart_args: tuple | None = None,
) -> None:
    """Run ``fn(*args)`` on ``world_size`` local ranks as ``spawn_local`` does, restarting
    every rank in-job as ``policy`` allows (module doc); restarts call ``fn(*restart_args)``
    where given (a restart always resumes, whatever the first start was told)."""
    # One record of the user's stops for every attempt, and between them: a stop after a
    # failure starts no further attempt (spawn_local refuses to start ranks after one).
    stop_signals: list[int] = []
    with stop_signals_recorded(stop_signals):
        _attempts(fn, world_size, args, policy, restart_args, stop_signals)


def _attempts(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    policy: RestartPolicy,
    restart_args: tuple | None,
    stop_signals: list[int],
) -> None:
    import torch.multiprocessing as mp

    restarts = without_progress = 0
    while True:
        newest_before = policy.newest_checkpoint_step()
        environment = {ATTEMPT_ENV: str(restarts)}
        attempt_args = args if restarts == 0 or restart_args is None else restart_args
        try:
            spawn_local(
                fn, world_size, *attempt_args, environment=environment, stop_signals=stop_signals
            )
            return
        except mp.ProcessRaisedException as err:
            if stop_signals:
                raise
            print(str(err).strip(), file=sys.stderr, flush=True)  # the rank's traceback
            failure = _Failure(err.error_index, _RAISED_EXIT_CODE, raised=True)
        except RankFailed as err:
            if stop_signals or not restartable_exit(err.exit_code):
                raise
            failure = _Failure(err.rank, err.exit_code)
        failed_at = time.time()
        newest = policy.newest_checkpoint_step()
        without_progress = 0 if newest > newest_before else without_progress + (restarts > 0)
        if without_progress >= policy.max_restarts_without_progress:
            raise RestartsEnded(
                failure,
                f"the last {without_progress} in-job restart(s) committed no checkpoint"
                f"{f' newer than the one of step {newest}' if newest else ''} "
                f"(exp_manager.fault_tolerance."
                f"max_restarts_without_progress={policy.max_restarts_without_progress}): "
                "the failure recurs; stopping",
            ) from None
        if restarts >= policy.max_rank_restarts:
            raise RestartsEnded(
                failure,
                f"restarted {restarts} time(s) in-job (exp_manager.fault_tolerance."
                f"max_rank_restarts={policy.max_rank_restarts}); a rerun resumes from "
                f"{_checkpoint_name(newest)}",
            ) from None
        restarts += 1
        print(
            f"in-job restart {restarts} of {policy.max_rank_restarts}: "
            f"{failure} at {time.strftime('%H:%M:%S', time.localtime(failed_at))}"
            f"; every rank restarts (attempt {restarts}) from {_checkpoint_name(newest)}",
            file=sys.stderr,
            flush=True,
        )
