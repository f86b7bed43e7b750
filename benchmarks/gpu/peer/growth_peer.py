"""Burst growth of the *peer* allocator: ovg-project's ``kvcached`` package (github.com/ovg-project/kvcached), a
different project from ours (``kvcached_core``) despite the name. Prints one JSON object.

    PYTHONPATH=/tmp/peer-kv:/tmp/kv python3 benchmarks/gpu/peer/growth_peer.py [--device cuda[:N]] [--sizes-gib 1 4 16]
        [--repeats 3] [--layout default|contiguous|per-layer] [--start empty|idle] [--peer-commit SHA] [--out FILE]

Why: ``benchmarks/growth.py`` measures how fast our manager goes from nothing mapped to N GiB of KV blocks and
back. This script runs the same workloads, with the same geometry and the same JSON shape, on the peer's
manager, so both can run back to back on one GPU and be read figure by figure (``build_peer.sh`` builds the
peer into a folder of its own; README.md here has the device commands).

Geometry, as in growth.py: 16 layers x K/V = 32 buffers of 16 KiB blocks (16 tokens of an 8-head x 64-dim
fp16 layer: the peer's ``block_size=16, cell_size=1024``), a pool of exactly N GiB when every block is held,
and the peer's default page of 2 MiB per buffer (``KVCACHED_PAGE_SIZE_MB`` is cleared, so its default holds).
On a fresh peer ``KVCacheManager`` for each run:

- ``alloc1``: ``alloc(1)`` repeated until the blocks of N GiB are held (an engine's decode steps);
- ``request``: ``alloc(128)`` repeated, one 2048-token request of 16-token blocks at a time (a prefill burst);
- ``shrink``: ``free`` of everything held, then ``trim`` (what an engine going idle gives back).

Each figure is the median of ``--repeats`` runs, in GiB/s of mapped memory, timed by wall clock between two
``torch.cuda.synchronize()`` calls. What differs from growth.py, and is recorded in the JSON:

- no ``floor``: the device floor is measured by our own driver probe; take it from growth.py's report of the
  same run (``floor_gib_s``), hence also no ``floor_over_growth`` here;
- the start: the peer maps ``KVCACHED_MIN_RESERVED_PAGES`` (5) pages ahead in a thread of its own as soon as
  a manager is ready. ``--start empty`` (default) waits for that, then ``trim()``s them, so growth starts with
  nothing mapped (the thread refills in the background during the burst, as it would in service);
  ``--start idle`` starts with them mapped (``premapped_bytes``);
- the peer's physical granule: in its default contiguous layout one page id maps a single handle of
  2 MiB x 32 buffers = 64 MiB; ``--layout per-layer`` gives 32 handles of 2 MiB, as our 2 MiB pages do.

The peer is driven only through its public Python API: ``kvcached.integration.vllm.interfaces.init_kvcached``,
``alloc_kv_cache`` and ``shutdown_kvcached`` (the set-up the peer's own tests and alloc benchmark use without
an engine), and ``kvcached.kv_cache_manager.KVCacheManager``'s ``alloc``, ``free``, ``trim`` and
``page_allocator`` (``get_page_state``, ``get_num_reserved_pages``, ``stop_prealloc_thread``). A pattern the
peer cannot do is recorded with the reason (``error``) instead of stopping the run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

# growth.py's report and argument helpers (they need kvcached_core importable too: /tmp/kv on the device).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from _common import host_info, positive_int, write_report  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
LAYERS, KV = 16, 2
BLOCK_TOKENS, HEADS, HEAD_DIM, DTYPE_BYTES = 16, 8, 64, 2
CELL_BYTES = HEADS * HEAD_DIM * DTYPE_BYTES  # bytes of one token in one buffer: the peer's cell_size
BLOCK_BYTES = BLOCK_TOKENS * CELL_BYTES  # 16 KiB per buffer, as growth.py
REQUEST_BLOCKS = 128  # a 2048-token request of 16-token blocks
WARM_BYTES = 256 * MiB  # the warm-up manager, as growth.py
PEER_PAGE_BYTES = 2 * MiB  # the peer's default page (per buffer)
SETTLE_S = 10.0  # how long to wait for the peer's pre-allocation thread before a run
GONE_S = 2.0  # how long to wait for a dropped manager to be destroyed
PROG = "growth_peer.py"


class Unavailable(Exception):
    """Something this script needs is not there: reported in one line, exit status 2."""


class ReleaseError(RuntimeError):
    """A manager could not be brought back to nothing mapped: later runs would not start from empty."""


# ---- the peer ---------------------------------------------------------------------------------------


class Peer:
    """The peer's modules, imported once the environment they read at import time is set."""

    def __init__(self) -> None:
        try:
            import kvcached
            from kvcached import utils
            from kvcached.integration.vllm import interfaces
            from kvcached.kv_cache_manager import KVCacheManager
        except Exception as exc:  # ImportError, or the extension failing to load (OSError, RuntimeError)
            raise Unavailable(
                f"the peer's package 'kvcached' cannot be imported ({type(exc).__name__}: {exc}); build it with "
                "benchmarks/gpu/peer/build_peer.sh and put its target folder first on PYTHONPATH"
            ) from None
        self.package = kvcached
        self.utils = utils
        self.interfaces = interfaces
        self.manager_class = KVCacheManager
        self.page_bytes: int = int(utils.PAGE_SIZE)
        self.contiguous: bool = bool(utils.CONTIGUOUS_LAYOUT)
        self.shm_path = os.path.join("/dev/shm", str(utils.DEFAULT_IPC_NAME))

    def open(self, device: str, max_blocks: int) -> None:
        """Initialise the peer on ``device`` and reserve its virtual KV tensors (no physical memory yet)."""
        import torch

        torch.cuda.set_device(device)
        # is_worker=True: this process maps its own pages (no engine process to forward them to).
        self.interfaces.init_kvcached(tp_rank=0, world_size=1, is_worker=True, device=device, async_sched=False)
        self.interfaces.alloc_kv_cache(
            kvcache_shape=(KV, max_blocks, BLOCK_TOKENS, HEADS, HEAD_DIM),
            block_size=BLOCK_TOKENS,
            dtype=torch.float16,
            device=device,
            num_layers=LAYERS,
        )

    def close(self) -> None:
        self.interfaces.shutdown_kvcached()

    def manager(self, total_bytes: int) -> Any:
        """A fresh manager whose blocks fill exactly ``total_bytes`` of mapped memory when all are held."""
        num_blocks = total_bytes // (BLOCK_BYTES * LAYERS * KV)
        return self.manager_class(num_blocks, BLOCK_TOKENS, CELL_BYTES, LAYERS, world_size=1, num_kv_buffers=KV)

    def mapped_bytes(self, mgr: Any) -> int:
        """Physical memory mapped for ``mgr``: pages in use and pages it keeps mapped ahead, in all buffers."""
        state = mgr.page_allocator.get_page_state()
        return (int(state["inuse_pages"]) + int(state["reserved_pages"])) * self.page_bytes * LAYERS * KV

    def settle(self, mgr: Any, start: str) -> tuple[int, bool]:
        """Wait until ``mgr`` is ready and its pre-allocation thread has mapped what it maps ahead; with start
        'empty', unmap that again. Returns the bytes mapped when the clock starts and whether the wait timed
        out."""
        mgr.alloc(0)  # returns [] once the manager's background set-up (which starts the thread) is done
        total_pages = mgr.mem_size // self.page_bytes
        target = min(int(self.utils.MIN_RESERVED_PAGES), total_pages) if self.utils.PAGE_PREALLOC_ENABLED else 0
        deadline = time.monotonic() + SETTLE_S
        while mgr.page_allocator.get_num_reserved_pages() < target and time.monotonic() < deadline:
            time.sleep(0.001)
        timed_out = mgr.page_allocator.get_num_reserved_pages() < target
        if start == "empty":
            mgr.trim()
        return self.mapped_bytes(mgr), timed_out

    def release(self, mgr: Any, held: list[int]) -> None:
        """Stop ``mgr``'s thread and unmap everything it mapped, so the next manager starts from nothing."""
        try:
            mgr.page_allocator.stop_prealloc_thread()
            blocks = held.copy()
            held.clear()
            if blocks:
                mgr.free(blocks)
            mgr.trim()
            state = mgr.page_allocator.get_page_state()
        except Exception as exc:
            raise ReleaseError(f"releasing a manager failed: {reason(exc)}") from None
        if int(state["inuse_pages"]) or int(state["reserved_pages"]):
            raise ReleaseError(f"a released manager still maps pages: {dict(state)}")

    def wait_gone(self) -> bool:
        """Wait for the last manager to be destroyed; False if it is still alive after GONE_S. All managers of a
        process share one shared-memory file (the peer's size limit), which a manager's destructor deletes:
        the next manager should make its own, not see it deleted under it."""
        gc.collect()
        deadline = time.monotonic() + GONE_S
        while os.path.exists(self.shm_path) and time.monotonic() < deadline:
            time.sleep(0.01)
            gc.collect()
        return not os.path.exists(self.shm_path)

    def describe(self, commit: str | None) -> dict[str, Any]:
        utils = self.utils
        source = "the peer's default (KVCACHED_PAGE_SIZE_MB unset)"
        if self.page_bytes != PEER_PAGE_BYTES:
            source += f": not the {PEER_PAGE_BYTES // MiB} MiB this script expects"
        return {
            "package": "kvcached",
            "project": "github.com/ovg-project/kvcached",
            "version": getattr(self.package, "__version__", None),
            "commit": commit,
            "path": os.path.dirname(os.path.abspath(self.package.__file__)),
            "page_bytes": self.page_bytes,
            "page_bytes_source": source,
            "contiguous_layout": self.contiguous,
            "physical_handle_bytes": self.page_bytes * (LAYERS * KV if self.contiguous else 1),
            "handles_per_page_id": 1 if self.contiguous else LAYERS * KV,
            "page_prealloc": bool(utils.PAGE_PREALLOC_ENABLED),
            "min_reserved_pages": int(utils.MIN_RESERVED_PAGES),
            "max_reserved_pages": int(utils.MAX_RESERVED_PAGES),
            "gpu_utilization": float(utils.GPU_UTILIZATION),
            "ipc_name": str(utils.DEFAULT_IPC_NAME),
            "api": [
                "kvcached.integration.vllm.interfaces.init_kvcached(is_worker=True)",
                "kvcached.integration.vllm.interfaces.alloc_kv_cache",
                "kvcached.kv_cache_manager.KVCacheManager(num_blocks, block_size=16, cell_size=1024, num_layers=16)",
                "KVCacheManager.alloc / free / trim",
                "KVCacheManager.page_allocator.get_page_state / get_num_reserved_pages / stop_prealloc_thread",
                "kvcached.integration.vllm.interfaces.shutdown_kvcached",
            ],
        }


