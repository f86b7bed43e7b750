#!/usr/bin/env bash
# Creates .venv (if missing) with torch, kvcached-core built from this checkout, and the test/demo tools.
# Idempotent: re-running rebuilds kvcached-core only. Works on a CPU-only machine and on a GPU machine.
#
#   KVCACHED_TORCH   torch requirement to install when the venv has none (default: torch==2.13.0)
#   KVCACHED_VENV    where the venv lives (default: .venv in the checkout)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KVCACHED_VENV:-$repo/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${KVCACHED_TORCH:-torch==2.13.0} (one time)"
  "$venv/bin/python" -m pip install -q "${KVCACHED_TORCH:-torch==2.13.0}"
fi
echo "setup: building kvcached-core"
"$venv/bin/python" -m pip install -q "$repo[test,demo]"
