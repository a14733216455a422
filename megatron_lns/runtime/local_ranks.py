"""Start and supervise the ranks of a multi-process run on this machine.

:func:`spawn_local` is what ``megatron-lns train`` uses for ``trainer.devices > 1``
without torchrun, and what the tests use. The launcher owns its ranks:

* a stop signal (SIGTERM, SIGINT, SIGUSR1) sent to the launcher is forwarded to every
  rank once, and the ranks checkpoint and exit at the next step boundary as a single
  process does; a second SIGTERM or SIGINT kills them. The launcher takes them from
  before its first rank starts: a stop before any rank exists starts none, one while
  they start reaches each of them, and a rank it ends before the rank could stop at a
  step ends the launch with one line (:class:`RanksStopped`);
* each rank runs in its own process group, so a terminal's Ctrl-C reaches only the
  launcher (which forwards it once), and is asked to stop (SIGTERM) if the launcher
  dies, so no rank is ever left behind. A rank stopped (SIGSTOP) when a stop is
  forwarded is continued, as a shell's ``kill`` continues a stopped job, so that it can
  act on it;
* the launcher's Ctrl-Z stops the run as a whole and ``fg`` (any SIGCONT) continues it
  (:func:`job_stops_shared`), which the ranks' hang watchdogs take for a pause;
* when a rank fails, the others are stopped within seconds and its error is raised
  here: a user error (exit code 2) has already been reported once by the rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megatron_lns.base.disk import as_user_error
from megatron_lns.base.errors import (
    REPORT_MARKER_ENV,
    USER_ERROR_EXIT_CODE,
    RankFailed,
    RanksStopped,
    UserError,
    debug_enabled,
    report_user_error_once,
)
from megatron_lns.base.parent_death import end_with_process, own_pidfd
from megatron_lns.base.signal_handlers import handled
from megatron_lns.config.layout import world_size
from megatron_lns.runtime.distributed import destroy_distributed, free_port
from megatron_lns.runtime.early_stops import take_early_stops
from megatron_lns.runtime.job import STOP_SIGNALS  # what the ranks stop on is what is forwarded
from megatron_lns.runtime.launcher_env import launcher_environment

# Seconds the other ranks get to exit on their own after one failed, then again after
# SIGTERM, before SIGKILL: a rank blocked in a collective with a dead peer never returns.
FAILURE_GRACE_SECONDS = 2.0


def _share_cpu_threads(world_size: int) -> None:
    """Split torch's intra-op threads among the local ranks (torchrun gives each one).

    Each process would otherwise start one thread per core, so ``world_size`` ranks
    run ``world_size`` times as many busy threads as there are cores, and spinning
    OpenMP workers of one rank take the cores that the others' collectives wait on
    (on 2 cores, 2 ranks ran their work twice as slowly). An explicit
    ``OMP_NUM_THREADS`` wins.
    """
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))


class _LauncherFd:
    """One of the launcher's file descriptors, arriving in a rank as the same open file.

    A forkserver's child inherits the server's stdout and stderr, which are the
    launcher's as they were when the server started; a rank must write where the
    launcher writes now (a redirected log, a test's capture).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_detach_fd, (reduction.DupFd(self.fd),))


def _detach_fd(duplicate: Any) -> int:
    return duplicate.detach()


def _rank_entry(
    rank: int,
    world_size: int,
    port: int,
    environment: dict[str, str],
    output: tuple[int, int],
    launcher: int | None,
    fn: Callable,
    args: tuple,
) -> None:
    # The launcher's environment and output as they are now (see _LauncherFd).
    os.environ.clear()
    os.environ.update(environment)
    for fd, launchers in zip((1, 2), output, strict=True):
        if launchers != fd:
            os.dup2(launchers, fd)
            os.close(launchers)
    os.setpgrp()
    # Asked to stop when the launcher ends, however it ends: with the forkserver, the
    # parent of this process is the server, which outlives the launcher.
    end_with_process(launcher, signal.SIGTERM)
    _share_cpu_threads(world_size)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        fn(*args)
    except (UserError, OSError) as err:
        user_error = as_user_error(err)  # OSError: a full disk that no writer reported
        if user_error is None or debug_enabled():
            raise
        report_user_error_once(user_error)
        sys.exit(USER_ERROR_EXIT_CODE)
    finally:
        destroy_distributed()


@contextlib.contextmanager
def stop_signals_recorded(received: list[int]) -> Iterator[None]:
    """While inside, a stop signal to this process is appended to ``received`` instead of
    ending it: from before the first rank starts until the last one is reaped, so that a
    stop at any moment of a launch (the forkserver starting, the ranks forking, between
    two in-job attempts) ends it cleanly. :func:`spawn_local` forwards them."""

    def record(signum: int, frame: Any) -> None:
        received.append(signum)

    with handled(STOP_SIGNALS, record):
        received.extend(take_early_stops())  # sent while the command started (early_stops.py)
        yield


def _forward(processes: list, received: list[int], sent: int) -> int:
    """Send the ranks the stop signals received since the first ``sent`` (module doc):
    the first one, and SIGUSR1, as they came, then SIGCONT to each rank's group (a
    stopped rank would take the stop only once continued, and the launch would wait for
    it); a second SIGTERM or SIGINT as SIGKILL. Runs in the launcher's loop, never in the
    signal handler, so that none is sent twice. Returns how many are sent."""
    for signum in received[sent:]:
        first_stop = sent == 0 or signum == signal.SIGUSR1
        sent += 1
        for process in processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    if first_stop:
                        os.kill(process.pid, signum)
                        _signal_rank(process.pid, signal.SIGCONT)
                    else:
                        process.kill()
    return sent


def _signal_rank(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group of rank ``pid``: the rank and whatever it
    started (dataloader workers, a save's writer). A rank that has not made its group yet
    (it does so first thing) has started nothing, and gets it alone."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
    except PermissionError:
        pass  # not the rank's group any more: its id is another user's process's now


# The signals by which a terminal stops a job: Ctrl-Z (SIGTSTP) to the foreground job,
# SIGTTIN and SIGTTOU to a background job that reads it, or writes to it under `stty tostop`.
JOB_STOP_SIGNALS = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


# Waits for the end of its stdin, which only the launcher writes, then continues the
# process groups and processes it is given.
_CONTINUE_ONCE_CLOSED = 'read -r _; kill -s CONT -- "$@"'


def _continued_when_done(ranks: list[int]) -> subprocess.Popen | None:
    """A process that continues the ranks and their groups once this process is
    continued (it then closes the watcher's stdin) or has ended, however it ended (the
    kernel closes it then).

    In a session of its own, so that nothing sent to the launcher's job (a terminal's
    SIGHUP, ``kill -9 %1``) ends it first. None if it cannot start (the stop goes on: only
    a launcher that ended while stopped would then leave its ranks stopped)."""
    targets = [target for pid in ranks for target in (f"-{pid}", str(pid))]
    try:
        return subprocess.Popen(
            ["/bin/sh", "-c", _CONTINUE_ONCE_CLOSED, "sh", *targets],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        return None


@contextlib.contextmanager
def job_stops_shared(ranks: list[int]) -> Iterator[None]:
    """While inside, a job-control stop of this process (:data:`JOB_STOP_SIGNALS`) stops
    the ranks whose pids are in ``ranks`` with it, and they continue when it does.

    Each rank has a process group of its own (module doc), so the terminal's signal,
    which goes to the launcher's group, would stop the launcher alone and leave the ranks
    training unattended. The handler stops every rank's group (SIGSTOP), then this
    process, with SIGSTOP rather than the default action of the signal it got: that does
    nothing to a process whose group is orphaned (a launcher in a session of its own:
    ``setsid``, a test), which would leave the ranks stopped under a launcher that runs
    on. (So a shell says the run was "Stopped (signal)".) The SIGCONT that continues
    this process (``fg``, ``bg``, ``kill -CONT``, a shell's ``kill`` of the stopped job)
    returns from that SIGSTOP, and the handler continues the ranks; a stop request that
    came meanwhile is forwarded to running ranks. The ranks, all stopped together, take
    the time for a pause, not a hang (``training/phase_timeouts.py``).

    A launcher that ends while stopped (SIGKILL) cannot continue its ranks, and a stopped
    rank never acts on its launcher's end, so a small watcher started with the stop
    continues them once the launcher is continued or gone (:func:`_continued_when_done`).
    """

    def stop_with_the_ranks(signum: int, frame: Any) -> None:
        stopped = list(ranks)
        watcher = _continued_when_done(stopped) if stopped else None
        for pid in stopped:
            _signal_rank(pid, signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        for pid in stopped:
            _signal_rank(pid, signal.SIGCONT)
        if watcher is not None:
            watcher.stdin.close()  # its cue: it continues them too, and ends
            watcher.wait()

    with handled(JOB_STOP_SIGNALS, stop_with_the_ranks):
        yield


# Seconds between two looks of the launcher for a stop signal to forward.
FORWARD_EVERY_S = 0.1


def spawn_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float | None = None,
    environment: dict[str, str] | None = None,
    stop_signals: list[int] | None = None,
) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes on this machine.

    Each process gets the torchrun environment (RANK, WORLD_SIZE, MASTER_*; a free port
    at each call), so ``fn`` calls ``init_distributed`` exactly as it would under
    torchrun or SLURM, plus ``environment``. A rank's failure raises :class:`RankFailed`
    (after a user error, which the rank reported) or torch's ``ProcessRaisedException``
    with the rank's traceback (a bug); either way no rank, nor any process a rank
    started, is left. With ``timeout_s`` (tests), ranks still running after it are
    killed and :class:`RanksTimedOut` is raised: ranks that disagree on a collective
    wait forever. ``stop_signals`` collects the stop signals forwarded to the ranks (a
    failure after one is the user's doing, not the run's).
    """
    import torch.multiprocessing as mp

    received = [] if stop_signals is None else stop_signals
    ranks: list[int] = []  # their pids, once started: what a Ctrl-Z stops with the launcher
    with (
        stop_signals_recorded(received),
        job_stops_shared(ranks),
        tempfile.TemporaryDirectory(prefix="megatron-lns-launch-") as scratch,
    ):
        if received:  # a stop before any rank exists: none starts
            raise RanksStopped(received)
        environment = {
            **os.environ,
            **(environment or {}),
            REPORT_MARKER_ENV: str(Path(scratch) / "error-reported"),
        }
        output = (_LauncherFd(1), _LauncherFd(2))
        pidfd = own_pidfd()
        try:
            launcher = None if pidfd is None else _LauncherFd(pidfd)
            context = mp.start_processes(
                _rank_entry,
                args=(world_size, free_port(), environment, output, launcher, fn, args),
                nprocs=world_size,
                join=False,
                start_method=_start_method(),
            )
        finally:
            if pidfd is not None:
                os.close(pidfd)  # each rank has its own copy
        ranks.extend(process.pid for process in context.processes)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sent = 0
        try:
            while True:
                # A stop that came while the ranks started reaches them at the first look.
                sent = _forward(context.processes, received, sent)
                if context.join(timeout=_next_look(deadline), grace_period=FAILURE_GRACE_SECONDS):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise RanksTimedOut(
                        f"{world_size} rank(s) still running after {timeout_s:g} s; killed"
                    )
        except mp.ProcessExitedException as err:
            if received and err.exit_code < 0:
                raise RanksStopped(received, err.error_index, err.exit_code) from None
            raise RankFailed(err.error_index, err.exit_code) from None
        except mp.ProcessRaisedException as err:
            if not received:
                raise
            if str(err).strip().endswith("KeyboardInterrupt"):  # a rank still starting
                raise RanksStopped(received, err.error_index, -signal.SIGINT) from None
            print(str(err).strip(), file=sys.stderr, flush=True)  # the rank's traceback
            raise RanksStopped(received, err.error_index, 1, raised=True) from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()  # SIGKILL ends a SIGSTOPped rank too
                    process.join()
                _kill_process_group(process.pid)


def _kill_process_group(pid: int) -> None:
    """Kill what is left of the process group of rank ``pid`` (which made itself its
    leader): a save's writer it forked, say, which would otherwise go on writing into
    the run directory beside the next attempt. The group's id is not reused while any
    member lives; a rank that died before making its group has none."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# Imported once by the forkserver, so that each rank forked from it starts without
# importing them again (about 6 s of CPU per rank on a 2-core machine).
FORKSERVER_PRELOAD = ["torch", "megatron_lns.training.trainer"]


def _start_method() -> str:
    """``forkserver`` with torch and megatron-core imported in the server for CPU ranks;
    ``spawn`` where CUDA is available, since a server that imported torch may already
    have touched the CUDA driver, which a forked process must not inherit.

    The server is started at the first launch and serves every later launch of this
    process (each arm of ``compare``, each test), so ranks start in a fraction of a
    second instead of importing megatron-core each time.
    """
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.is_available():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    return "forkserver"


class RanksTimedOut(RuntimeError):
    """Ranks of :func:`spawn_local` outlived its ``timeout_s``."""


def _next_look(deadline: float | None) -> float:
    """Seconds the launcher waits for its ranks before it looks for a stop to forward."""
    if deadline is None:
        return FORWARD_EVERY_S
    return min(FORWARD_EVERY_S, max(0.0, deadline - time.monotonic()))


class NoMultiNodeLauncher(UserError, RuntimeError):
    """``trainer.num_nodes > 1`` without torchrun or srun starting every rank."""


def run_job(fn: Callable[..., Any], num_nodes: int, devices: int, *args: Any,
            multi_node_hint: str, local_launch: Callable[..., None] | None = None
            ) -> None:  # fmt: skip
    """Run ``fn(*args)`` on every rank: in this process under an external launcher
    (torchrun, srun: :func:`launcher_environment`) or for one device, else on ``devices`` local
    processes (``local_launch``, called as :func:`spawn_local` is, which is the default;
    :func:`.restarts.spawn_with_restarts` restarts them in-job). Several nodes need the
    external launcher; ``multi_node_hint`` ends the refusal with what the calling command
    offers."""
    world = world_size(num_nodes, devices)
    if launcher_environment() is not None:
        # As spawn_local's ranks do: a process group still alive when the interpreter
        # tears down can end the rank in C++'s std::terminate ("terminate called without
        # an active exception") after a successful run, and srun then fails the job.
        try:
            fn(*args)
        finally:
            destroy_distributed()
    elif world == 1:
        fn(*args)
    elif num_nodes > 1:
        raise NoMultiNodeLauncher(
            "trainer.num_nodes > 1 needs a multi-node launcher" + multi_node_hint
        )
    else:
        (local_launch or spawn_local)(fn, world, *args)
