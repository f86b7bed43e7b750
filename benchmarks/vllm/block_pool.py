"""Scheduler-side cost of the elastic BlockPool: vLLM's own BlockPool vs kvcached's, same calls, one process.

Times ``free_blocks(get_new_blocks(k))`` (what a scheduled step does per request that needs k new blocks,
and later its release) and ``get_num_free_blocks()`` (read on every admission decision), in alternating
rounds, medians in microseconds. The elastic pool runs over a real kvcached planner (host backend, bookkeeping
only, as in EngineCore: the workers map). Prints JSON.

    python benchmarks/vllm/block_pool.py [--rounds 7] [--out FILE]      (in the vLLM venv)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from vllm.v1.core import block_pool as vanilla_module

from kvcached_core import KVCacheManager
from kvcached_vllm import runtime
from kvcached_vllm.block_pool import ElasticBlockPool

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import write_report  # noqa: E402

NUM_BLOCKS = 8193


def time_pair(pool, k: int, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        pool.free_blocks(pool.get_new_blocks(k))
    return (time.perf_counter() - start) / iterations * 1e6


def time_free_count(pool, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        pool.get_num_free_blocks()
    return (time.perf_counter() - start) / iterations * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    planner = KVCacheManager(
        num_blocks=NUM_BLOCKS,
        block_bytes=64 << 10,
        num_layers=4,
        num_kv_buffers=1,
        reserve_null_block=True,
        mapped_by_workers=True,
        name="bench",
        engine="vllm",
    )
    runtime.add_planner(NUM_BLOCKS, planner)
    pools = {
        "vllm": vanilla_module.BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16),
        "kvcached": ElasticBlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16),
    }
    results: dict = {"machine": platform.processor() or platform.machine(), "num_blocks": NUM_BLOCKS}
    for k in (1, 4, 16):
        samples: dict[str, list[float]] = {name: [] for name in pools}
        for _ in range(args.rounds):
            for name, pool in pools.items():
                samples[name].append(time_pair(pool, k, 2000))
        results[f"get_new_and_free_k{k}_us"] = {n: round(statistics.median(s), 3) for n, s in samples.items()}
    counts: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.rounds):
        for name, pool in pools.items():
            counts[name].append(time_free_count(pool, 20000))
    results["get_num_free_blocks_us"] = {n: round(statistics.median(s), 3) for n, s in counts.items()}
    planner.close()
    print(write_report(results, args.out))


if __name__ == "__main__":
    main()
