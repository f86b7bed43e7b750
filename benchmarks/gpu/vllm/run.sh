#!/usr/bin/env bash
# kvcached-vllm on a GPU machine where vLLM's CUDA build is importable (on the lent H200: staged into
# /tmp/site, see README.md here). Installs kvcached-core and kvcached-vllm from this checkout into /tmp/kv,
# then runs streams of phases, each stream on its own GPUs, the streams in parallel.
#
#   bash benchmarks/gpu/vllm/run.sh OUT_DIR GPUS:PHASE[,PHASE...] [GPUS:PHASE[,PHASE...] ...]
#
#   phases: core probe tests offline identity backstop serve serve-ab burst share share3 limit tp   (tp: 0,1:tp)
#   e.g.    run.sh $OUT 0:tests,offline 1:share,share3    then    run.sh $OUT 0:serve 1:limit    then 0,1:tp
#
# Work folder: /tmp/kvbench (kept while the machine is up, so later calls add to it). OUT_DIR gets
# summary.json (every number so far, no raw samples), the sharing PNGs and results.tar.gz (every phase's
# full JSON and every log). KVCACHED_BENCH_BUDGET_S (default 540, from this script's start) bounds the
# streams, so the results are packed before a device call's limit. KVCACHED_BENCH_SIDES (e.g. vanilla,kvcached; `peer` builds and runs
# the peer project too) picks the engines of offline, serve, serve-ab and burst; KVCACHED_BENCH_ROUNDS (default 1)
# runs offline's and serve's that many times, alternating (serve-ab: at least 4); KVCACHED_BENCH_RATES (e.g. inf)
# runs only those of serve's and serve-ab's rates 16,64,inf. A failing phase does not stop
# the others; exit status 1 if any failed.
#
# KVCACHED_BENCH_ENGINE=sglang (what benchmarks/gpu/sglang/run.sh sets) runs the SGLang harness instead:
# benchmarks/gpu/sglang/suite.py's phases, work folder /tmp/kvbench-sglang. Both plugins are installed
# into /tmp/kv either way (the SGLang harness's `mixed` phase runs a vLLM server next to an SGLang one).
set -uo pipefail
repo="$(cd "$(dirname "$0")/../../.." && pwd)"
final="${1:?usage: run.sh OUT_DIR GPUS:PHASES ...}"
shift
[ $# -gt 0 ] || { echo "run.sh: give at least one GPUS:PHASES stream, e.g. 0:tests,offline" >&2; exit 2; }
py="${PYTHON:-python3}"
engine="${KVCACHED_BENCH_ENGINE:-vllm}"
case "$engine" in
  vllm) out=/tmp/kvbench ;;
  sglang) out=/tmp/kvbench-sglang ;;
  *) echo "run.sh: KVCACHED_BENCH_ENGINE must be vllm or sglang, not '$engine'" >&2; exit 2 ;;
esac
mkdir -p "$out" "$final"
started=$(date +%s)
export PYTHONUNBUFFERED=1 KVCACHED_RUNTIME_DIR="${KVCACHED_RUNTIME_DIR:-/tmp/kvcached-bench}"
# No network there: transformers must not look for kernels on the Hub when a model is made or loaded.
export USE_HUB_KERNELS=0 HF_HUB_OFFLINE=1

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  "$py" -c 'import importlib, sys, torch; e = importlib.import_module(sys.argv[1]); print("python", sys.version.split()[0], "torch", torch.__version__, sys.argv[1], e.__version__)' "$engine"
  echo "cores: $(nproc)"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

# A later call on the same machine with the same sources skips the build.
sources=$(cd "$repo" && find csrc src kvcached_vllm/src kvcached_sglang/src CMakeLists.txt pyproject.toml -type f -print0 \
  | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-16)
if [ -f "/tmp/kv/.sources-$sources" ]; then
  echo "== kvcached in /tmp/kv is built from these sources"
else
  echo "== install kvcached into /tmp/kv"
  # Both plugins: each engine loads only its own, and a mixed run needs both.
  if ! (cd "$repo" && "$py" -m pip install -q --no-build-isolation --no-deps --upgrade --target /tmp/kv . ./kvcached_vllm ./kvcached_sglang) \
      > "$out/install.log" 2>&1; then
    tail -30 "$out/install.log"
    exit 1
  fi
  rm -f /tmp/kv/.sources-* && touch "/tmp/kv/.sources-$sources"
fi
export PYTHONPATH="/tmp/kv${PYTHONPATH:+:$PYTHONPATH}" KVCACHED_BENCH_KV_PATH=/tmp/kv
# The peer project as a side of offline/serve/burst (KVCACHED_BENCH_SIDES=...,peer): built once per machine
# from .peer-src (carried to the device; see benchmarks/gpu/peer/README.md), ~40 s.
peer="${KVCACHED_BENCH_PEER_PATH:-/tmp/peer-kv}"  # where suite.py looks for it too
if [[ ",${KVCACHED_BENCH_SIDES:-}," == *",peer,"* ]] && [ ! -d "$peer/_site" ]; then
  echo "== build the peer into $peer"
  bash "$repo/benchmarks/gpu/peer/build_peer.sh" "$repo/.peer-src" "$peer" > "$out/build-peer.log" 2>&1 \
    || tail -5 "$out/build-peer.log"
fi
(cd /tmp && "$py" -m "kvcached_$engine.check" > "$out/check.txt" 2>&1; head -1 "$out/check.txt"
  "$py" "$repo/benchmarks/gpu/$engine/suite.py" model --out "$out")