# ---- the workloads ---------------------------------------------------------------------------------


def synchronize() -> None:
    import torch

    torch.cuda.synchronize()


def grow(mgr: Any, per_call: int, held: list[int]) -> float:
    """Seconds to hold every block, ``per_call`` blocks per alloc; the ids go into ``held`` as they come."""
    want = int(mgr.num_blocks)
    synchronize()
    start = time.perf_counter()
    while len(held) < want:
        count = min(per_call, want - len(held))
        ids = mgr.alloc(count)
        if ids is None:
            raise RuntimeError(
                f"alloc({count}) returned None after {len(held)} of {want} blocks "
                f"(available_size()={mgr.available_size()})"
            )
        held += ids
    synchronize()
    return time.perf_counter() - start


def shrink(mgr: Any, held: list[int]) -> float:
    """Seconds to free ``held`` and unmap every page (``held`` is emptied first: nothing is freed twice)."""
    blocks = held.copy()
    held.clear()
    synchronize()
    start = time.perf_counter()
    mgr.free(blocks)
    mgr.trim()
    synchronize()
    return time.perf_counter() - start


def rate(total_bytes: int, seconds: float) -> float | None:
    return round(total_bytes / GiB / seconds, 2) if seconds > 0 else None


def reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def run_once(peer: Peer, total: int, pattern: str, per_call: int, start: str) -> dict[str, Any]:
    """One run of ``pattern`` on a fresh manager (and the shrink after ``request``), then a full release.
    Pattern failures come back as ``error``/``shrink_error``; a failed release raises ReleaseError."""
    out: dict[str, Any] = {}
    held: list[int] = []
    try:
        mgr = peer.manager(total)
    except Exception as exc:  # e.g. a geometry the peer refuses
        out["error"] = f"the manager could not be made: {reason(exc)}"
        return out
    try:
        try:
            out["premapped"], out["settle_timed_out"] = peer.settle(mgr, start)
            out["seconds"] = grow(mgr, per_call, held)
            out["mapped"] = peer.mapped_bytes(mgr)
        except Exception as exc:
            out["error"] = reason(exc)
            return out
        if pattern == "request":
            try:
                out["shrink_seconds"] = shrink(mgr, held)
                out["mapped_after_shrink"] = peer.mapped_bytes(mgr)
            except Exception as exc:
                out["shrink_error"] = reason(exc)
        return out
    finally:
        peer.release(mgr, held)
        del mgr
        out["destroyed"] = peer.wait_gone()


