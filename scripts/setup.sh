#!/usr/bin/env bash
# Set up a virtual environment in .venv with refusion, its serving extra and its test dependencies.
# torch is installed first and pinned (2.13.0, a CPU build on the project's machines): an unpinned
# torch would pull a multi-GB CUDA build. Re-running is cheap: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,serve]" 2>&1 | grep -v "^WARNING: Location" || true
# `lm_eval --model refusion`: lm-eval finds no plugins by itself; a one-line .pth registers ours
.venv/bin/python -m refusion.evaluation.lm_eval --install-hook >/dev/null
# The browser tests drive Debian's Chromium (never a downloaded one): installed when missing and
# this runs as root; elsewhere those tests are skipped and say why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "setup: could not install chromium; the browser tests will be skipped" >&2
fi
# float32 decoding on a CPU builds the project's few-row kernel on first use (refusion/model/few_rows.py)
# with a C++ compiler; without one it takes the slower library products
if ! command -v c++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null) \
        || echo "setup: could not install g++; float32 CPU decoding takes the library products" >&2
fi
.venv/bin/python -c "import refusion, torch; print(f'refusion ready (torch {torch.__version__})')"
