#!/usr/bin/env bash
# Install everything the tests need into ./.venv and run lint, format check, type check and the
# whole test suite (what CI runs: .ci/run calls this script without arguments). Extra arguments
# go to pytest, e.g. the quick check that leaves out the multi-process and whole-run tests
# (spawned gloo ranks, torchrun, the demo runs, the peers' real training steps, all marked
# `slow`): `bash scripts/test.sh -m "not slow"`; or those alone: `bash scripts/test.sh -m slow`.
#
# Installs (torch pinned to the CPU 2.13.0 build through requirements/constraints.txt, FIRST):
#   1. torch==2.13.0;
#   2. the library with its test, demo, examples and trl extras, and requirements/peers.txt (the
#      packages the real verl / OpenRLHF / TRL training steps of tests/integrations/ import);
#   3. the peers verl 0.9.1, OpenRLHF 0.11.2 and DeepSpeed 0.19.6 without their declared
#      dependencies (requirements/peers-nodeps.txt; DS_BUILD_OPS=0: DeepSpeed's sdist builds no op).
# The library itself depends on torch alone; `import rlobjectives` imports none of the peers.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RLOBJECTIVES_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check -c requirements/constraints.txt)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[test,demo,examples,trl]" -r requirements/peers.txt
DS_BUILD_OPS=0 "${PIP[@]}" --no-deps --no-build-isolation -r requirements/peers-nodeps.txt
echo "== ruff"
"$PY" -m ruff check src tests benchmarks examples
"$PY" -m ruff format --check src tests benchmarks examples
echo "== mypy"
"$PY" -m mypy
echo "== pytest"
"$PY" -m pytest -q "$@"
