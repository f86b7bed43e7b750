"""What giving memory back to a neighbour costs a busy engine, per KV layout and page size.

    python benchmarks/yield_cost.py [--page-mib 2 32] [--layout per-layer block-outer] [--share 0.55]
                                    [--placement compact request] [--concurrency 256] [--json] [--out FILE]

Fair share (``KVCACHED_FAIR_SHARE``) caps an engine above its equal share while a neighbour is short, in two
strengths. This replays one serving trace on the real allocator (host backend, real mapping; the trace and
geometry of ``elasticity.py``, with the multimodel benchmark's lengths: prompts of 256-3072 tokens, outputs of
128-1024) to a steady state, then caps the engine at ``--share`` of what it maps, and measures both:

- ``yield`` (the cap on every block, ``yield_cap``): decode steps as vLLM's scheduler runs them. Requests in
  arrival order; one whose next block is refused preempts the newest running request (itself last) until
  the block comes, and a preempted request gives back all its blocks. Reported: the requests preempted in
  the first step and in ``RECOVER_STEPS`` steps, as a count and a fraction of those running. A page goes
  back only when every block on it is free, so the fewer requests share a page, the fewer are preempted.
- ``admit-first`` (the admission cap): no new request, no preemption; every step the requests decode, those
  done free their blocks and the empty pages are given back. Reported: the steps until the engine maps no
  more than the cap (``drain_steps``; null if not within ``DRAIN_STEPS``), a step being a decode step of
  every running request (31 ms for the 8B-like model of the multimodel benchmark on an H100).

Both start from the same state: the trace is replayed afresh from the same seed for each. ``--placement``
is ``KVCACHED_BLOCK_PLACEMENT``: ``compact`` (blocks fill pages in use first) or ``request`` (a request grows
on its own last page, then on empty or new pages before other requests' partly used ones), a request's
decode blocks asked for next to its last one as the vLLM plugin asks.
"""

from __future__ import annotations

import random
import statistics
import sys
from typing import Any

import elasticity
from _common import benchmark_parser, machine_info, positive_int, write_report
from elasticity import BLOCK_BYTES, BLOCK_TOKENS, BUFFERS, LAYOUTS, NUM_BLOCKS, MiB, Request

from kvcached_core import KVCacheManager, load_settings
from kvcached_core.config import BLOCK_PLACEMENTS

PROMPT_TOKENS = (256, 3072)  # the multimodel benchmark's traffic
OUTPUT_TOKENS = (128, 1024)
WARM_STEPS = 3000  # to a steady state (the longest request lives 1024 steps)
RECOVER_STEPS = 100
DRAIN_STEPS = 2000


