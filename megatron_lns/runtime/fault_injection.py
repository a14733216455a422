"""Faults injected on purpose, for the tests and benchmarks of the run's self-healing.

``MEGATRON_LNS_INJECT_FAULT`` names the faults, ``;``-separated, each as comma-separated
``key=value`` pairs::

    MEGATRON_LNS_INJECT_FAULT="kind=stop,rank=1,step=5;kind=slow,rank=0,step=1,seconds=0.5"

- ``kind``: ``stop`` (the rank SIGSTOPs itself: a frozen process, as a host stalled in the
  kernel), ``crash`` (it SIGKILLs itself), ``hang`` (its main thread sleeps for ever while the
  process stays alive, as a rank stuck in a stalled filesystem call) or ``slow`` (it sleeps
  ``seconds`` in every step from ``step`` on, or up to ``until``: a straggler, a slow start);
- ``rank``: the global rank it hits; ``step``: the training step (1-based) it hits;
- ``phase``: where: ``step`` (default; between the forward-backward and the optimizer
  update, so the other ranks wait in a collective) or ``save`` (while the checkpoint of
  ``step`` is written, before it is committed);
- ``until``: the last step a ``slow`` fault hits (default: none, it never ends);
- ``attempt``: the in-job restart it hits (``MEGATRON_LNS_ATTEMPT``, default 0), so that a
  restarted run recomputing ``step`` is not hit again.

Nothing in the package sets the variable: a run without it takes one dictionary lookup per
phase. The code under test is never edited to inject a fault.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from megatron_lns.base.errors import UserError

FAULT_ENV = "MEGATRON_LNS_INJECT_FAULT"
# The in-job restart this process belongs to (0: the first start), set by the launcher.
ATTEMPT_ENV = "MEGATRON_LNS_ATTEMPT"
KINDS = ("stop", "crash", "hang", "slow")
PHASES = ("step", "save")


class FaultSpecError(UserError, ValueError):
    """``MEGATRON_LNS_INJECT_FAULT`` names a fault this module cannot read."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    phase: str = "step"
    attempt: int = 0
    seconds: float = 0.0
    until: int | None = None

    def hits(self, rank: int, step: int, phase: str, attempt: int) -> bool:
        if (self.rank, self.phase, self.attempt) != (rank, phase, attempt):
            return False
        if self.kind != "slow":
            return step == self.step
        return self.step <= step and (self.until is None or step <= self.until)


def parse_faults(text: str) -> tuple[Fault, ...]:
    """The faults ``text`` names (the module doc's format); FaultSpecError names a bad one."""
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(";"))):
        fields = dict(pair.split("=", 1) for pair in spec.split(",") if "=" in pair)
        try:
            fault = Fault(
                kind=fields.pop("kind"),
                rank=int(fields.pop("rank")),
                step=int(fields.pop("step")),
                phase=fields.pop("phase", "step"),
                attempt=int(fields.pop("attempt", 0)),
                seconds=float(fields.pop("seconds", 0.0)),
                until=int(fields["until"]) if "until" in fields else None,
            )
            fields.pop("until", None)
        except (KeyError, ValueError) as err:
            raise FaultSpecError(f"{FAULT_ENV}: cannot read {spec!r} ({err})") from None
        if fields or fault.kind not in KINDS or fault.phase not in PHASES:
            raise FaultSpecError(
                f"{FAULT_ENV}: {spec!r}: kind is one of {KINDS}, phase one of {PHASES}, "
                "and the keys are kind, rank, step, phase, attempt, seconds, until"
            )
        faults.append(fault)
    return tuple(faults)


@cache
def _faults() -> tuple[Fault, ...]:
    return parse_faults(os.environ.get(FAULT_ENV, ""))


def attempt(env: Mapping[str, str] = os.environ) -> int:
    """The in-job restart this process belongs to (0: the job's first start, or a value
    no launcher of ours wrote: SLURM tasks refuse one in ``rank_env``)."""
    value = env.get(ATTEMPT_ENV, "0").strip()
    return int(value) if value.isdigit() else 0


def inject_fault(phase: str, step: int) -> None:
    """Do what ``MEGATRON_LNS_INJECT_FAULT`` asks of this rank at ``phase`` of ``step``."""
    if not os.environ.get(FAULT_ENV):
        return
    rank = int(os.environ.get("RANK", "0"))
    for fault in _faults():
        if not fault.hits(rank, step, phase, attempt()):
            continue
        print(f"fault injection: {fault.kind} on rank {rank} at {phase} {step}", flush=True)
        if fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            while True:
                time.sleep(3600)
        else:
            time.sleep(fault.seconds)
