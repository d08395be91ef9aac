#!/usr/bin/env bash
# Install the library with its demo extras into ./.venv (torch pinned to the CPU 2.13.0 build)
# and run the main job. Extra arguments go to `rlobjectives demo`, e.g. `--steps 20`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RLOBJECTIVES_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --disable-pip-version-check -c requirements/constraints.txt torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[demo]"
exec "$VENV/bin/rlobjectives" demo "$@"
