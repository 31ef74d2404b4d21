#!/usr/bin/env bash
# Set up a virtual environment in .venv with refusion and its test dependencies.
# torch is installed first and pinned (2.13.0, a CPU build on the project's machines): an unpinned
# torch would pull a multi-GB CUDA build. Re-running is cheap: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import refusion, torch; print(f'refusion ready (torch {torch.__version__})')"
