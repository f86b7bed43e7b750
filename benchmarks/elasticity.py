"""What a coarser page costs in elasticity: memory an engine keeps mapped but cannot give back, per page size.

    python benchmarks/elasticity.py [--page-mib 2 8 16 32] [--concurrency 16 128 512]
                                    [--layout per-layer block-outer] [--json] [--out FILE]

A page goes back only when every block in it is free, so a larger page strands more memory in pages that a
few live requests keep partly used. This replays one serving trace on the real allocator (host backend,
real mapping) for each page size and, every few steps, gives back every empty page (``trim()``: what an
engine does at once when a neighbour on its device is short) and records what stays mapped beyond the
blocks in use. The trace, from a fixed seed: Poisson arrivals at a rate that keeps ``--concurrency``
requests running on average; prompts of 128-2048 tokens and outputs of 32-512, uniform; each request takes
its prompt's blocks when it arrives, one block per 16 generated tokens, and frees them all when it ends.

The geometry is a Llama-3-8B-shaped engine on an H200 under vLLM 0.26: 32 buffers (one per layer) of 64 KiB
blocks (16 tokens of 8 KV heads of 128, K and V, bf16), 65536 blocks (4 GiB a buffer). Every buffer holds
the same page structure, so one buffer is replayed (host memory stays small) and bytes are reported for 32.
Per page size and load: KV in use (mean), stranded memory after trim (mean, p99, max; and as a fraction of
the KV in use), the idle floor (the null block's page in every buffer) and the page maps of the trace (which
move by a few percent between runs: the background reclaimer also unmaps empty pages between samples).

``--layout block-outer`` replays the same engine with every layer's block side by side
(``KVCACHED_KV_LAYOUT=block-outer``): one buffer of 2 MiB blocks, where a page holds page/2 MiB blocks of all
layers instead of page/64 KiB blocks of one. It is replayed as one buffer of 64 KiB blocks with pages 1/32 of
the size (the same blocks per page), scaled the same way.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
from typing import Any

from _common import benchmark_parser, machine_info, positive_int, write_report

from kvcached_core import KVCacheManager, load_settings

GiB = 1 << 30
MiB = 1 << 20
BUFFERS = 32  # what the figures are scaled to: one buffer per layer of the model above
BLOCK_BYTES = 64 * 1024
BLOCK_TOKENS = 16
NUM_BLOCKS = 65536
PROMPT_TOKENS = (128, 2048)
OUTPUT_TOKENS = (32, 512)
STEPS = 3000  # decode steps measured, after as many to reach a steady state
SAMPLE_EVERY = 10


class Request:
    """One request of the trace: its remaining tokens and the blocks it holds."""

    __slots__ = ("tokens", "left", "blocks")

    def __init__(self, tokens: int, left: int, blocks: list[int]) -> None:
        self.tokens, self.left, self.blocks = tokens, left, blocks


LAYOUTS = ("per-layer", "block-outer")


def replay(page_bytes: int, concurrency: int, seed: int = 1, layout: str = "per-layer") -> dict[str, Any]:
    """One page size, one load, one layout: the trace on a fresh manager; figures scaled to ``BUFFERS``
    buffers (per-layer) or to blocks of all ``BUFFERS`` layers (block-outer)."""
    settings = load_settings({}, reclaim_delay_ms=0, reserved_pages=0, control=False)
    mgr = KVCacheManager(
        NUM_BLOCKS,
        BLOCK_BYTES,
        1,
        1,
        device="cpu",
        name="bench-elasticity",
        reserve_null_block=True,
        page_bytes=page_bytes if layout == "per-layer" else page_bytes // BUFFERS,
        settings=settings,
    )
    try:
        idle = mgr.snapshot()["mapped_bytes"]
        rng = random.Random(seed)
        rate = concurrency / statistics.mean(OUTPUT_TOKENS)  # arrivals per step (Little's law)
        running: list[Request] = []
        used, stranded = [], []

        def take(count: int) -> list[int]:
            ids = mgr.alloc(count)
            if ids is None:
                raise RuntimeError(f"the trace outgrew {NUM_BLOCKS} blocks at concurrency {concurrency}")
            return ids

        for step in range(2 * STEPS):
            for _ in range(_poisson(rng, rate)):
                prompt, output = rng.randint(*PROMPT_TOKENS), rng.randint(*OUTPUT_TOKENS)
                running.append(Request(prompt, output, take(-(-prompt // BLOCK_TOKENS))))
            still: list[Request] = []
            for req in running:
                if req.tokens % BLOCK_TOKENS == 0:
                    req.blocks += take(1)
                req.tokens += 1
                req.left -= 1
                if req.left:
                    still.append(req)
                else:
                    mgr.free(req.blocks)
            running = still
            if step >= STEPS and step % SAMPLE_EVERY == 0:
                mgr.trim()
                snap = mgr.snapshot()
                used.append(snap["used_bytes"] * BUFFERS)
                stranded.append((snap["mapped_bytes"] - snap["used_bytes"]) * BUFFERS)
        maps = mgr.operation_snapshot()["page_maps_total"]
    finally:
        mgr.close()
    stranded.sort()
    mean_used = statistics.mean(used)
    return {
        "used_gib_mean": round(mean_used / GiB, 2),
        "stranded_gib_mean": round(statistics.mean(stranded) / GiB, 3),
        "stranded_gib_p99": round(stranded[int(0.99 * (len(stranded) - 1))] / GiB, 3),
        "stranded_gib_max": round(stranded[-1] / GiB, 3),
        "stranded_fraction_of_used": round(statistics.mean(stranded) / mean_used, 4),
        "idle_gib": round(idle * BUFFERS / GiB, 3),
        "page_maps": maps,
    }


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's method: the means here are small)."""
    count, threshold, product = 0, math.exp(-mean), rng.random()
    while product > threshold:
        count += 1
        product *= rng.random()
    return count


