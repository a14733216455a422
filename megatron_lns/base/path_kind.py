"""Why a path a command needs is not there, in words that tell the two misses apart.

``not path.is_file()`` is true for a path that does not exist and for a directory; a
message that says "does not exist" about a directory the user can see sends them
looking in the wrong place. These say which it is.
"""

from __future__ import annotations

from pathlib import Path


def not_a_file(path: str | Path) -> str | None:
    """Why ``path`` is not a readable regular file ("does not exist", "is a directory,
    not a file"), or None when it is one."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return "is a directory, not a file"
    return "does not exist" if not path.exists() else "is not a regular file"


def not_a_directory(path: str | Path) -> str | None:
    """Why ``path`` is not a directory ("does not exist", "is a file, not a directory"),
    or None when it is one."""
    path = Path(path)
    if path.is_dir():
        return None
    return "does not exist" if not path.exists() else "is a file, not a directory"
