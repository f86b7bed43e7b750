"""Microbenchmark of the kvcached-core hot path and of the page map/unmap path.

Run it from the repository root with the package installed::

    python benchmarks/alloc_free.py --device cpu --json --out benchmarks/results/alloc_free_cpu.json
    python benchmarks/alloc_free.py --device cuda:0 --json

What it measures, all through ``kvcached_core.KVCacheManager``:

* ``pair_us``: one ``free(alloc(k))`` pair from Python for k = 1, 16, 128 blocks on pages that are
  already mapped (the steady state of a serving engine). Timed in batches with ``perf_counter_ns``;
  the per-pair time of each batch is one sample. ``pair_loop_baseline_us`` is the same loop calling
  trivial builtins instead: it shows the interpreter's share, and is *not* subtracted from the headline.
* ``available_size_us``: one ``available_size()`` call (same batch method; its baseline is
  ``available_size_loop_baseline_us``).
* ``page_usable_warm_us`` / ``page_usable_cold_us``: one ``alloc(1)`` that has to map one new physical
  page, with the pool thread's handles ready (warm) or with no pool (cold: the handle is created on the
  caller's path). Calls run back to back, like the driver floor's.
* ``page_unmap_us``: one ``trim()`` that fences and unmaps one empty page.
* ``footprint``: mapped vs used bytes while blocks are held, after freeing them, and after ``trim()``.
* ``driver_floor_us`` (CUDA only): bare cuMemMap + cuMemSetAccess for one page, measured in the same run,
  and ``map_to_floor_ratio`` = warm page-usable median / that floor.

With ``--json`` the result is printed as JSON; otherwise as a short table. ``--out FILE`` always writes
JSON. The garbage collector is disabled inside timed loops (as ``timeit`` does). The whole run takes a
few seconds on a small machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

# Shared with the other benchmarks here (this script's directory is sys.path[0]).
from _common import (
    LONG_RECLAIM_DELAY_MS,
    PAIR_MANAGER,
    benchmark_parser,
    machine_info,
    make_pair_manager,
    positive_int,
    summarize,
    time_call_batches,
    time_once_us,
    time_pair_batches,
    write_report,
)

import kvcached_core
from kvcached_core import KVCacheManager
from kvcached_core.backends import parse_device

PAIR_SIZES: tuple[tuple[int, int], ...] = ((1, 20000), (16, 5000), (128, 1000))  # (k, iterations/batch)
AVAILABLE_SIZE_ITERATIONS = 100000
FOOTPRINT_BLOCKS = 1000
POOL_TARGET = 64
POOL_WAIT_TIMEOUT_S = 30.0
FLOOR_ITERATIONS = 32
FLOOR_ROUNDS = 4  # alternating rounds of floor and warm samples on CUDA

# ---- managers -------------------------------------------------------------------------------------


def make_page_manager(
    device: str, page_bytes: int, num_blocks: int, *, pool_target: int, pool_max: int, reserved_pages: int
) -> KVCacheManager:
    """A manager whose block is exactly one page in one buffer, so every alloc(1) maps one physical page."""
    return KVCacheManager(
        num_blocks=num_blocks,
        block_bytes=page_bytes,
        num_layers=1,
        num_kv_buffers=1,
        device=device,
        name="bench-page",
        page_bytes=page_bytes,
        reserved_pages=reserved_pages,
        reclaim_delay_ms=LONG_RECLAIM_DELAY_MS,
        pool_target=pool_target,
        pool_max=pool_max,
    )


def checked_alloc(mgr: KVCacheManager, count: int, why: str) -> list[int]:
    """``mgr.alloc(count)``, raising with the snapshot when it unexpectedly returns None or a wrong list."""
    ids = mgr.alloc(count)
    if ids is None or len(ids) != count:
        raise RuntimeError(f"alloc({count}) for {why} returned {ids!r}; snapshot: {mgr.snapshot()}")
    return ids


def wait_for_pool(mgr: KVCacheManager, target: int, timeout_s: float = POOL_WAIT_TIMEOUT_S) -> None:
    """Poll until the pool thread holds ``target`` ready handles; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while mgr.snapshot()["pool_ready_handles"] < target:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"pool did not reach {target} ready handles in {timeout_s} s; snapshot: {mgr.snapshot()}"
            )
        time.sleep(0.001)


