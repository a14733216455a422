"""A child process ends with the process it belongs to, even one already gone by the
time the child asks (base/parent_death.py)."""

import multiprocessing
import os
import signal

from megatron_lns.base.parent_death import die_with_parent, end_with_process


def _sleep_until_signalled() -> None:
    signal.pause()


def test_a_child_whose_parent_went_before_it_asked_ends_at_once():
    # -1 is nobody's pid: the parent the child names is gone, as a launcher killed while
    # a spawned worker was still importing.
    child = multiprocessing.get_context("fork").Process(
        target=die_with_parent, args=(signal.SIGKILL, -1)
    )
    child.start()
    child.join(timeout=30)
    assert child.exitcode == -signal.SIGKILL


def _end_with(pidfd: int) -> None:
    end_with_process(pidfd, signal.SIGTERM)
    signal.pause()


def test_a_process_ends_with_one_that_is_not_its_parent():
    # The child follows its sibling, as a rank forked by the forkserver follows the launcher.
    context = multiprocessing.get_context("fork")
    followed = context.Process(target=_sleep_until_signalled)
    followed.start()
    pidfd = os.pidfd_open(followed.pid)
    follower = context.Process(target=_end_with, args=(pidfd,))
    follower.start()
    os.close(pidfd)
    followed.kill()
    followed.join()
    follower.join(timeout=30)
    assert follower.exitcode == -signal.SIGTERM