def summary(samples: list[float], mapped: int) -> dict[str, Any]:
    seconds = statistics.median(samples)
    return {
        "ms": round(seconds * 1e3, 1),
        "seconds": round(seconds, 6),
        "gib_s": rate(mapped, seconds),
        "runs": len(samples),
    }


def measure(peer: Peer, gib: int, repeats: int, start: str) -> dict[str, Any]:
    """Each pattern ``repeats`` times on fresh managers, alternating; the median run of each is reported. A
    pattern that fails once is not tried again and reports why."""
    total = gib * GiB
    result: dict[str, Any] = {"bytes": total, "page_bytes": peer.page_bytes}
    runs: dict[str, list[float]] = {"alloc1": [], "request": [], "shrink": []}
    errors: dict[str, str] = {}
    mapped = 0
    premapped: list[int] = []
    after_shrink: list[int] = []
    settle_timeouts = 0
    not_destroyed = 0
    for _ in range(repeats):
        for pattern, per_call in (("alloc1", 1), ("request", REQUEST_BLOCKS)):
            if pattern in errors:
                continue
            one = run_once(peer, total, pattern, per_call, start)
            premapped.append(one.get("premapped", 0))
            settle_timeouts += int(one.get("settle_timed_out", False))
            not_destroyed += int(not one.get("destroyed", True))
            if "error" in one:
                errors[pattern] = one["error"]
                if pattern == "request":
                    errors.setdefault("shrink", "not measured: the request pattern failed")
                continue
            mapped = one["mapped"]
            runs[pattern].append(one["seconds"])
            if pattern == "request" and "shrink" not in errors:
                if "shrink_error" in one:
                    errors["shrink"] = one["shrink_error"]
                else:
                    runs["shrink"].append(one["shrink_seconds"])
                    after_shrink.append(one["mapped_after_shrink"])
    for pattern, samples in runs.items():
        entry: dict[str, Any] = summary(samples, mapped) if samples else {"runs": 0}
        if pattern in errors:
            entry["error"] = errors[pattern]
        result[pattern] = entry
    result["mapped"] = mapped
    result["premapped_bytes"] = max(premapped, default=0)
    result["mapped_after_shrink"] = max(after_shrink, default=None)
    result["settle_timeouts"] = settle_timeouts
    result["managers_alive_after_release"] = not_destroyed
    result["floor_gib_s"] = None  # see the module docstring: growth.py's report of the same run has it
    return result