# ---- measurements ---------------------------------------------------------------------------------


def warm_up_pages(mgr: KVCacheManager, blocks: int) -> None:
    """Allocate and free ``blocks`` so their pages are mapped and stay mapped (within the reserve)."""
    mgr.free(checked_alloc(mgr, blocks, "warm-up"))


def measure_pairs(mgr: KVCacheManager, batches: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``free(alloc(k))`` per pair for each k, and the same loop over trivial builtins (abs, id)."""
    alloc, free = mgr.alloc, mgr.free
    pairs: dict[str, Any] = {}
    baselines: dict[str, Any] = {}
    for k, iterations in PAIR_SIZES:
        free(checked_alloc(mgr, k, f"pair k={k} check"))
        time_pair_batches(alloc, free, k, iterations // 10, 2)  # warm caches and branch predictors
        pairs[str(k)] = summarize(time_pair_batches(alloc, free, k, iterations, batches))
        pairs[str(k)]["iterations_per_batch"] = iterations
        baselines[str(k)] = summarize(time_pair_batches(abs, id, k, iterations, batches))
    return pairs, baselines


def measure_available_size(mgr: KVCacheManager, batches: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``available_size()`` per call, and a bound no-argument builtin method as the loop baseline."""
    call = mgr.available_size
    time_call_batches(call, AVAILABLE_SIZE_ITERATIONS // 10, 2)
    result = summarize(time_call_batches(call, AVAILABLE_SIZE_ITERATIONS, batches))
    result["iterations_per_batch"] = AVAILABLE_SIZE_ITERATIONS
    baseline = summarize(time_call_batches((0).bit_length, AVAILABLE_SIZE_ITERATIONS, batches))
    return result, baseline


def measure_page_usable(device: str, page_bytes: int, samples: int, *, warm: bool) -> dict[str, Any]:
    """Microseconds of an alloc(1) that maps one new page, with a full pool (warm) or no pool (cold).

    The calls run back to back, as the driver floor's calls do (here, a pause of a millisecond before
    each call made it up to several times slower, so spaced-out calls would not compare with the
    floor). Warm: the pool is filled once to a target of at least every call made, so each call takes a
    ready handle, as after a quiet spell in serving. Cold: no pool thread, so each call creates its
    physical memory on the caller's path.
    """
    warmup = 2
    target = max(POOL_TARGET, samples + warmup) if warm else 0
    mgr = make_page_manager(device, page_bytes, samples + warmup, pool_target=target, pool_max=target, reserved_pages=0)
    try:
        if warm:
            wait_for_pool(mgr, target)
        alloc, clock = mgr.alloc, time.perf_counter_ns
        times: list[float] = []
        for i in range(samples + warmup):
            start = clock()
            ids = alloc(1)
            elapsed = (clock() - start) / 1000.0
            if ids is None:
                raise RuntimeError(f"alloc(1) #{i} (a new page) returned None; snapshot: {mgr.snapshot()}")
            if i >= warmup:
                times.append(elapsed)
        mapped = mgr.snapshot()["mapped_pages"]
        if mapped != samples + warmup:
            raise RuntimeError(f"expected {samples + warmup} mapped pages after as many alloc(1): {mapped}")
        result: dict[str, Any] = summarize(times)
        result["pool_target"] = target
        result["times_us"] = times
        return result
    finally:
        mgr.close()


def measure_page_unmap(device: str, page_bytes: int, samples: int) -> dict[str, Any]:
    """Microseconds of a ``trim()`` that fences and unmaps exactly one empty page.

    The pool is back at its target before each timed call, so the pool thread creating a handle (which
    competes for the CPU and, on the host, for the process's address space) does not overlap it.
    """
    pool_target = 4
    mgr = make_page_manager(device, page_bytes, 2, pool_target=pool_target, pool_max=16, reserved_pages=0)
    expected = page_bytes  # one buffer per page
    try:
        times: list[float] = []
        for i in range(samples + 2):
            mgr.free(checked_alloc(mgr, 1, "unmap sample"))
            wait_for_pool(mgr, pool_target)
            elapsed, unmapped = time_once_us(mgr.trim)
            if unmapped != expected:
                raise RuntimeError(f"trim() #{i} unmapped {unmapped} bytes, expected {expected}")
            if i >= 2:
                times.append(elapsed)
        return summarize(times)
    finally:
        mgr.close()


def footprint_entry(mgr: KVCacheManager) -> dict[str, int]:
    """The occupancy figures of one snapshot that describe the memory footprint."""
    snap = mgr.snapshot()
    keys = ("allocated_blocks", "mapped_pages", "used_pages", "mapped_bytes", "used_bytes")
    return {key: snap[key] for key in keys}


def measure_footprint(mgr: KVCacheManager, blocks: int) -> dict[str, Any]:
    """Mapped vs used bytes while ``blocks`` are held, after freeing them, and after ``trim()``."""
    ids = checked_alloc(mgr, blocks, "footprint")
    holding = footprint_entry(mgr)
    holding["mapped_over_used"] = round(holding["mapped_bytes"] / holding["used_bytes"], 4)
    mgr.free(ids)
    after_free = footprint_entry(mgr)
    trimmed_bytes = mgr.trim()
    after_trim = footprint_entry(mgr)
    after_trim["trim_returned_bytes"] = trimmed_bytes
    return {"holding": holding, "after_free": after_free, "after_free_and_trim": after_trim}


def measure_driver_floor(device_index: int, page_bytes: int, iterations: int = FLOOR_ITERATIONS) -> dict[str, Any]:
    """Per-call microseconds of each bare driver call for ``iterations`` pages (lists, one value a page)."""
    return kvcached_core._native._cuda_driver_floor(device_index, page_bytes, iterations)


def measure_warm_vs_floor(device: str, page_bytes: int, samples: int, rounds: int = FLOOR_ROUNDS) -> dict[str, Any]:
    """The warm page-usable time and the driver floor, measured in alternating rounds.

    Both drift with the GPU's and driver's state over a run; alternating ``rounds`` short rounds of each
    and pooling the samples compares them under the same conditions. Returns the warm summary, the
    floor's per-call medians (``floor_us`` = cuMemMap + cuMemSetAccess) and their ratio.
    """
    _, index = parse_device(device)
    per_round = max(1, samples // rounds)
    floor_raw: dict[str, list[float]] = {}
    warm: list[float] = []
    for _ in range(rounds):
        for name, values in measure_driver_floor(index, page_bytes, per_round).items():
            floor_raw.setdefault(name, []).extend(values)
        warm.extend(measure_page_usable(device, page_bytes, per_round, warm=True)["times_us"])
    floor: dict[str, Any] = {name: round(statistics.median(values), 4) for name, values in floor_raw.items()}
    floor["floor_us"] = round(floor["cuMemMap"] + floor["cuMemSetAccess"], 4)
    floor["iterations"] = per_round * rounds
    floor["rounds"] = rounds
    warm_summary = summarize(warm)
    ratio = round(warm_summary["median"] / floor["floor_us"], 4)
    return {"warm": warm_summary, "floor": floor, "ratio": ratio}


# ---- report ---------------------------------------------------------------------------------------


def evaluate_targets(results: dict[str, Any]) -> dict[str, bool | None]:
    """The project's performance targets, as pass/fail (None where not measurable on this device)."""
    ratio = results["map_to_floor_ratio"]
    return {
        "pair_k1_median_le_1us": results["pair_us"]["1"]["median"] <= 1.0,
        "available_size_le_0_2us": results["available_size_us"]["median"] <= 0.2,
        "map_to_floor_ratio_le_1_2": None if ratio is None else ratio <= 1.2,
    }


def run_all(device: str, batches: int, page_samples: int) -> dict[str, Any]:
    """Every measurement, in an order that keeps managers from disturbing each other; closes them all."""
    kind, index = parse_device(device)
    results: dict[str, Any] = {}
    pair_mgr = make_pair_manager(device)
    try:
        page_bytes = pair_mgr.page_bytes
        warm_up_pages(pair_mgr, FOOTPRINT_BLOCKS)
        results["page_bytes"] = page_bytes
        results["pair_us"], results["pair_loop_baseline_us"] = measure_pairs(pair_mgr, batches)
        results["available_size_us"], results["available_size_loop_baseline_us"] = measure_available_size(
            pair_mgr, batches
        )
        if kind == "cuda":
            compared = measure_warm_vs_floor(device, page_bytes, page_samples)
            results["page_usable_warm_us"] = compared["warm"]
            results["driver_floor_us"] = compared["floor"]
            results["map_to_floor_ratio"] = compared["ratio"]
        else:
            warm = measure_page_usable(device, page_bytes, page_samples, warm=True)
            warm.pop("times_us")
            results["page_usable_warm_us"] = warm
            results["driver_floor_us"] = None
            results["map_to_floor_ratio"] = None
        cold = measure_page_usable(device, page_bytes, page_samples, warm=False)
        cold.pop("times_us")
        results["page_usable_cold_us"] = cold
        results["page_unmap_us"] = measure_page_unmap(device, page_bytes, page_samples)
        results["footprint"] = measure_footprint(pair_mgr, FOOTPRINT_BLOCKS)
    finally:
        pair_mgr.close()
    results["targets"] = evaluate_targets(results)
    return results


def build_report(device: str, batches: int, page_samples: int) -> dict[str, Any]:
    """The full JSON document: metadata plus results."""
    started = dt.datetime.now(dt.timezone.utc)
    results = run_all(device, batches, page_samples)
    return {
        "benchmark": "alloc_free",
        "device": device,
        "machine": machine_info(device),
        "timestamp": started.isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "parameters": {
            "batches": batches,
            "page_samples": page_samples,
            "pair_manager": PAIR_MANAGER,
            "pool_target_warm": POOL_TARGET,
        },
        "duration_s": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds(), 2),
        "results": results,
    }


def format_table(report: dict[str, Any]) -> str:
    """A short human-readable summary of the report."""
    r = report["results"]
    rows = [(f"free(alloc({k}))", r["pair_us"][k]) for k in r["pair_us"]]
    rows += [(f"  loop baseline k={k}", r["pair_loop_baseline_us"][k]) for k in r["pair_loop_baseline_us"]]
    rows += [
        ("available_size()", r["available_size_us"]),
        ("  loop baseline", r["available_size_loop_baseline_us"]),
        ("page usable, warm pool", r["page_usable_warm_us"]),
        ("page usable, cold", r["page_usable_cold_us"]),
        ("page unmap (trim)", r["page_unmap_us"]),
    ]
    lines = [
        f"alloc_free on {report['device']} ({report['machine']['node']}), microseconds",
        f"{'':28}{'median':>12}{'p99':>12}",
    ]
    lines += [f"{name:28}{s['median']:>12.3f}{s['p99']:>12.3f}" for name, s in rows]
    if r["driver_floor_us"] is not None:
        lines.append(f"driver floor (map+access)   {r['driver_floor_us']['floor_us']:>12.3f}")
        lines.append(f"map / floor ratio           {r['map_to_floor_ratio']:>12.3f}")
    holding = r["footprint"]["holding"]
    lines.append(
        f"footprint holding {holding['allocated_blocks']} blocks: mapped {holding['mapped_bytes']} B, "
        f"used {holding['used_bytes']} B; after free+trim mapped "
        f"{r['footprint']['after_free_and_trim']['mapped_bytes']} B"
    )
    lines.append("targets: " + ", ".join(f"{k}={v}" for k, v in r["targets"].items()))
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; bad arguments exit with status 2 (argparse)."""
    parser = benchmark_parser(
        "Benchmark kvcached-core: alloc/free pairs, available_size(), page map and unmap, "
        "memory footprint, and (on CUDA) the driver floor."
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=20,
        metavar="N",
        help="timed batches per loop measurement; median and p99 are over these (default: 20)",
    )
    parser.add_argument(
        "--page-samples",
        type=positive_int,
        default=32,
        metavar="N",
        help="timed page map and unmap operations per measurement (default: 32)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print or write its report."""
    args = parse_args(argv)
    if args.device.startswith("cuda") and "cuda" not in kvcached_core.available_backends():
        print(f"device {args.device} unavailable: {kvcached_core.cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    report = build_report(args.device, args.repeats, args.page_samples)
    text = write_report(report, args.out)
    print(text if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
