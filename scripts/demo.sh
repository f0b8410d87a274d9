#!/usr/bin/env bash
# Main job on a fresh machine: a virtual environment with the pinned torch / triton and this
# package, then `kpool demo` (a serving session through KPoolCache, checked against the oracle).
# Arguments are passed to `kpool demo` (e.g. --requests 16).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=python3.11
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-demo
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q torch==2.13.0
python -m pip install -q -e . triton==3.9.0
kpool demo "$@"
