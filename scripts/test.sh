#!/usr/bin/env bash
# Install everything the tests need (the trl extra too: tests/test_trl_integration.py runs the
# real TRL trainer) into ./.venv (torch pinned to the CPU 2.13.0 build through
# requirements/constraints.txt) and run lint, format check, type check and the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RLOBJECTIVES_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --disable-pip-version-check -c requirements/constraints.txt torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[test,demo,examples,trl]"
echo "== ruff"
"$PY" -m ruff check src tests benchmarks examples
"$PY" -m ruff format --check src tests benchmarks examples
echo "== mypy"
"$PY" -m mypy
echo "== pytest"
"$PY" -m pytest -q "$@"
