#!/usr/bin/env bash
# Create (or refresh) the project's Python 3.12 virtualenv at $VENV (default .venv)
# with the pinned, tested package set. Quick no-op when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.megatron-lns-stamp"

find_python312() {
    local candidates=(python3.12)
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
    fi
    candidates+=("$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12)
    for py in "${candidates[@]}"; do
        if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}

want=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

PY=$(find_python312) || {
    echo "error: Python 3.12 not found (megatron-core >= 0.17 needs it)." >&2
    echo "       Install it (e.g. 'pyenv install 3.12' or your distro's python3.12 + venv) and retry." >&2
    exit 1
}
echo "setting up $VENV with $PY (pinned packages from requirements/constraints.txt)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade "pip>=24"
"$VENV/bin/python" -m pip install --quiet -c requirements/constraints.txt -e ".[dev]"
echo "$want" > "$STAMP"
