#!/usr/bin/env bash
# Sets everything up on a fresh machine (scripts/setup.sh), then runs the main demo: two processes sharing
# one memory budget elastically (host memory on a CPU-only machine, the GPU where one is usable).
# Extra arguments go to examples/00_two_processes/run.py (try --help).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
venv="${KVCACHED_VENV:-$repo/.venv}"
cd /tmp && "$venv/bin/python" "$repo/examples/00_two_processes/run.py" "$@"
