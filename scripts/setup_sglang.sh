#!/usr/bin/env bash
# Creates a venv for the SGLang plugin (if missing): SGLang's own pools and allocators on CPU at VERSION,
# kvcached-core built from this checkout, and kvcached-sglang. SGLang pins its own torch, so each SGLang
# version gets its own venv. No GPU is needed: SGLang's pool and allocator classes run on CPU.
#
#   bash scripts/setup_sglang.sh [VERSION]     VERSION: 0.5.23 (default) or 0.5.16, the ends of the range
#
# The first run downloads about 6 GB (torch with its CUDA libraries: 2.14.1 for 0.5.23, 2.11.0 for 0.5.16)
# and takes 3-4 minutes; later runs only reinstall kvcached. SGLang is installed with --no-deps (its full
# dependency set pulls CUDA-only packages) plus the packages its pool, allocator and plugin modules import.
#
#   KVCACHED_SGLANG_VENV   where the 0.5.23 venv lives (default: .venv-sglang); 0.5.16's is .venv-sglang-0.5.16
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
version="${1:-0.5.23}"
case "$version" in
  0.5.23) venv="${KVCACHED_SGLANG_VENV:-$repo/.venv-sglang}"; torch="torch==2.14.1 torchvision==0.29.1"
    pins="transformers==5.19.0 openai apache-tvm-ffi" ;;
  0.5.16) venv="$repo/.venv-sglang-$version"; torch="torch==2.11.0 torchvision==0.26.0"
    pins="transformers==5.12.1 openai==2.6.1 xgrammar==0.2.1 apache-tvm-ffi==0.1.11" ;;
  *) echo "setup-sglang: unsupported SGLang version '$version'; use 0.5.23 or 0.5.16" >&2; exit 2 ;;
esac
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; assert m.version('sglang') == sys.argv[1]" \
    "$version" 2>/dev/null; then
  echo "setup-sglang: installing $torch and SGLang $version (one time, ~6 GB)"
  # shellcheck disable=SC2086  # lists of requirements
  "$venv/bin/python" -m pip install -q $torch
  "$venv/bin/python" -m pip install -q --no-deps "sglang==$version"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q orjson psutil pybase64 requests packaging starlette msgspec pydantic \
    pyzmq tqdm ipython aiohttp dill zstandard sentencepiece compressed-tensors gguf einops \
    partial_json_parser setproctitle uvicorn fastapi pytest $pins
fi
echo "setup-sglang: building kvcached-core and installing kvcached-sglang in $venv"
"$venv/bin/python" -m pip install -q "$repo"
"$venv/bin/python" -m pip install -q "$repo/kvcached_sglang"
