#!/usr/bin/env bash
# Builds kvcached-core on a CUDA machine, runs the whole test suite (GPU tests included) and the CUDA
# benchmarks, and writes every log and JSON file into one folder.
#
#   bash benchmarks/gpu/run_all.sh [OUTPUT_DIR]      (default: $OUT, else ./gpu-out)
#
# Needs python3 with torch, pybind11, scikit-build-core, cmake and pytest (no network).
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-${OUT:-$repo/gpu-out}}"
py="${PYTHON:-python3}"
mkdir -p "$out"
status=0

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
  nproc
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

echo "== build"
if ! (cd "$repo" && "$py" -m pip install --no-build-isolation --no-deps -v .) > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
grep -E "warning:|kvcached: " "$out/build.log" | head -20

echo "== tests"
# Run from outside the checkout so the installed package (with its native module) is imported.
(cd /tmp && "$py" -m pytest -v -p no:cacheprovider "$repo/tests") > "$out/pytest.log" 2>&1 || status=1
tail -25 "$out/pytest.log"

echo "== benchmarks"
for device in cpu cuda; do
  (cd /tmp && "$py" "$repo/benchmarks/alloc_free.py" --device "$device" --page-samples 64 \
    --out "$out/alloc_free_$device.json") >> "$out/bench.log" 2>&1 || status=1
done
tail -34 "$out/bench.log"
echo "== demo"
(cd /tmp && "$py" "$repo/examples/00_two_processes/run.py" --device cuda --plot "$out/demo_cuda.png") \
  > "$out/demo_cuda.log" 2>&1 || status=1
tail -4 "$out/demo_cuda.log"
exit $status