# ---- machine, environment, output ----------------------------------------------------------------


def driver_version() -> str | None:
    """The NVIDIA driver's version: nvidia-smi's, else the kernel module's."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        lines = done.stdout.split()
        if lines:
            return lines[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            return " ".join(fh.readline().split())
    except OSError:
        return None


def machine_info(device: str) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(device)
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return {
        **host_info(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu_name": torch.cuda.get_device_name(device),
        "gpu_driver": driver_version(),
        "gpu_mem_total_bytes": int(props.total_memory),
        "device_mem_total_bytes": int(total_bytes),
        "device_mem_free_bytes_at_end": int(free_bytes),
    }


def prepare_environment(layout: str) -> dict[str, str | None]:
    """Set what the peer reads from the environment when it is imported; returns what was changed."""
    changed: dict[str, str | None] = {}
    # The peer's default page: a page size set for our own runs must not leak into the peer's.
    if "KVCACHED_PAGE_SIZE_MB" in os.environ:
        changed["KVCACHED_PAGE_SIZE_MB"] = f"unset (was {os.environ.pop('KVCACHED_PAGE_SIZE_MB')!r})"
    if layout != "default":
        os.environ["KVCACHED_CONTIGUOUS_LAYOUT"] = "true" if layout == "contiguous" else "false"
        changed["KVCACHED_CONTIGUOUS_LAYOUT"] = os.environ["KVCACHED_CONTIGUOUS_LAYOUT"]
    # Warnings only: at INFO the peer logs on every page it maps, which would be part of the timing.
    if "KVCACHED_LOG_LEVEL" not in os.environ:
        os.environ["KVCACHED_LOG_LEVEL"] = changed["KVCACHED_LOG_LEVEL"] = "WARNING"
    # A shared-memory name of this process alone (the peer derives one from the process group otherwise).
    if "KVCACHED_IPC_NAME" not in os.environ:
        os.environ["KVCACHED_IPC_NAME"] = changed["KVCACHED_IPC_NAME"] = f"kvcached_growth_peer_{os.getpid()}"
    return changed


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send whatever the peer prints (its C++ banner, its IPC listener) to stderr: stdout carries the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def cuda_device(text: str) -> str:
    """argparse type: 'cuda' or 'cuda:N', as 'cuda:N'."""
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: the peer runs on CUDA only; give cuda or cuda:N")
    return f"cuda:{int(index) if index else 0}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Burst growth and shrink bandwidth of the peer project's KV cache manager (ovg-project's 'kvcached' "
            "package, not our kvcached_core), with the geometry, workloads and JSON shape of benchmarks/growth.py: "
            "16 layers x K/V of 16 KiB blocks, the peer's default 2 MiB pages; alloc(1) and alloc(128) from empty "
            "to N GiB, then free + trim. Prints one JSON object."
        ),
        epilog=(
            "The peer must come first on PYTHONPATH (python3 -c 'import kvcached' must resolve to it), e.g. "
            "bash benchmarks/gpu/peer/build_peer.sh .peer-src /tmp/peer-kv && PYTHONPATH=/tmp/peer-kv:/tmp/kv python3 "
            "benchmarks/gpu/peer/growth_peer.py --out peer.json. Exit status: 0 done (a pattern the peer cannot "
            "do is reported in the JSON), 1 a run could not be completed (JSON with 'error'), 2 no CUDA device "
            "or no peer package."
        ),
    )
    parser.add_argument("--device", type=cuda_device, default="cuda:0", help="cuda or cuda:N (default: cuda:0)")
    parser.add_argument(
        "--sizes-gib", "--gib", type=positive_int, nargs="+", default=[1, 4, 16], help="sizes in GiB (default 1 4 16)"
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of each pattern; the median is kept (3)")
    parser.add_argument(
        "--layout",
        choices=("default", "contiguous", "per-layer"),
        default="default",
        help="the peer's KV layout: its default (contiguous on CUDA: one 64 MiB handle per page id here), "
        "contiguous, or per-layer (32 handles of 2 MiB per page id); sets KVCACHED_CONTIGUOUS_LAYOUT",
    )
    parser.add_argument(
        "--start",
        choices=("empty", "idle"),
        default="empty",
        help="empty: unmap the pages the peer maps ahead before the clock starts (default); idle: keep them",
    )
    parser.add_argument("--peer-commit", metavar="SHA", help="the peer's git commit, recorded in the JSON")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE")
    return parser


def check_cuda(device: str) -> None:
    try:
        import torch
    except Exception as exc:
        raise Unavailable(f"torch cannot be imported ({reason(exc)})") from None
    if not torch.cuda.is_available():
        raise Unavailable(
            f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none; the peer needs one"
        )
    index = int(device.partition(":")[2])
    if index >= torch.cuda.device_count():
        raise Unavailable(f"no device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")


def run(args: argparse.Namespace, peer: Peer, report: dict[str, Any]) -> None:
    """Warm-up, then every size; fills ``report['results']`` as it goes."""
    max_blocks = max(args.sizes_gib) * GiB // (BLOCK_BYTES * LAYERS * KV)
    peer.open(args.device, max_blocks)
    # The first manager of a process pays one-time costs (the driver, the peer's first faults) that would
    # land on whichever measurement came first.
    warm = run_once(peer, WARM_BYTES, "request", REQUEST_BLOCKS, args.start)
    if "error" in warm or "shrink_error" in warm:
        raise RuntimeError(f"warm-up failed: {warm.get('error') or warm.get('shrink_error')}")
    page_mib = peer.page_bytes // MiB
    for gib in args.sizes_gib:  # keyed "<GiB>G/<page MiB>M", as growth.py
        report["results"][f"{gib}G/{page_mib}M"] = measure(peer, gib, args.repeats, args.start)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.time()
    try:
        check_cuda(args.device)
        changed_env = prepare_environment(args.layout)
        with stdout_to_stderr():
            peer = Peer()
    except Unavailable as exc:
        print(f"{PROG}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "benchmark": "growth_peer",
        "implementation": "peer: ovg-project/kvcached (package 'kvcached')",
        "device": args.device,
        "machine": {},
        "peer": peer.describe(args.peer_commit),
        "environment": {
            "set_by_this_script": changed_env,
            "KVCACHED": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVCACHED_")},
        },
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv),
        "parameters": {
            "layers": LAYERS,
            "kv_buffers": KV,
            "block_bytes": BLOCK_BYTES,
            "block_tokens": BLOCK_TOKENS,
            "cell_bytes": CELL_BYTES,
            "request_blocks": REQUEST_BLOCKS,
            "repeats": args.repeats,
            "start": args.start,
            "layout": args.layout,
            "timing": "wall clock between torch.cuda.synchronize() calls",
            "floor": "not measured here: use floor_gib_s of benchmarks/growth.py run on the same GPU",
        },
        "duration_s": None,
        "results": {},
    }
    status = 0
    with stdout_to_stderr():
        try:
            run(args, peer, report)
        except Exception as exc:  # set-up, warm-up or a release failed: what was measured so far stays
            report["error"] = reason(exc)
            status = 1
        try:
            report["machine"] = machine_info(args.device)
        except Exception as exc:
            report["machine"] = {"error": reason(exc)}
    report["duration_s"] = round(time.time() - started, 1)
    print(write_report(report, args.out), flush=True)
    # After the report: a failure while the peer tears down cannot cost the numbers.
    with stdout_to_stderr(), contextlib.suppress(Exception):
        peer.close()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
