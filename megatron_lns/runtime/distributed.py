"""Process groups and megatron's model-parallel state, on CPU (gloo) or CUDA (nccl).

Works the same for every process that finds the torchrun variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) in its environment:
started by ``torchrun``, by ``local_ranks.spawn_local`` for tests and the CPU demo, or by any
launcher that sets them. A process without them is a world of one, made in-process
without writing them: only launchers set them.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from megatron_lns.config.layout import ParallelLayout
from megatron_lns.runtime.cpu import install_cpu_compat
from megatron_lns.runtime.launcher_env import launcher_environment
from megatron_lns.runtime.rendezvous import DEFAULT_TIMEOUT_S as DEFAULT_RENDEZVOUS_TIMEOUT_S
from megatron_lns.runtime.rendezvous import rendezvous_store

Device = Literal["auto", "cpu", "cuda"]
# trainer.distributed_timeout_minutes' default.
DEFAULT_COLLECTIVE_TIMEOUT_MINUTES = 10.0


def resolve_device(device: Device = "auto") -> torch.device:
    """Pick the compute device; on CPU, install megatron's CPU compatibility layer."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but CUDA is not available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    install_cpu_compat()
    return torch.device("cpu")


def init_distributed(
    layout: ParallelLayout = ParallelLayout(),
    device: Device = "auto",
    seed: int = 1234,
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
    collective_timeout_minutes: float = DEFAULT_COLLECTIVE_TIMEOUT_MINUTES,
) -> torch.device:
    """Create the default process group and megatron's parallel state, and seed RNGs.

    The ranks meet within ``rendezvous_timeout_s`` or the process ends with a
    :class:`~megatron_lns.runtime.rendezvous.RendezvousError` (see that module). A
    collective of any group that waits longer than ``collective_timeout_minutes``
    (``trainer.distributed_timeout_minutes``) raises (torch's default: 30 minutes)."""
    from megatron.core import parallel_state, tensor_parallel

    launcher_environment()  # refuses a partial or inconsistent one before LOCAL_RANK is used
    dev = resolve_device(device)
    if not dist.is_initialized():
        launch = launcher_environment()
        if launch is None:  # a world of one in this process: nobody to meet, no address
            # Given to torch, not written into os.environ: every subprocess started later
            # would inherit RANK and MASTER_PORT and try to join this world.
            store, rank, world_size = dist.HashStore(), 0, 1
        else:
            store = rendezvous_store(launch, rendezvous_timeout_s)
            rank, world_size = launch.rank, launch.world_size
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            store=dist.PrefixStore("default_pg", store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=collective_timeout_minutes),
        )
    layout.data_parallel(dist.get_world_size())
    if layout.sharp and dev.type != "cuda":
        raise ValueError("SHARP needs NCCL on CUDA GPUs; this run uses gloo")
    _destroy_subgroups()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        **layout.megatron_sizes(),
        use_sharp=layout.sharp,
        distributed_timeout_minutes=collective_timeout_minutes,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dev


def _destroy_subgroups() -> None:
    """Destroy the process groups an earlier ``init_distributed`` made in this process.

    megatron's ``destroy_model_parallel`` only forgets its groups: torch keeps them
    registered and alive, each gloo group with its own threads and sockets, so every
    re-initialisation (a test trying layout after layout in one process) added dozens
    of groups whose threads slowed everything after them.
    """
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):
        if group is not distributed_c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


def uses_gloo() -> bool:
    """Whether the default process group is gloo (the CPU backend).

    megatron's batched p2p (``batch_p2p_comm=True``) posts sends and receives to the
    same peer with one tag in an order NCCL groups correctly but gloo matches FIFO;
    with PP=2 and a virtual pipeline, forward activations and backward gradients
    travel between the same two ranks in one batch and gloo can swap them (both have
    the same shape, so nothing fails: the loss is silently wrong). megatron's
    unbatched path orders sends and receives by rank parity and is correct on gloo.
    """
    return dist.is_initialized() and dist.get_backend() == "gloo"


def destroy_distributed() -> None:
    """Destroy megatron's groups and the default process group, where they exist (a rank
    that failed before initializing them does not import megatron-core here)."""
    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now, for the rank-0 store of
    local ranks. Drawn below the kernel's ephemeral range: a port from that range (what
    binding to port 0 gives) can be taken by any process's outgoing connection before rank
    0 listens on it, which ended ranks with EADDRINUSE while other jobs shared the machine."""
    floor = _ephemeral_port_floor()
    draw = random.SystemRandom()  # not the seeded global generator, which forks share
    for _ in range(100):
        port = draw.randrange(max(1024, floor - 16384), floor)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_port_floor(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux; 32768, its
    default, where the file cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
