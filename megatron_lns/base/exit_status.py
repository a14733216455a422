"""The exit status of a process entry point: the command line, a SLURM task.

It imports no torch: ``submit`` and ``--dry-run`` end here too.

Errors in the input (config, data, checkpoints, run directory) end the process with one
line, ``error: ...``, and exit code 2; ``MEGATRON_LNS_DEBUG=1`` shows their traceback.
A rank of a local multi-process run that failed ends it with status 1, or 2 when the
rank has already reported a user error; ranks that the user's stop signal ended before
they could stop cleanly end it with 128 + the signal, as a shell reports a signal.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from megatron_lns.base.disk import as_user_error
from megatron_lns.base.errors import (
    USER_ERROR_EXIT_CODE,
    RankFailed,
    UserError,
    debug_enabled,
    report_user_error_once,
)


def exit_status(body: Callable[[], int | None]) -> int:
    """Run ``body`` and return the process's exit status: what it returns (0 for None),
    or the status of the error that ended it, reported as the module doc says."""
    try:
        return body() or 0
    except (UserError, FileNotFoundError) as err:
        if debug_enabled():
            raise
        report_user_error_once(err)
        return USER_ERROR_EXIT_CODE
    except OSError as err:  # a full disk that no writer reported itself
        user_error = as_user_error(err)
        if user_error is None or debug_enabled():
            raise
        report_user_error_once(user_error)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RankFailed as err:
        if err.exit_code == USER_ERROR_EXIT_CODE:
            return USER_ERROR_EXIT_CODE  # the rank has reported it
        print(
            f"error: {err}{'' if err.explained else ' (its output above says why)'}",
            file=sys.stderr,
        )
        return err.status
