"""Burst growth: how fast a manager goes from nothing mapped to N GiB of KV blocks, how fast it gives them
back, and how that compares with the fastest way the device has to make the same bytes usable.

    python benchmarks/growth.py [--device cpu|cuda[:N]] [--gib 1 4 16] [--page-mib 2 ...]
                                [--layout engine block-outer] [--json] [--out FILE]

For each size, page size (``--page-mib``, default 2: what a coarser page buys in bandwidth and costs in
elasticity) and layout, on a fresh manager (the pool at its default target) of 16 layers' K and V:

- layout ``engine`` (default): 32 buffers of 16 KiB blocks, one per layer and K/V (vLLM's own layout): a page
  id is a page in each of the 32 buffers, so the unit given back is 32 pages;
- layout ``block-outer``: one buffer of 512 KiB blocks, every layer's K and V of a block side by side
  (``KVCACHED_KV_LAYOUT=block-outer``): the unit given back is one page.

The patterns:

- ``alloc1``: ``alloc(1)`` repeated until the blocks of N GiB are held (an engine's decode steps);
- ``request``: ``alloc(128)`` repeated, one 2048-token request of 16-token blocks at a time (a prefill burst);
- ``shrink``: ``free`` of everything held, then ``trim`` (what an engine going idle gives back);
- ``floor``: the device's fastest way to make N GiB usable, measured in the same run: on CUDA, the median
  cost of cuMemMap + cuMemSetAccess of one handle of the largest size tried (32 MiB and 512 MiB; created
  ahead, as kvcached's pool does), scaled to N GiB; on the host, one mmap of N GiB with MAP_POPULATE.

Each figure is the median of ``--repeats`` runs on fresh managers, in GiB/s of mapped memory, with its ratio to
the floor. Prints a table, or JSON.
"""

from __future__ import annotations

import mmap
import statistics
import time
from collections.abc import Sequence
from typing import Any

# Shared with the other benchmarks here (this script's directory is sys.path[0]).
from _common import benchmark_parser, report_head, write_report

import kvcached_core
from kvcached_core import KVCacheManager, _native
from kvcached_core.backends import parse_device

GiB = 1 << 30
MiB = 1 << 20
LAYERS, KV = 16, 2
BLOCK_BYTES = 16 * 1024  # per buffer: 16 tokens of a 8-head x 64-dim fp16 layer
REQUEST_BLOCKS = 128  # a 2048-token request of 16-token blocks
GEOMETRY = {"layers": LAYERS, "kv_buffers": KV, "block_bytes": BLOCK_BYTES, "request_blocks": REQUEST_BLOCKS}
# layout -> (buffers' layers, K/V buffers per layer, bytes of one block in a buffer): the same KV either way.
LAYOUTS = {"engine": (LAYERS, KV, BLOCK_BYTES), "block-outer": (1, 1, LAYERS * KV * BLOCK_BYTES)}
FLOOR_HANDLES = (32 * MiB, 512 * MiB)
FLOOR_ITERATIONS = 8


def make_manager(device: str, total_bytes: int, page_bytes: int, layout: str = "engine") -> KVCacheManager:
    """A manager whose blocks fill exactly ``total_bytes`` of mapped memory when all are held."""
    layers, kv, block_bytes = LAYOUTS[layout]
    num_blocks = total_bytes // (block_bytes * layers * kv)
    return KVCacheManager(
        num_blocks, block_bytes, layers, kv, device=device, name="bench-growth", page_bytes=page_bytes
    )


def grow(mgr: KVCacheManager, per_call: int) -> tuple[float, list[int]]:
    """Seconds to hold every block, ``per_call`` blocks per alloc, and the ids held."""
    held: list[int] = []
    want = mgr.num_blocks
    start = time.perf_counter()
    while len(held) < want:
        ids = mgr.alloc(min(per_call, want - len(held)))
        if ids is None:
            raise RuntimeError(f"alloc missed after {len(held)} of {want} blocks: the device is short of memory")
        held += ids
    return time.perf_counter() - start, held


def shrink(mgr: KVCacheManager, held: list[int]) -> float:
    """Seconds to free ``held`` and unmap every page."""
    start = time.perf_counter()
    mgr.free(held)
    mgr.trim()
    return time.perf_counter() - start


def rate(total_bytes: int, seconds: float) -> float:
    return round(total_bytes / GiB / seconds, 2)


