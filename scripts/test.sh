#!/usr/bin/env bash
# Sets everything up on a fresh machine, then runs the whole test suite: the core in .venv
# (scripts/setup.sh), the SGLang plugin in .venv-sglang (scripts/setup_sglang.sh) and the vLLM plugin in
# .venv-vllm (scripts/setup_vllm.sh); each engine pins its own torch.
# GPU tests skip themselves where no CUDA device is usable. Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
bash "$repo/scripts/setup_sglang.sh"
bash "$repo/scripts/setup_vllm.sh"
venv="${KVCACHED_VENV:-$repo/.venv}"
sglang_venv="${KVCACHED_SGLANG_VENV:-$repo/.venv-sglang}"
vllm_venv="${KVCACHED_VLLM_VENV:-$repo/.venv-vllm}"
"$venv/bin/ruff" check "$repo"
# From outside the checkout, so the installed packages (with the native module) are what gets imported.
cd /tmp
"$venv/bin/python" -m pytest -p no:cacheprovider "$repo/tests" "$@"
"$sglang_venv/bin/python" -m pytest -p no:cacheprovider "$repo/kvcached_sglang/tests" "$@"
"$vllm_venv/bin/python" -m pytest -p no:cacheprovider "$repo/kvcached_vllm/tests" "$@"