run_phase() {  # run_phase GPUS PHASE: one phase on those GPUs, its output in the stream's log
  local gpus="$1" phase="$2"
  if [ "$phase" = core ]; then
    # The core's GPU tests, the map path with the backstop on and off (what one more driver call costs),
    # what the driver charges for each way of mapping a burst (benchmarks/gpu/probe_slices.py) and whether
    # it depends on the range a page lands in (probe_ranges.py), burst growth against the driver's floor
    # (benchmarks/growth.py; 32 MiB pages also with the backstop off), and what a KV cache growing step by
    # step pays per allocation without and with mapping ahead (benchmarks/map_ahead.py).
    (cd /tmp && "$py" -m pytest -q -p no:cacheprovider "$repo/tests/test_gpu.py" > "$out/pytest-core.log" 2>&1)
    for on in 1 0; do
      (cd /tmp && KVCACHED_BACKSTOP=$on "$py" "$repo/benchmarks/alloc_free.py" --device cuda:0 --json \
        --out "$out/alloc_free_backstop$on.json" > /dev/null 2>> "$out/alloc_free.log")
    done
    (cd /tmp && "$py" "$repo/benchmarks/gpu/probe_slices.py" --out "$out/probe_slices.json" > /dev/null 2>> "$out/alloc_free.log")
    (cd /tmp && "$py" "$repo/benchmarks/gpu/probe_ranges.py" --out "$out/probe_ranges.json" > /dev/null 2>> "$out/alloc_free.log")
    (cd /tmp && "$py" "$repo/benchmarks/growth.py" --device cuda:0 --page-mib 2 8 32 --layout engine block-outer --out "$out/growth.json" 2>> "$out/alloc_free.log")
    # The same growth with the backstop off: how much of the distance to the floor its unmap is.
    (cd /tmp && KVCACHED_BACKSTOP=0 "$py" "$repo/benchmarks/growth.py" --device cuda:0 --page-mib 32 --out "$out/growth_backstop0.json" 2>> "$out/alloc_free.log")
    (cd /tmp && "$py" "$repo/benchmarks/map_ahead.py" --device cuda:0 --steps 256 --out "$out/map_ahead.json" > /dev/null 2>> "$out/alloc_free.log")
    echo "[core] $(tail -1 "$out/pytest-core.log")"
  elif [ "$phase" = tests ]; then
    # Two runs: each test folder has its own conftest.
    (cd /tmp && "$py" -m pytest -q -p no:cacheprovider "$repo/tests/test_gpu.py" > "$out/pytest-core.log" 2>&1)
    # The engine's GPU tests: a real vLLM engine against vLLM without kvcached; SGLang's id transfers.
    engine_tests="$repo/kvcached_vllm/tests/test_gpu.py"
    [ "$engine" = sglang ] && engine_tests="$repo/kvcached_sglang/tests/test_device_ids.py"
    (cd /tmp && "$py" -m pytest -q -p no:cacheprovider "$engine_tests" > "$out/pytest-$engine.log" 2>&1)
    echo "[tests] core: $(tail -1 "$out/pytest-core.log"); $engine: $(tail -1 "$out/pytest-$engine.log")"
  else
    (cd /tmp && "$py" "$repo/benchmarks/gpu/$engine/suite.py" "$phase" --out "$out")
  fi
}

budget="${KVCACHED_BENCH_BUDGET_S:-540}"
# The phases read it, so as not to start an engine that cannot finish in time (suite.seconds_left).
export KVCACHED_BENCH_DEADLINE=$((started + budget))
pack() {  # whatever happened, what ran so far comes back
  "$py" "$repo/benchmarks/gpu/vllm/summary.py" "$out" > "$final/summary.json"
  cp "$out"/*.png "$final/" 2>/dev/null
  tar czf "$final/results.tar.gz" -C "$out" .
}
trap pack EXIT
pids=()
for stream in "$@"; do
  gpus="${stream%%:*}"
  phases="${stream#*:}"
  log="$out/stream-${gpus//,/-}.log"
  (
    export CUDA_VISIBLE_DEVICES="$gpus" VLLM_CACHE_ROOT="/tmp/vllm-cache-${gpus//,/-}"
    for phase in ${phases//,/ }; do
      run_phase "$gpus" "$phase"
    done
  ) >> "$log" 2>&1 &
  pids+=($!)
done
alive() { for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
deadline=$KVCACHED_BENCH_DEADLINE
while [ "$(date +%s)" -lt "$deadline" ] && alive; do sleep 2; done
if alive; then
  # Out of time: stop every engine and driver this run started (servers run in sessions of their own). The
  # patterns match those processes' command lines only: not the shell that started run.sh with its logs' names.
  echo "run.sh: budget of ${budget} s spent; stopping what still runs"
  engines="benchmarks/gpu/[a-z]*/suite.py|offline_engine.py|vllm.entrypoints.openai.api_server|vllm.entrypoints.cli.main|sglang.launch_server|-m pytest |VLLM::|sglang::"
  pkill -TERM -f -- "$engines"
  sleep 15
  pkill -KILL -f -- "$engines"
fi
wait
grep -hE "^\[" "$out"/stream-*.log | tail -60

status=0
ls "$out"/*_error.json > /dev/null 2>&1 && status=1
grep -qs "failed\|error" "$out"/pytest-*.log && status=1
exit $status
