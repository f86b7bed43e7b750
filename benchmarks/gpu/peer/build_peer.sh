#!/usr/bin/env bash
# Builds the peer project (ovg-project's `kvcached` package, which benchmarks/gpu/peer/growth_peer.py measures)
# against this machine's torch, into a folder of its own that then goes first on PYTHONPATH:
#
#   bash benchmarks/gpu/peer/build_peer.sh PEER_SRC_DIR TARGET_DIR        e.g.  .peer-src /tmp/peer-kv
#
# Offline: pip runs with --no-build-isolation --no-deps, so nothing is downloaded; python3 (or $PYTHON) must
# have a CUDA build of torch and setuptools, and a CUDA toolkit (nvcc, cuda.h) must be installed. The
# sources are built from a scratch copy, so PEER_SRC_DIR stays as extracted. Of the peer's runtime
# dependencies, numpy and wrapt are taken from the machine and posix_ipc from PEER_SRC_DIR/wheels (see below);
# growth_peer.py needs none of them.
# Exit status: 0 built and importable, 1 the build or the import failed, 2 bad arguments or something missing
# (nvcc, a CUDA torch, setuptools, the driver's libcuda), each said in one line.
set -euo pipefail
me=build_peer.sh
die() {
  echo "$me: $2" >&2
  exit "$1"
}
[ $# -eq 2 ] || die 2 "usage: build_peer.sh PEER_SRC_DIR TARGET_DIR (e.g. .peer-src /tmp/peer-kv)"
src=$(cd "$1" 2> /dev/null && pwd) || die 2 "no such folder: $1"
[ -f "$src/setup.py" ] && [ -d "$src/kvcached" ] && [ -d "$src/csrc" ] \
  || die 2 "$src is not the peer's source tree (it needs setup.py, kvcached/ and csrc/)"
mkdir -p "$2"
target=$(cd "$2" && pwd)
py=${PYTHON:-python3}

# torch's CUDAExtension takes the toolkit from CUDA_HOME (or CUDA_PATH), else from where nvcc on PATH is, else
# /usr/local/cuda. nvcc on PATH can be a wrapper script (e.g. /usr/local/bin/nvcc running the real one), which
# would make torch look for cuda.h in /usr/local/include: so pick the first of those places that holds both
# bin/nvcc and include/cuda.h, and pin CUDA_HOME to it.
toolkit() {
  local nvcc_path
  [ -n "${CUDA_HOME:-}" ] && echo "$CUDA_HOME"
  [ -n "${CUDA_PATH:-}" ] && echo "$CUDA_PATH"
  nvcc_path=$(command -v nvcc || true)
  [ -n "$nvcc_path" ] && dirname "$(dirname "$(readlink -f "$nvcc_path")")"
  echo /usr/local/cuda
}
home=""
while read -r candidate; do
  if [ -x "$candidate/bin/nvcc" ] && [ -f "$candidate/include/cuda.h" ]; then
    home=$(cd "$candidate" && pwd -P)
    break
  fi
done < <(toolkit)
[ -n "$home" ] || die 2 "nvcc not found (a CUDA toolkit with bin/nvcc and include/cuda.h in CUDA_HOME, CUDA_PATH,\
 next to nvcc on PATH or in /usr/local/cuda): the peer's extension cannot be built here"
export CUDA_HOME=$home
nvcc=$home/bin/nvcc
torch_version=$("$py" -c 'import torch; assert torch.version.cuda; print(torch.__version__)' 2> /dev/null) \
  || die 2 "$py has no CUDA build of torch to build the peer against"
"$py" -c 'import setuptools' 2> /dev/null \
  || die 2 "$py has no setuptools (the peer's build backend; nothing is downloaded)"

work=$(mktemp -d "${TMPDIR:-/tmp}/peer-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp -a "$src" "$work/src"
rm -rf "$work/src/build" "$work/src"/*.egg-info

# The one change made to the peer's code. The first std::cout statement of its C++ sources (the banner that
# PageAllocator's constructor prints) is known to segfault when the extension is built against a torch other
# than the one the peer was developed with. It only prints, so deleting that statement changes nothing that is
# measured. It spans several lines, so everything from its first line up to the line ending in ';' goes.
# Commented-out std::cout lines ('// std::cout ...') do not match and stay; so does every other line.
couts() {  # file:line:text of every std::cout statement (not commented out) under csrc, in file and line order
  (cd "$work/src" && grep -rnE --include='*.cpp' --include='*.cc' --include='*.h' --include='*.hpp' \
    --include='*.ipp' '^[[:space:]]*std::cout' csrc | sort -t: -k1,1 -k2,2n || true)
}
before=$(couts | wc -l)
hit=$(couts | head -1)
if [ -z "$hit" ]; then
  echo "$me: no std::cout statement in $src/csrc: nothing to remove"
else
  file=${hit%%:*}
  rest=${hit#*:}
  line=${rest%%:*}
  awk -v start="$line" -v removed="$work/removed.txt" '
    NR >= start && !done { print > removed; if ($0 ~ /;[[:space:]]*(\/\/.*)?$/) done = 1; next }
    { print }' "$work/src/$file" > "$work/patched"
  mv "$work/patched" "$work/src/$file"
  [ "$(couts | wc -l)" -eq $((before - 1)) ] || die 1 "removing the std::cout statement at $file:$line went wrong"
  echo "$me: removed from $file, from line $line ($(wc -l < "$work/removed.txt") lines):"
  sed 's/^/    /' "$work/removed.txt"
fi

# The extension links -lcuda (the driver's library) by its unversioned name, which a driver install does not
# always provide (and a machine without a driver has only the toolkit's stub, if that). When neither the
# compiler's search path nor the toolkit has libcuda.so, link against the driver's libcuda.so.1 (or the stub)
# through a link in the scratch folder; at run time the extension loads libcuda.so.1 either way.
if [ ! -e "$home/lib64/libcuda.so" ] && [ ! -e "$home/lib/libcuda.so" ] \
  && [ "$(${CXX:-c++} -print-file-name=libcuda.so 2> /dev/null || echo libcuda.so)" = libcuda.so ]; then
  libcuda=""
  for candidate in $(ldconfig -p 2> /dev/null | awk '$1 == "libcuda.so.1" { print $NF }') \
    /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 /usr/lib/aarch64-linux-gnu/libcuda.so.1 \
    "$home"/lib64/stubs/libcuda.so "$home"/targets/*/lib/stubs/libcuda.so; do
    if [ -e "$candidate" ]; then
      libcuda=$candidate
      break
    fi
  done
  [ -n "$libcuda" ] \
    || die 2 "no libcuda.so or libcuda.so.1 (the NVIDIA driver's library) to link the peer's extension with"
  mkdir -p "$work/lib"
  ln -s "$libcuda" "$work/lib/libcuda.so"
  export LIBRARY_PATH="$work/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  echo "$me: linking with $libcuda (no unversioned libcuda.so on the linker's path)"
fi

echo "$me: building kvcached.vmm_ops against torch $torch_version with $("$nvcc" --version | tail -1) into $target"
# --upgrade: a second build replaces the first in TARGET_DIR instead of being refused.
(cd "$work" && MAX_JOBS=${MAX_JOBS:-$(nproc)} "$py" -m pip install --no-build-isolation --no-deps --upgrade \
  --target "$target" "$work/src") || die 1 "pip could not build the peer (its output is above)"

# Serving through vLLM needs two more things. The peer's runtime dependency posix_ipc, which the GPU image lacks:
# wheels put in PEER_SRC_DIR/wheels (they travel with the sources) are installed into TARGET_DIR, offline.
# And its .pth hook, which loads its vLLM patches when vLLM is imported (with ENABLE_KVCACHED=true): Python
# reads .pth files from site directories only, so TARGET_DIR/_site gets a sitecustomize.py that makes
# TARGET_DIR one. With PYTHONPATH=TARGET_DIR/_site:TARGET_DIR:... every Python process (vLLM's engine core
# and workers included) then starts as the peer's own install would.
shopt -s nullglob
wheels=("$src"/wheels/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  "$py" -m pip install -q --no-deps --no-index --upgrade --target "$target" "${wheels[@]}" \
    || die 1 "could not install the wheels in $src/wheels into $target"
fi
mkdir -p "$target/_site"
"$py" -c 'import sys; open(sys.argv[1], "w").write(f"import site\nsite.addsitedir({sys.argv[2]!r})\n")' \
  "$target/_site/sitecustomize.py" "$target"
[ -f "$target/kvcached_autopatch.pth" ] || echo "$me: note: no kvcached_autopatch.pth in $target (the peer's hook moved?)"

# From / so that no folder named kvcached in the working directory can stand in for the build.
where=$(cd / && PYTHONPATH="$target" "$py" -c 'import kvcached, kvcached.vmm_ops as v; print(v.__file__)') \
  || die 1 "built, but 'import kvcached.vmm_ops' fails with PYTHONPATH=$target"
case "$where" in
  "$target"/*) echo "$me: ok: $where" ;;
  *) die 1 "with PYTHONPATH=$target, 'import kvcached' resolves to $where, not to the build" ;;
esac
