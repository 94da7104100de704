#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter: python3.12 on PATH first, then pyenv installs.
# megatron-core >= 0.17 requires Python 3.12; we fail with the fix when none is found.
set -u
for cand in "${PYTHON312:-}" "$(command -v python3.12 2>/dev/null)" $HOME/.pyenv/versions/3.12*/bin/python3.12; do
  [ -n "$cand" ] && [ -x "$cand" ] || continue
  if "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
    echo "$cand"; exit 0
  fi
done
echo "error: no Python 3.12 found (megatron-core 0.19 requires it). Install one, e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv', or set PYTHON312=/path/to/python3.12." >&2
exit 1