def main(argv: list[str]) -> int:
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--page-mib", type=positive_int, nargs="+", default=[2, 8, 16, 32], help="page sizes")
    parser.add_argument(
        "--concurrency", type=positive_int, nargs="+", default=[16, 128, 512], help="mean requests running"
    )
    parser.add_argument(
        "--layout", choices=LAYOUTS, nargs="+", default=["per-layer"], help="KV layouts (default per-layer)"
    )
    args = parser.parse_args(argv)
    if args.device != "cpu":
        parser.error("the replay runs on the host backend (--device cpu): it measures the allocator's pages")
    results: dict[str, Any] = {}
    for concurrency in args.concurrency:
        row = results[f"concurrency_{concurrency}"] = {}
        for layout in args.layout:
            for mib in args.page_mib:
                key = f"{mib}MiB" if layout == "per-layer" else f"{mib}MiB-{layout}"
                try:
                    row[key] = replay(mib * MiB, concurrency, layout=layout)
                except (RuntimeError, ValueError) as exc:
                    print(f"elasticity.py: {exc}", file=sys.stderr)
                    return 1
    report = {
        "benchmark": "elasticity",
        "geometry": {"buffers": BUFFERS, "block_bytes": BLOCK_BYTES, "num_blocks": NUM_BLOCKS},
        "trace": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "steps": STEPS},
        "results": results,
        "machine": machine_info("cpu"),
    }
    text = write_report(report, args.out)
    if args.json:
        print(text)
    else:
        print(f"{'load':>16} {'page':>18} {'in use GiB':>11} {'stranded mean':>14} {'p99':>7} {'share':>7} {'idle':>6}")
        for load, row in results.items():
            for page, r in row.items():
                print(
                    f"{load:>16} {page:>18} {r['used_gib_mean']:>11} {r['stranded_gib_mean']:>14} "
                    f"{r['stranded_gib_p99']:>7} {r['stranded_fraction_of_used']:>7} {r['idle_gib']:>6}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
