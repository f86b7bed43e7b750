"""Does what the driver charges for a page depend on the address range it lands in? Prints JSON.

    python benchmarks/gpu/probe_ranges.py [--gib 16] [--gap-us 25] [--out FILE]

On an H100, growing 16 GiB of KV with 32 MiB pages cost 109 us a page in one buffer (kvcached's
``block-outer`` layout) but 75 us spread over 32 buffers (the ``engine`` layout), with the same number of
pages, handles and driver calls; at 1 GiB the two were 72 and 65 us. This probe makes the same bytes
usable with bare driver calls (ctypes, no kvcached code, handles created before the clock starts), the
pages laid out either way:

- ``one_range``: one reservation of every page, pages mapped in address order;
- ``per_buffer``: 32 reservations, pages mapped round-robin (page k of every buffer, then page k+1), as
  the engine layout grows;

each with a backstop (a zeroed handle mapped at every page beforehand, unmapped before the page's own map,
as kvcached does by default) and without. Per variant: microseconds per page and GiB/s. If ``one_range``
is slower with the backstop only, the cost is the driver's unmap of a range that maps one handle many
times; if slower in both, the driver charges per mapping already in a reservation; if neither, the
difference lies in kvcached.

The first H100 run (2026-12-07) found neither: 62 us a page in one range, 68 over 32 (both with the
backstop). What else differs is the rhythm: growing by ``alloc(1)``, the engine layout maps its 32 pages
back to back and then hands out 2048 blocks, where block-outer maps one page between every 64 blocks. So
``one_range_spaced`` maps one range with the backstop and ``--gap-us`` of CPU work (what 64 ``alloc(1)``
calls take) between pages, the gap not counted: if it costs more per page than ``one_range_backstop``, an
isolated map call costs the driver more than one in a run of calls.

The third H100 run found it does not (44.7 against 44.9 us). What mapping several pages together could
still save is calls: ``one_range_run{4,32}`` map one range with the backstop in runs of 4 and 32 pages, one
``cuMemUnmap`` of the run's backstop mappings, a ``cuMemMap`` per page, one ``cuMemSetAccess`` over the run.
If the driver charges the two range calls per handle in the range, these cost what ``one_range_backstop``
costs, and kvcached has nothing to gain from batching its map calls.
"""

from __future__ import annotations

import argparse
import time

from probe_slices import SLAB, Driver, open_driver, report

BUFFERS = 32


def busy(seconds: float) -> None:
    """Keep this thread on the CPU for ``seconds`` (a sleep would hand the core to others)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def grow(
    drv: Driver,
    ranges: list[int],
    pages_per_range: int,
    handles: list[int],
    backstop: int | None,
    gap_s: float = 0,
    run: int = 1,
) -> float:
    """Seconds to map ``handles`` over ``ranges`` round-robin (pages k..k+run-1 of every range, then the
    next run), the run's backstop mappings unmapped first by one call when there is a backstop and its
    access set by one call; ``gap_s`` of CPU work after each run is left out of the figure."""
    mapping = 0.0
    i = 0
    for k in range(0, pages_per_range, run):
        for base in ranges:
            addr = base + k * SLAB
            count = min(run, pages_per_range - k)
            start = time.perf_counter()
            if backstop is not None:
                drv.unmap(addr, count * SLAB)
            for j in range(count):
                drv.map(addr + j * SLAB, SLAB, handles[i + j])
            drv.set_access(addr, count * SLAB)
            mapping += time.perf_counter() - start
            i += count
            if gap_s:
                busy(gap_s)
    return mapping


def variant(
    drv: Driver, total: int, buffers: int, handles: list[int], backstop: int | None, gap_s: float = 0, run: int = 1
) -> dict:
    """One layout, grown once from empty; every mapping and reservation undone after."""
    per_range = total // buffers
    pages = per_range // SLAB
    ranges = [drv.reserve(per_range) for _ in range(buffers)]
    try:
        if backstop is not None:
            for base in ranges:
                for k in range(pages):
                    drv.map(base + k * SLAB, SLAB, backstop)
                drv.set_access(base, per_range)
        seconds = grow(drv, ranges, pages, handles, backstop, gap_s, run)
        for base in ranges:
            for k in range(pages):
                drv.unmap(base + k * SLAB, SLAB)
    finally:
        for base in ranges:
            drv.call("cuMemAddressFree", base, per_range)
    count = buffers * pages
    return {
        "pages": count,
        "us_per_page": round(seconds * 1e6 / count, 1),
        "gib_per_s": round(total / (1 << 30) / seconds, 1),
    }


def probe(drv: Driver, total: int, gap_us: float) -> dict:
    handles = [drv.create(SLAB) for _ in range(total // SLAB)]
    backstop = drv.create(SLAB)
    out: dict = {"bytes": total, "page_bytes": SLAB, "gap_us": gap_us}
    try:
        for name, buffers in (("one_range", 1), ("per_buffer", BUFFERS)):
            out[f"{name}_backstop"] = variant(drv, total, buffers, handles, backstop)
            out[name] = variant(drv, total, buffers, handles, None)
        out["one_range_spaced"] = variant(drv, total, 1, handles, backstop, gap_us / 1e6)
        for run in (4, 32):
            out[f"one_range_run{run}"] = variant(drv, total, 1, handles, backstop, run=run)
    finally:
        for h in handles + [backstop]:
            drv.call("cuMemRelease", h)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=16, help="bytes made usable by each variant (GiB, default 16)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument(
        "--gap-us", type=float, default=25.0, help="CPU work between pages in one_range_spaced (us, default 25)"
    )
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.gib < 1:
        parser.error("--gib must be at least 1")
    if args.gap_us < 0:
        parser.error("--gap-us must not be negative")
    drv = open_driver("probe_ranges", args.device)
    if drv is None:
        return 2
    report({"probe": "ranges", "device": args.device, "variants": probe(drv, args.gib << 30, args.gap_us)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
