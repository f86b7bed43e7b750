#!/usr/bin/env bash
# Checks a plugin against engine releases that no machine here runs, by reading their wheels' sources
# (scripts/read_release.py): every unit's target, alias and read symbol there, and every hook and override
# taking what the release passes. Run with a venv where the plugin and some release of its engine are
# installed (the units and hooks are the same objects for every release).
#
#   bash scripts/read_releases.sh vllm|sglang VENV VERSION [VERSION ...]
#
# Each release's wheel is downloaded without its dependencies, only its .py files kept, under
# KVCACHED_READ_CACHE (default .read-releases/ in the checkout, git-ignored), so a later run reads them again
# without downloading. Exit status 1 if a release does not read clean.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
engine="${1:?usage: read_releases.sh vllm|sglang VENV VERSION ...}"
venv="${2:?usage: read_releases.sh vllm|sglang VENV VERSION ...}"
venv="$(cd "$venv" && pwd)"
shift 2
case "$engine" in
  vllm | sglang) ;;
  *) echo "read_releases: the engine is vllm or sglang, not '$engine'" >&2; exit 2 ;;
esac
[ $# -gt 0 ] || { echo "read_releases: name at least one release" >&2; exit 2; }
cache="${KVCACHED_READ_CACHE:-$repo/.read-releases}"
pairs=()
for version in "$@"; do
  sources="$cache/$engine-$version"
  if [ ! -d "$sources/$engine" ]; then
    wheels="$(mktemp -d)"
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "$engine==$version"
    mkdir -p "$sources.part"
    unzip -q -o "$wheels"/*.whl "$engine/*.py" -d "$sources.part"
    rm -rf "$wheels" "$sources"
    mv "$sources.part" "$sources"
  fi
  pairs+=("$version" "$sources")
done
# One process reads them all (the plugin, and with it the installed engine, imported once); run from /tmp,
# so that the checkout does not shadow the installed packages.
if ! (cd /tmp && "$venv/bin/python" "$repo/scripts/read_release.py" --brief "$engine" "${pairs[@]}"); then
  echo "read_releases: a release of $engine does not read clean (above)" >&2
  exit 1
fi
