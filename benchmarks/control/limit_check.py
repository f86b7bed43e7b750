"""What the limit check costs the alloc+free pair: no limit against a large one, alternating round by round."""

from __future__ import annotations

import statistics
from typing import Any

# Shared with the other benchmarks here (this script's directory is sys.path[0]).
from _common import make_pair_manager, summarize, time_pair_batches

from kvcached_core.config import load_settings

from .workload import LibraryError

PAIR_ITERATIONS = 20000
PAIR_WARM_BLOCKS = 1000
LARGE_LIMIT = 1 << 40  # far above anything the pair manager maps


def measure_limit_check_cost(device: str, runtime_dir: str, rounds: int, batches: int) -> dict[str, Any]:
    """Pair k=1 per call with no limit and with a large one, alternating (ABBA) on one manager."""
    mgr = make_pair_manager(device, load_settings(runtime_dir=runtime_dir))
    try:
        ids = mgr.alloc(PAIR_WARM_BLOCKS)
        if ids is None:
            raise LibraryError(f"alloc({PAIR_WARM_BLOCKS}) for the warm-up returned None: {mgr.snapshot()}")
        mgr.free(ids)
        mapped_before = mgr.snapshot()["mapped_pages"]
        alloc, free = mgr.alloc, mgr.free
        time_pair_batches(alloc, free, 1, PAIR_ITERATIONS // 10, 2)
        samples: dict[str, list[float]] = {"no_limit": [], "large_limit": []}
        per_round: list[float] = []
        for r in range(rounds):
            order = ("no_limit", "large_limit") if r % 2 == 0 else ("large_limit", "no_limit")
            medians: dict[str, float] = {}
            for condition in order:
                result = mgr.set_memory_limit(LARGE_LIMIT if condition == "large_limit" else None)
                if result["status"] != "applied":
                    raise LibraryError(f"set_memory_limit for {condition} returned {result}")
                batch = time_pair_batches(alloc, free, 1, PAIR_ITERATIONS, batches)
                samples[condition].extend(batch)
                medians[condition] = statistics.median(batch)
            per_round.append(round(100 * (medians["large_limit"] / medians["no_limit"] - 1), 3))
        mapped_after = mgr.snapshot()["mapped_pages"]
        if mapped_after != mapped_before:
            raise LibraryError(f"mapped pages changed during the pair loops: {mapped_before} -> {mapped_after}")
    finally:
        mgr.close()
    no_limit = summarize(samples["no_limit"])
    large = summarize(samples["large_limit"])
    return {
        "pair_us_no_limit": no_limit,
        "pair_us_large_limit": large,
        "relative_difference_pct": round(100 * (large["median"] / no_limit["median"] - 1), 3),
        "per_round_difference_pct": per_round,
        "median_round_difference_pct": round(statistics.median(per_round), 3),
        "large_limit_bytes": LARGE_LIMIT,
        "rounds": rounds,
        "batches_per_round": batches,
        "iterations_per_batch": PAIR_ITERATIONS,
        "mapped_pages": mapped_before,
    }
