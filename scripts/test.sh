#!/usr/bin/env bash
# Sets everything up on a fresh machine (scripts/setup.sh), then runs the whole test suite.
# GPU tests skip themselves where no CUDA device is usable. Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
venv="${KVCACHED_VENV:-$repo/.venv}"
"$venv/bin/ruff" check "$repo"
# From outside the checkout, so the installed package (with its native module) is what gets imported.
cd /tmp && "$venv/bin/python" -m pytest -p no:cacheprovider "$repo/tests" "$@"
