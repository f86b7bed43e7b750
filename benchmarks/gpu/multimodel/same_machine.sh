#!/usr/bin/env bash
# Several configurations of run.py on one machine, one after the other, each compared with the same static
# run: an overloaded comparison that crosses machines cannot tell a policy from the machine (results README,
# runs 20-21).
#
#   bash same_machine.sh OUT CONFIG [CONFIG ...] [-- RUN.PY OPTIONS]
#
#   CONFIG   static    no kvcached, each engine a fixed slice            -> OUT/static
#            elastic   kvcached, no KVCACHED_* setting                  -> OUT/elastic
#            fair      fair share: 5 s wait, block-outer layout, request placement (run 20's) -> OUT/fair
#            floor     fair, and half of every share never lent (KVCACHED_FAIR_SHARE_FLOOR=0.5) -> OUT/floor
#   e.g.     bash same_machine.sh $OUT static -- --models 2     (on an H100 ~280 s with a cold compile cache)
#            bash same_machine.sh $OUT fair -- --models 2       (~260 s: one configuration per device call)
#            bash same_machine.sh $OUT floor -- --models 2      (the same machine, the same OUT)
#
# Each configuration other than static writes its run into OUT/CONFIG beside a copy of OUT/static's run, and
# run.py's `compare` there (multimodel_xN.json and .png). Give every call of one OUT the same run.py options
# (the traffic: compare refuses runs of different traffic). A KVCACHED_* variable the caller sets reaches
# every configuration's engines and wins over a preset (e.g. KVCACHED_FAIR_SHARE_FLOOR=0.25 with `floor`).
# Needs what run.py needs: vLLM importable, kvcached on PYTHONPATH (README.md here). Exit status: 0; 1 if a
# run or a compare failed (the next configuration still runs); 2 for bad arguments.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage="usage: same_machine.sh OUT CONFIG [CONFIG ...] [-- RUN.PY OPTIONS]; CONFIG: static, elastic, fair, floor"
case "${1:-}" in
  -h | --help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
  "" | -*) echo "same_machine.sh: give the output folder first; $usage" >&2; exit 2 ;;
esac
out="$1"
shift
configs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    static | elastic | fair | floor) configs+=("$1") ;;
    *) echo "same_machine.sh: unknown configuration '$1'; $usage" >&2; exit 2 ;;
  esac
  shift
done
[ "${1:-}" = "--" ] && shift
[ ${#configs[@]} -gt 0 ] || { echo "same_machine.sh: name at least one configuration; $usage" >&2; exit 2; }
for option in "$@"; do
  case "$option" in
    --out | --out=*) echo "same_machine.sh: OUT is the first argument; give no --out to run.py" >&2; exit 2 ;;
  esac
done

# KEY=VALUE pairs of a configuration, each unless the caller's environment sets it
preset() {
  local fair=(KVCACHED_FAIR_SHARE=1 KVCACHED_FAIR_SHARE_WAIT_MS=5000 KVCACHED_KV_LAYOUT=block-outer
    KVCACHED_BLOCK_PLACEMENT=request)
  local pairs=()
  case "$1" in
    fair) pairs=("${fair[@]}") ;;
    floor) pairs=("${fair[@]}" KVCACHED_FAIR_SHARE_FLOOR=0.5) ;;
  esac
  local pair name
  for pair in "${pairs[@]}"; do
    name="${pair%%=*}"
    [ -z "${!name:-}" ] && echo "$pair"
  done
  return 0
}

status=0
for config in "${configs[@]}"; do
  dir="$out/$config"
  if [ "$config" = static ]; then
    mkdir -p "$dir"
    python3 "$here/run.py" static --out "$dir" "$@" || status=1
    continue
  fi
  statics=("$out"/static/static_x*.json)
  if [ ! -f "${statics[0]}" ]; then
    echo "same_machine.sh: no static run in $out/static for '$config' to be compared with; run 'static' first" >&2
    status=1
    continue
  fi
  mkdir -p "$dir" && cp "${statics[@]}" "$dir/"
  mapfile -t settings < <(preset "$config")
  echo "== $config: ${settings[*]:-no KVCACHED_* preset}"
  env "${settings[@]}" python3 "$here/run.py" elastic --out "$dir" "$@" || status=1
  python3 "$here/run.py" compare --out "$dir" "$@" || status=1
done
exit $status