def steady_state(
    page_bytes: int, concurrency: int, layout: str, placement: str, seed: int
) -> tuple[KVCacheManager, list[Request]]:
    """A fresh manager (one buffer of the ``BUFFERS``-layer engine, as ``elasticity.py`` replays it) after
    ``WARM_STEPS`` steps of the trace, and the requests running then, oldest first."""
    settings = load_settings({}, reclaim_delay_ms=0, reserved_pages=0, control=False, block_placement=placement)
    mgr = KVCacheManager(
        NUM_BLOCKS,
        BLOCK_BYTES,
        1,
        1,
        device="cpu",
        name="bench-yield",
        reserve_null_block=True,
        page_bytes=page_bytes if layout == "per-layer" else page_bytes // BUFFERS,
        settings=settings,
    )
    rng = random.Random(seed)
    rate = concurrency / statistics.mean(OUTPUT_TOKENS)
    running: list[Request] = []
    for _ in range(WARM_STEPS):
        for _ in range(elasticity._poisson(rng, rate)):
            prompt, output = rng.randint(*PROMPT_TOKENS), rng.randint(*OUTPUT_TOKENS)
            ids = mgr.alloc(-(-prompt // BLOCK_TOKENS))
            if ids is None:
                mgr.close()
                raise RuntimeError(f"the trace outgrew {NUM_BLOCKS} blocks at concurrency {concurrency}")
            running.append(Request(prompt, output, ids))
        running = decode_step(mgr, running)[0]
    mgr.trim()
    return mgr, running


def decode_step(mgr: KVCacheManager, running: list[Request]) -> tuple[list[Request], int]:
    """One decode step as vLLM schedules it (see the module docstring); returns the requests still running
    and how many were preempted."""
    preempted = 0
    i = 0
    while i < len(running):
        req = running[i]
        if req.tokens % BLOCK_TOKENS == 0:
            near = req.blocks[-1] if mgr.places_by_request else -1  # as the vLLM plugin asks
            ids = mgr.alloc_near(1, near)
            while ids is None and running[-1] is not req:
                victim = running.pop()
                mgr.free(victim.blocks)
                preempted += 1
                ids = mgr.alloc_near(1, near)
            if ids is None:  # itself the newest one left
                running.pop()
                mgr.free(req.blocks)
                preempted += 1
                break
            req.blocks += ids
        req.tokens += 1
        req.left -= 1
        i += 1
    still = []
    for req in running:
        if req.left:
            still.append(req)
        else:
            mgr.free(req.blocks)
    return still, preempted


def measure(
    page_bytes: int, concurrency: int, layout: str, share: float, placement: str = "compact", seed: int = 1
) -> dict[str, Any]:
    """Both strengths from the same steady state; bytes scaled to the whole engine (``BUFFERS`` buffers)."""
    mgr, running = steady_state(page_bytes, concurrency, layout, placement, seed)
    try:
        mapped = mgr.snapshot()["mapped_bytes"]
        cap = int(mapped * share)
        result: dict[str, Any] = {
            "running": len(running),
            "mapped_gib": round(mapped * BUFFERS / (1 << 30), 2),
            "cap_gib": round(cap * BUFFERS / (1 << 30), 2),
        }
        at_yield = len(running)
        mgr.yield_cap = cap
        running, first = decode_step(mgr, running)
        total = first
        for _ in range(RECOVER_STEPS - 1):
            running, preempted = decode_step(mgr, running)
            total += preempted
        mgr.trim()
        result["yield"] = {
            "preempted_first_step": first,
            "preempted": total,
            "preempted_fraction": round(total / at_yield, 3),
            "mapped_after_gib": round(mgr.snapshot()["mapped_bytes"] * BUFFERS / (1 << 30), 2),
        }
    finally:
        mgr.close()
    mgr, running = steady_state(page_bytes, concurrency, layout, placement, seed)
    try:
        drain = None
        for step in range(1, DRAIN_STEPS + 1):
            running, _ = decode_step(mgr, running)
            mgr.trim()
            if mgr.snapshot()["mapped_bytes"] <= cap:
                drain = step
                break
        result["admit_first"] = {"drain_steps": drain, "still_running": len(running)}
    finally:
        mgr.close()
    return result


def main(argv: list[str]) -> int:
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--page-mib", type=positive_int, nargs="+", default=[2, 32], help="page sizes")
    parser.add_argument("--layout", choices=LAYOUTS, nargs="+", default=list(LAYOUTS), help="KV layouts")
    parser.add_argument("--concurrency", type=positive_int, default=256, help="mean requests running")
    parser.add_argument("--share", type=float, default=0.55, help="the cap, as a fraction of what is mapped")
    parser.add_argument(
        "--placement", choices=BLOCK_PLACEMENTS, nargs="+", default=list(BLOCK_PLACEMENTS), help="block placements"
    )
    args = parser.parse_args(argv)
    if args.device != "cpu":
        parser.error("the replay runs on the host backend (--device cpu): it measures the allocator's pages")
    if not 0 < args.share < 1:
        parser.error(f"--share: a fraction between 0 and 1, not {args.share}")
    results: dict[str, Any] = {}
    for placement in args.placement:
        for layout in args.layout:
            for mib in args.page_mib:
                key = f"{mib}MiB-{layout}-{placement}"
                try:
                    results[key] = measure(mib * MiB, args.concurrency, layout, args.share, placement)
                except (RuntimeError, ValueError) as exc:
                    print(f"yield_cost.py: {exc}", file=sys.stderr)
                    return 1
    report = {
        "benchmark": "yield_cost",
        "geometry": {"buffers": BUFFERS, "block_bytes": BLOCK_BYTES, "num_blocks": NUM_BLOCKS},
        "trace": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "concurrency": args.concurrency},
        "share": args.share,
        "results": results,
        "machine": machine_info("cpu"),
    }
    text = write_report(report, args.out)
    if args.json:
        print(text)
    else:
        head = ("page", 30), ("running", 8), ("mapped", 7), ("cap", 7), ("preempted", 10), ("share", 6)
        print(" ".join(f"{name:>{width}}" for name, width in head), f"{'drain steps':>12}")
        for key, r in results.items():
            y = r["yield"]
            print(
                f"{key:>30} {r['running']:>8} {r['mapped_gib']:>7} {r['cap_gib']:>7} {y['preempted']:>10} "
                f"{y['preempted_fraction']:>6} {r['admit_first']['drain_steps']!s:>12}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
