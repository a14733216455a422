"""Whether a process of this host still runs: what a lock or a staging directory that
names its writer's pid is judged by once that writer may have been killed."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (positive, within pid_t) runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
