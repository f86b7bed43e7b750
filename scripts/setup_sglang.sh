#!/usr/bin/env bash
# Creates .venv-sglang (if missing) for the SGLang plugin: SGLang 0.5.23's own pools and allocators on CPU,
# kvcached-core built from this checkout, and kvcached-sglang. SGLang pins its own torch, so it cannot share
# .venv. The first run downloads about 6 GB (torch 2.14.1 with its CUDA libraries) and takes 3-4 minutes;
# later runs only reinstall kvcached. No GPU is needed: SGLang's pool and allocator classes run on CPU.
#
#   KVCACHED_SGLANG_VENV   where the venv lives (default: .venv-sglang in the checkout)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KVCACHED_SGLANG_VENV:-$repo/.venv-sglang}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '0.5.23'" 2>/dev/null; then
  echo "setup-sglang: installing torch 2.14.1 and SGLang 0.5.23 (one time, ~6 GB)"
  "$venv/bin/python" -m pip install -q torch==2.14.1 torchvision==0.29.1
  # SGLang's full dependency set pulls CUDA-only packages; its pool, allocator and plugin modules import
  # with this list (shared/FACTS.md section 4).
  "$venv/bin/python" -m pip install -q --no-deps sglang==0.5.23
  "$venv/bin/python" -m pip install -q orjson psutil pybase64 requests packaging starlette msgspec pydantic \
    pyzmq tqdm ipython aiohttp transformers==5.19.0 dill apache-tvm-ffi zstandard sentencepiece \
    compressed-tensors gguf einops openai partial_json_parser pytest
fi
echo "setup-sglang: building kvcached-core and installing kvcached-sglang"
"$venv/bin/python" -m pip install -q "$repo"
"$venv/bin/python" -m pip install -q "$repo/kvcached_sglang"
