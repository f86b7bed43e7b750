#!/usr/bin/env bash
# Builds kvcached-core on a CUDA machine, runs the whole test suite (GPU tests included), the CUDA
# benchmarks (burst growth included), the GPU proof and both examples on the GPU; logs, JSON and a plot go into
# one folder (9 files).
#
#   bash benchmarks/gpu/run_all.sh [OUTPUT_DIR]      (default: $OUT, else ./gpu-out)
#
# Needs python3 with torch, pybind11, scikit-build-core, cmake, pytest, pluggy and prometheus_client.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-${OUT:-$repo/gpu-out}}"
py="${PYTHON:-python3}"
mkdir -p "$out"
status=0
log="$out/run.log"

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
  echo "cores: $(nproc)"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

echo "== build"
if ! (cd "$repo" && "$py" -m pip install --no-build-isolation --no-deps -v .) > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
grep -E "warning:|kvcached: " "$out/build.log" | head -20

echo "== tests"
# From /tmp, so nothing the tests write lands in the checkout.
(cd /tmp && "$py" -m pytest -v -p no:cacheprovider "$repo/tests") > "$out/pytest.log" 2>&1 || status=1
tail -1 "$out/pytest.log"

step() {  # step NAME COMMAND...: run from /tmp, append to run.log, remember a failure
  echo "== $1" | tee -a "$log"
  shift
  (cd /tmp && "$@") >> "$log" 2>&1 || { status=1; echo "FAILED" | tee -a "$log"; }
}
step "alloc_free cuda" "$py" "$repo/benchmarks/alloc_free.py" --device cuda --page-samples 64 \
  --out "$out/alloc_free_cuda.json"
step "growth cuda (1, 4, 16 GiB from empty, and back)" "$py" "$repo/benchmarks/growth.py" --device cuda --page-mib 2 8 32 \
  --out "$out/growth_cuda.json"
step "control_plane cuda" "$py" "$repo/benchmarks/control_plane.py" --device cuda --out "$out/control_plane_cuda.json"
step "proof (churn 1e5 ops, unmap race, two processes, throughput, idle footprint)" \
  "$py" "$repo/benchmarks/gpu/proof.py" --out "$out/proof_cuda.json"
step "driver reserve (reported pages are mappable on a nearly full device)" \
  "$py" "$repo/benchmarks/gpu/probe_margin.py"
if command -v compute-sanitizer > /dev/null; then
  step "compute-sanitizer memcheck (short churn)" timeout 150 compute-sanitizer --tool memcheck \
    "$py" "$repo/benchmarks/gpu/proof.py" --short
fi
step "example 00 on cuda" "$py" "$repo/examples/00_two_processes/run.py" --device cuda
step "example 02 on cuda" "$py" "$repo/examples/02_memory_control/run.py" --device cuda \
  --plot "$out/memory_control_cuda.png"
grep -E "^(==|OK|FAILED|targets|map / floor)|ERROR SUMMARY|\"(no_|ops_|unmap_|idle_|two_|reported_le)" "$log"
exit $status
