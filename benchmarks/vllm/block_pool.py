"""Scheduler-side cost of the elastic BlockPool: vLLM's own BlockPool vs kvcached's, same calls, one process.

Times ``free_blocks(get_new_blocks(k))`` (what a scheduled step does per request that needs k new blocks,
and later its release) and ``get_num_free_blocks()`` (read on every admission decision), in alternating
rounds, medians in microseconds. The elastic pool runs over a real kvcached planner (host backend, bookkeeping
only, as in EngineCore: the workers map). Then vLLM's whole ``KVCacheManager.allocate_slots``, as its
scheduler calls it: admitting a 600-token prompt (38 new blocks, then ``free``) and a decode step that needs
no new block; vLLM's own first, then with kvcached's plugin loaded (its patch units wrap ``allocate_slots``
and ``get_num_blocks_to_allocate``; the rounds cannot alternate, since loading patches the class). Prints
JSON.

    python benchmarks/vllm/block_pool.py [--rounds 7] [--out FILE]      (in the vLLM venv)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import vllm
from vllm.v1.core import block_pool as vanilla_module

from kvcached_core import KVCacheManager
from kvcached_core.patches import for_release
from kvcached_vllm import runtime
from kvcached_vllm.patches import PATCHES

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import write_report  # noqa: E402

NUM_BLOCKS = 8193


def elastic_pool_class() -> type:
    """The elastic pool the plugin installs for this vLLM release (block reuse watchers came in 0.30)."""
    [pool] = [p.hook for p in for_release(PATCHES, vllm.__version__) if p.name == "block-pool"]
    return pool


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


def allocate_slots_timings(rounds: int) -> dict[str, float]:
    """Medians (us) of admitting a 600-token prompt (allocate_slots + free) and of a decode step that needs no
    new block, through the vLLM ``KVCacheManager`` built now (vanilla before the plugin is loaded)."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    manager = VllmKVCacheManager(
        config, max_model_len=4096, scheduler_block_size=16, hash_block_size=16, enable_caching=False
    )
    admit, decode = [], []
    for _ in range(rounds):
        request = Request("r", list(range(600)), SamplingParams(max_tokens=1), None)
        start = time.perf_counter()
        for _ in range(500):
            manager.allocate_slots(request, 600)
            manager.free(request)
        admit.append((time.perf_counter() - start) / 500 * 1e6)
        manager.allocate_slots(request, 599)
        request.num_computed_tokens = 599  # the last prompt token is left: its slot is already allocated
        start = time.perf_counter()
        for _ in range(5000):
            manager.allocate_slots(request, 1)
        decode.append((time.perf_counter() - start) / 5000 * 1e6)
        manager.free(request)
    return {
        "admit_600_tokens": round(statistics.median(admit), 3),
        "decode_no_new_block": round(statistics.median(decode), 3),
    }


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
        "kvcached": elastic_pool_class()(NUM_BLOCKS, enable_caching=True, hash_block_size=16),
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
    vanilla = allocate_slots_timings(args.rounds)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # kvcached's patch units: the coordinator now builds the elastic pool
    elastic = allocate_slots_timings(args.rounds)
    for what in vanilla:
        results[f"allocate_slots_{what}_us"] = {"vllm": vanilla[what], "kvcached": elastic[what]}
    planner.close()
    print(write_report(results, args.out))


if __name__ == "__main__":
    main()
