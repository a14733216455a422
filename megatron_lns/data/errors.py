"""The one base class of every data error a user can fix.

Each is raised with a one-line message that names the file, prefix or split at fault
and says what to do, so the command line prints it as ``error: ...`` instead of a
traceback: catching :class:`DataError` covers them all.
"""

from __future__ import annotations

from megatron_lns.base.errors import UserError


class DataError(UserError, ValueError):
    """Data (files, blend, split, tokenizer) that cannot be used as given."""


class PreprocessError(DataError):
    """Input that cannot be tokenized (bad JSON, wrong key or type, corrupt, empty)."""
