"""torch.distributed's environment (RANK, WORLD_SIZE, ...) from SLURM's, for one srun task.

Pure Python on purpose: compute nodes running the job in a container often have no
``scontrol`` to expand a compressed node list, so :func:`expand_nodelist` does it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from megatron_lns.base.errors import UserError
from megatron_lns.runtime.fault_injection import ATTEMPT_ENV

# MASTER_PORT = base + job id modulo span: below Linux's ephemeral range (32768+), so
# no outgoing connection holds it, and different jobs sharing a first node differ.
PORT_BASE = 10000
PORT_SPAN = 20000
# Each in-job restart of a job rendezvouses on another port (a prime stride apart), so the
# store socket of the attempt before, killed with its rank 0, can never be in the way.
ATTEMPT_PORT_STRIDE = 7919


class SlurmEnvironmentError(UserError, RuntimeError):
    """The process does not have the variables of an srun task."""


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    parts.append(text[start:])
    return parts


def _expand_range(body: str, nodelist: str) -> list[str]:
    """The inside of one bracket: "001-003,7" -> ["001", "002", "003", "7"]."""
    values = []
    for item in body.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {item!r} in node list {nodelist!r}")
        if not sep:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"descending range {item!r} in node list {nodelist!r}")
        width = len(low)  # SLURM keeps the zero padding of the lower bound
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list in order: "gpu[001-002],cpu[1,3-4]" ->
    ["gpu001", "gpu002", "cpu1", "cpu3", "cpu4"]. Several brackets in one name
    ("r[1-2]n[1-2]") expand as SLURM does, the last one fastest."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        if not part:
            raise ValueError(f"empty host name in node list {nodelist!r}")
        pieces = re.split(r"\[([^\[\]]*)\]", part)
        if any("[" in p or "]" in p for p in pieces[0::2]):
            raise ValueError(f"nested or unbalanced brackets in node list {nodelist!r}")
        choices = [
            [piece] if i % 2 == 0 else _expand_range(piece, nodelist)
            for i, piece in enumerate(pieces)
        ]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def master_port(job_id: int, attempt: int = 0) -> int:
    """The rendezvous port of a job's in-job ``attempt``: the same on every node and
    across the job's requeues."""
    return PORT_BASE + (job_id + attempt * ATTEMPT_PORT_STRIDE) % PORT_SPAN


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    if not value:
        raise SlurmEnvironmentError(
            f"{name} is not set: megatron_lns.launch.task must run as an srun task "
            "inside a SLURM job"
        )
    return value


def rank_environment(env: Mapping[str, str]) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for this srun task.

    Rank 0 is task 0, which SLURM places on the first node of the step, so the first
    host of SLURM_STEP_NODELIST is where rank 0's TCP store listens. That is the first
    node of the allocation (SLURM_JOB_NODELIST, for a task started without a step's
    variables) unless the step leaves nodes out: spare nodes, or nodes that failed.
    """
    source = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    nodelist = _required(env, source)
    try:
        first_host = expand_nodelist(nodelist)[0]
    except ValueError as err:
        raise SlurmEnvironmentError(f"{source}: {err}") from None
    values = {
        "RANK": _required(env, "SLURM_PROCID"),
        "WORLD_SIZE": _required(env, "SLURM_NTASKS"),
        "LOCAL_RANK": _required(env, "SLURM_LOCALID"),
    }
    job_id = _required(env, "SLURM_JOB_ID")
    # The batch script's in-job restart number (0 without one: srun by hand).
    attempt = env.get(ATTEMPT_ENV, "0").strip()
    for name, value in [*values.items(), ("SLURM_JOB_ID", job_id), (ATTEMPT_ENV, attempt)]:
        if not value.isdigit():
            raise SlurmEnvironmentError(f"{name}={value!r} is not a number")
    return {
        **values,
        "MASTER_ADDR": first_host,
        "MASTER_PORT": str(master_port(int(job_id), int(attempt))),
    }
