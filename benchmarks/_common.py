"""What the benchmarks here share: statistics, timed loops, the machine they ran on, the command line every
one of them takes (--device, --json, --out) and writing the JSON report."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import kvcached_core
from kvcached_core import KVCacheManager
from kvcached_core.backends import get_backend, parse_device
from kvcached_core.config import Settings, load_settings

LONG_RECLAIM_DELAY_MS = 600_000  # keeps the background reclaimer out of the measurements

# The hot-path manager of alloc_free.py and control_plane.py's limit-check cost: 16 KiB blocks, 2 buffers, a
# reserve large enough that pages stay mapped. As the reports list it:
PAIR_MANAGER = {"num_blocks": 65536, "block_bytes": 16384, "num_layers": 1, "num_kv_buffers": 2, "reserved_pages": 64}


def make_pair_manager(device: str, settings: Settings | None = None) -> KVCacheManager:
    """The hot-path manager (``PAIR_MANAGER``), with the pool at its defaults (4 ready, at most 16)."""
    return KVCacheManager(
        **PAIR_MANAGER,
        device=device,
        name="bench-pair",
        page_bytes=0,
        reclaim_delay_ms=LONG_RECLAIM_DELAY_MS,
        pool_target=4,
        pool_max=16,
        settings=settings,
    )


# ---- statistics -----------------------------------------------------------------------------------


def summarize(samples_us: Sequence[float]) -> dict[str, float | int]:
    """Median and p99 (linear interpolation; with few samples p99 is close to the worst) of samples."""
    ordered = sorted(samples_us)
    rank = 0.99 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    p99 = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return {
        "median": round(statistics.median(ordered), 4),
        "p99": round(p99, 4),
        "min": round(ordered[0], 4),
        "samples": len(ordered),
    }


# ---- timed loops ----------------------------------------------------------------------------------


def time_pair_batches(
    alloc: Callable[[int], Any], free: Callable[[Any], Any], k: int, iterations: int, batches: int
) -> list[float]:
    """Per-call microseconds of ``free(alloc(k))``, one sample per batch of ``iterations`` calls.

    Pair and baseline share this exact loop, so their difference is only the callee.
    """
    samples: list[float] = []
    clock = time.perf_counter_ns
    loop = range(iterations)
    gc.disable()
    try:
        for _ in range(batches):
            start = clock()
            for _ in loop:
                free(alloc(k))
            samples.append((clock() - start) / iterations / 1000.0)
    except TypeError as exc:  # free(None): alloc failed inside the loop
        raise RuntimeError(f"alloc({k}) returned None inside the timed loop on mapped pages: {exc}") from exc
    finally:
        gc.enable()
    return samples


def time_call_batches(call: Callable[[], Any], iterations: int, batches: int) -> list[float]:
    """Per-call microseconds of ``call()``, one sample per batch of ``iterations`` calls."""
    samples: list[float] = []
    clock = time.perf_counter_ns
    loop = range(iterations)
    gc.disable()
    try:
        for _ in range(batches):
            start = clock()
            for _ in loop:
                call()
            samples.append((clock() - start) / iterations / 1000.0)
    finally:
        gc.enable()
    return samples


def time_once_us(call: Callable[[], Any]) -> tuple[float, Any]:
    """Microseconds taken by one ``call()`` and its result."""
    start = time.perf_counter_ns()
    result = call()
    return (time.perf_counter_ns() - start) / 1000.0, result


# ---- report -------------------------------------------------------------------------------------------


def host_info() -> dict[str, Any]:
    """The host: its name, CPU, system and Python."""
    return {
        "node": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def machine_info(device: str) -> dict[str, Any]:
    """Where the numbers come from: host, CPU, memory, Python and library versions."""
    info: dict[str, Any] = {
        **host_info(),
        "kvcached_core": kvcached_core.__version__,
        "built_with_cuda": bool(kvcached_core._native.built_with_cuda),
    }
    try:
        info["mem_total_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        info["mem_total_bytes"] = None
    free_bytes, total_bytes = get_backend(device, load_settings()).mem_info()
    info["device_mem_total_bytes"] = total_bytes
    info["device_mem_free_bytes_at_end"] = free_bytes
    return info


def report_head(benchmark: str, device: str) -> dict[str, Any]:
    """What every report starts with: the benchmark, the device, the machine and the command line."""
    return {"benchmark": benchmark, "device": device, "machine": machine_info(device), "command": " ".join(sys.argv)}


def write_report(report: dict[str, Any], out: str | None) -> str:
    """The report as JSON text, also written to ``out`` (its folder created) when given."""
    text = json.dumps(report, indent=2)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return text


# ---- command line ---------------------------------------------------------------------------------


def device_arg(text: str) -> str:
    """argparse type: 'cpu', 'cuda' or 'cuda:N', normalized."""
    try:
        kind, index = parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return "cpu" if kind == "host" else f"cuda:{index}"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def benchmark_parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark here shares: --device, --json, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE")
    return parser
