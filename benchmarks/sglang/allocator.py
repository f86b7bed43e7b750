"""Scheduler-side cost of the elastic token allocator: the host time kvcached adds to each SGLang step.

SGLang's scheduler asks its token allocator for slots on every step: ``available_size()`` for each
admission decision, ``alloc(n)`` for the new tokens of the batch (one per running request while decoding,
a prompt's length while prefilling) and ``free(slots)`` when requests finish. This times those calls on
the class the plugin puts in place of SGLang's ``TokenToKVPoolAllocator`` (page size 1, what the GPU runs
use), over the elastic pool on kvcached's host backend (real memory, real mapping; pages are mapped before
the clock starts, so what is timed is the steady state, not growth); medians over rounds, microseconds
per call:

- ``alloc_free_n{N}_us``: ``free(alloc(N))`` for N = 1, 64, 1024 and 4096 slots;
- ``decode_step_us``: one step of a 1024-request decode batch at steady state: ``available_size()``,
  ``alloc(1024)`` and the free of the four requests that finished (768 slots each);
- ``available_size_us``.

SGLang's own allocator is not a baseline here: its free list is a tensor on the pool's device, so on a CPU
every free copies the whole list (~800 us a step at this size), where on a GPU the same calls are kernel
launches. What the step costs on a GPU, ids moving between host and device included (``DeviceIds``), is
measured by the GPU harness (``benchmarks/gpu/sglang``: the decode step's wall and GPU time with and
without kvcached). Prints JSON::

    python benchmarks/sglang/allocator.py [--rounds 7] [--out FILE]        (in the SGLang venv)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable

# The elastic pool's segment and host budget stay in a folder of this run (set before kvcached is imported).
os.environ.setdefault("KVCACHED_RUNTIME_DIR", tempfile.mkdtemp(prefix="kvcached-bench-sglang-"))
os.environ.setdefault("KVCACHED_HOST_DEVICE_BYTES", "4G")

import sglang  # noqa: E402
import torch  # noqa: E402

from kvcached_core.patches import for_release  # noqa: E402
from kvcached_sglang.patches import PATCHES  # noqa: E402
from kvcached_sglang.pools import close_manager  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import host_info, summarize, write_report  # noqa: E402

SLOTS = 1 << 18  # token slots of the pool: 262144, 128 MiB of K/V at the shape below
SHAPE = {"head_num": 1, "head_dim": 64, "layer_num": 2}
DECODE_BATCH = 1024
FINISHED_PER_STEP, FINISHED_SLOTS = 4, 768  # 1024 requests of 512 + 256 tokens: 4 finish a step


def hook(unit: str) -> type:
    """The class the plugin's patch unit ``unit`` puts in place for the installed SGLang release."""
    [patch] = [p for p in for_release(PATCHES, sglang.__version__) if p.name == unit]
    return patch.hook


def make_allocator(pool_class: type, allocator_class: type) -> tuple[object, object]:
    """A pool of :data:`SLOTS` token slots on CPU and an allocator over it, as SGLang's configurator builds
    them (page size 1, no memory saver)."""
    pool = pool_class(
        SLOTS,
        page_size=1,
        dtype=torch.bfloat16,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=SHAPE["layer_num"] - 1,
        **SHAPE,
    )
    allocator = allocator_class(SLOTS, dtype=pool.dtype, device="cpu", kvcache=pool, need_sort=False)
    return pool, allocator


def per_call_us(call: Callable[[], object], iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return (time.perf_counter() - start) / iterations * 1e6


def decode_step(allocator, held: list[torch.Tensor]) -> Callable[[], None]:
    """One steady-state decode step over ``held`` (the running requests' slots, oldest first)."""

    def step() -> None:
        allocator.available_size()
        held.append(allocator.alloc(DECODE_BATCH))
        done = held.pop(0)
        for part in done.split(FINISHED_SLOTS)[:FINISHED_PER_STEP]:
            allocator.free(part)
        if len(done) > FINISHED_PER_STEP * FINISHED_SLOTS:
            allocator.free(done[FINISHED_PER_STEP * FINISHED_SLOTS :])

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every timing; medians reported (7)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    pool, allocator = make_allocator(hook("mha-pool"), hook("token-allocator"))
    if not getattr(allocator, "elastic", False):
        raise SystemExit("allocator.py: the elastic pool kept SGLang's buffers; is kvcached-core installed?")
    allocator.free(allocator.alloc(SLOTS // 2))  # map the pages the timed calls use: growth is not timed here

    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for n in (1, 64, 1024, 4096):
            call = lambda n=n: allocator.free(allocator.alloc(n))  # noqa: E731
            samples.setdefault(f"alloc_free_n{n}_us", []).append(per_call_us(call, 500))
        samples.setdefault("available_size_us", []).append(per_call_us(allocator.available_size, 5000))
        # 64 steps of slots in flight: each step's alloc replaces the oldest step's, freed in parts.
        held = [allocator.alloc(DECODE_BATCH) for _ in range(64)]
        samples.setdefault("decode_step_us", []).append(per_call_us(decode_step(allocator, held), 300))
        for part in held:
            allocator.free(part)

    report: dict = {
        "benchmark": "sglang_allocator",
        "machine": host_info(),
        "command": " ".join(sys.argv),
        "sglang": sglang.__version__,
        "parameters": {"slots": SLOTS, "page_size": 1, "rounds": args.rounds, "decode_batch": DECODE_BATCH},
    }
    report.update({name: summarize(values) for name, values in samples.items()})
    close_manager(pool)
    print(write_report(report, args.out))


if __name__ == "__main__":
    main()