def cuda_floor_gib_s(device: str) -> dict[str, Any]:
    """GiB/s of map + access over handles created ahead, per handle size, from bare driver calls."""
    _, index = parse_device(device)
    out: dict[str, Any] = {}
    for handle in FLOOR_HANDLES:
        f = _native._cuda_driver_floor(index, handle, FLOOR_ITERATIONS)
        per_handle_us = sorted(m + a for m, a in zip(f["cuMemMap"], f["cuMemSetAccess"], strict=True))
        median_us = per_handle_us[len(per_handle_us) // 2]
        out[f"{handle // MiB}MiB"] = round(handle / GiB / (median_us / 1e6), 1)
    return out


def host_floor_gib_s(total_bytes: int) -> float:
    """GiB/s of one populated anonymous mapping of ``total_bytes`` (the kernel's fastest way to hand out
    that much zeroed memory)."""
    start = time.perf_counter()
    region = mmap.mmap(-1, total_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    seconds = time.perf_counter() - start
    region.close()
    return rate(total_bytes, seconds)


def measure(
    device: str, gib: int, page_bytes: int, repeats: int, floor: dict[str, Any] | None, layout: str = "engine"
) -> dict[str, Any]:
    """Each pattern ``repeats`` times on fresh managers, alternating; the median run of each is reported."""
    total = gib * GiB
    layers, kv, _ = LAYOUTS[layout]
    result: dict[str, Any] = {"bytes": total, "page_bytes": page_bytes, "layout": layout}
    result["unit_bytes"] = page_bytes * layers * kv  # what one page id maps, and gives back
    runs: dict[str, list[float]] = {"alloc1": [], "request": [], "shrink": []}
    mapped = 0
    for _ in range(repeats):
        for pattern, per_call in (("alloc1", 1), ("request", REQUEST_BLOCKS)):
            with make_manager(device, total, page_bytes, layout) as mgr:
                seconds, held = grow(mgr, per_call)
                mapped = mgr.snapshot()["mapped_bytes"]
                runs[pattern].append(seconds)
                if pattern == "request":
                    runs["shrink"].append(shrink(mgr, held))
    for pattern, samples in runs.items():
        seconds = statistics.median(samples)
        result[pattern] = {"ms": round(seconds * 1e3, 1), "gib_s": rate(mapped, seconds), "runs": len(samples)}
    result["mapped"] = mapped
    best = max(floor.values()) if floor else host_floor_gib_s(total)
    result["floor_gib_s"] = floor if floor else best
    for pattern in ("alloc1", "request"):
        result[pattern]["floor_over_growth"] = round(best / result[pattern]["gib_s"], 1)
    return result


def format_table(report: dict[str, Any]) -> str:
    lines = [f"growth on {report['device']} (GiB/s of mapped memory; floor/growth: how far from the device's best)"]
    lines.append(
        f"{'run':>19} {'unit MiB':>8} {'alloc(1)':>10} {'x floor':>8} {'alloc(128)':>11} {'x floor':>8} "
        f"{'shrink':>8} floor"
    )
    for run, r in report["results"].items():
        lines.append(
            f"{run:>19} {r['unit_bytes'] // MiB:>8} {r['alloc1']['gib_s']:>10} {r['alloc1']['floor_over_growth']:>8} "
            f"{r['request']['gib_s']:>11} {r['request']['floor_over_growth']:>8} {r['shrink']['gib_s']:>8} "
            f"{r['floor_gib_s']}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser("Burst growth and shrink bandwidth of a kvcached manager, against the device floor.")
    parser.add_argument("--gib", type=int, nargs="+", default=[1, 4, 16], help="sizes in GiB (default 1 4 16)")
    parser.add_argument("--page-mib", type=int, nargs="+", default=[2], help="page sizes in MiB (default 2)")
    parser.add_argument(
        "--layout", nargs="+", choices=sorted(LAYOUTS), default=["engine"], help="KV layouts to measure (engine)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each pattern; the median is kept (3)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and "cuda" not in kvcached_core.available_backends():
        parser.error(f"device {args.device} unavailable: {kvcached_core.cuda_unavailable_reason()}")
    started = time.time()
    # The first manager of a process pays one-time costs (the backend, the driver or the allocator's own
    # first faults) that would land on whichever measurement came first.
    with make_manager(args.device, 256 * MiB, 2 * MiB) as warm:
        shrink(warm, grow(warm, REQUEST_BLOCKS)[1])
    floor = cuda_floor_gib_s(args.device) if args.device.startswith("cuda") else None
    # Keyed "<GiB>G/<page MiB>M", with "/block-outer" for that layout.
    results = {
        f"{g}G/{p}M" + ("" if layout == "engine" else f"/{layout}"): measure(
            args.device, g, p * MiB, args.repeats, floor, layout
        )
        for layout in args.layout
        for p in args.page_mib
        for g in args.gib
    }
    report = {
        **report_head("growth", args.device),
        "parameters": GEOMETRY,
        "duration_s": round(time.time() - started, 1),
        "results": results,
    }
    text = write_report(report, args.out)
    print(text if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
