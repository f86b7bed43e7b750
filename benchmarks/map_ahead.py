"""Stepwise growth with compute between the steps: what the caller pays per allocation without and with
``map_ahead_pages`` (KVCACHED_MAP_AHEAD_PAGES).

    python benchmarks/map_ahead.py [--device cpu|cuda[:N]] [--ahead 0 2 8] [--steps 64] [--gap-ms 5]
                                   [--page-mib 2] [--json] [--out FILE]

A serving engine admits requests one scheduler step at a time while the GPU computes in between. Here a
fresh manager (16 layers x K/V = 32 buffers of 16 KiB blocks) takes one 2048-token request of 16-token blocks
(``alloc(128)``) per step, then sleeps ``--gap-ms`` (the step's compute), ``--steps`` times, and nothing is
freed: the KV cache grows the whole time. Without mapping ahead, every step that crosses into a new page maps
it on the caller's path (with 2 MiB pages a request is one new page in each buffer); with it, the reclaimer
thread maps pages during the gaps. Reported per setting: the caller's time per ``alloc`` (median, p99, max,
in us) and the pages mapped and used at the end (the pages mapped ahead and not yet used). The default
64 steps map 4 GiB; on a GPU, ``--steps 256``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

# Shared with the other benchmarks here (this script's directory is sys.path[0]).
from _common import benchmark_parser, report_head, summarize, write_report
from growth import BLOCK_BYTES, GEOMETRY, KV, LAYERS, REQUEST_BLOCKS  # the same manager geometry

import kvcached_core
from kvcached_core import KVCacheManager

MiB = 1 << 20


def run(device: str, ahead: int, steps: int, gap_s: float, page_bytes: int) -> dict[str, Any]:
    """One manager growing by a request per step; the caller's time per alloc and what it mapped."""
    with KVCacheManager(
        steps * REQUEST_BLOCKS + 1,
        BLOCK_BYTES,
        LAYERS,
        KV,
        device=device,
        name="bench-map-ahead",
        page_bytes=page_bytes,
        reserved_pages=0,
        map_ahead_pages=ahead,
        reclaim_delay_ms=600_000,  # nothing is given back during the run
    ) as mgr:
        times_us: list[float] = []
        for _ in range(steps):
            start = time.perf_counter_ns()
            ids = mgr.alloc(REQUEST_BLOCKS)
            times_us.append((time.perf_counter_ns() - start) / 1000)
            if ids is None:
                raise SystemExit(f"map_ahead.py: {device} ran out of memory after {len(times_us)} steps")
            time.sleep(gap_s)
        snap = mgr.snapshot()
        return {
            "map_ahead_pages": ahead,
            "alloc_us": summarize(times_us) | {"max": round(max(times_us), 1)},
            "mapped_pages": snap["mapped_pages"],
            "used_pages": snap["used_pages"],
        }


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser("What a growing engine pays per allocation without and with mapping ahead.")
    parser.add_argument("--ahead", type=int, nargs="+", default=[0, 2, 8], help="map_ahead_pages to try (0 2 8)")
    parser.add_argument("--steps", type=int, default=64, help="allocations of one request each (64)")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="compute between two steps, in ms (5)")
    parser.add_argument("--page-mib", type=int, default=2, help="page size in MiB (2)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and "cuda" not in kvcached_core.available_backends():
        parser.error(f"device {args.device} unavailable: {kvcached_core.cuda_unavailable_reason()}")
    if args.steps <= 0 or args.gap_ms < 0 or args.page_mib <= 0 or min(args.ahead) < 0:
        parser.error("--steps and --page-mib must be positive, --gap-ms and --ahead not negative")
    started = time.time()
    run(args.device, 0, 8, 0.0, args.page_mib * MiB)  # one-time costs of the first manager land here
    results = {
        f"ahead={a}": run(args.device, a, args.steps, args.gap_ms / 1000, args.page_mib * MiB) for a in args.ahead
    }
    report = {
        **report_head("map_ahead", args.device),
        "parameters": {
            **GEOMETRY,
            "steps": args.steps,
            "gap_ms": args.gap_ms,
            "page_bytes": args.page_mib * MiB,
        },
        "duration_s": round(time.time() - started, 1),
        "results": results,
    }
    text = write_report(report, args.out)
    if args.json:
        print(text)
    else:
        print(f"caller's time per alloc({REQUEST_BLOCKS}) on {args.device}, {args.gap_ms} ms between steps")
        for name, r in results.items():
            a = r["alloc_us"]
            print(f"{name:>9}: median {a['median']:>8} us  p99 {a['p99']:>9} us  max {a['max']:>9} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
