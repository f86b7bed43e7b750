#!/usr/bin/env bash
# kvcached-sglang on a GPU machine where SGLang's CUDA build is importable (on the lent H200: staged into
# /tmp/site with the shared stage.py sglang). The vLLM harness's runner with SGLang in place of vLLM:
#
#   bash benchmarks/gpu/sglang/run.sh OUT_DIR GPUS:PHASE[,PHASE...] ...      phases: offline serve
#
# Work folder /tmp/kvbench-sglang; OUT_DIR gets summary.json and results.tar.gz as there.
KVCACHED_BENCH_ENGINE=sglang exec bash "$(dirname "$0")/../vllm/run.sh" "$@"
