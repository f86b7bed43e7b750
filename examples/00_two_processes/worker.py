"""One engine of the two-process demo (started by run.py): bursts of KV-cache allocation in its busy phases.

Busy, it allocates chunks of blocks until ``alloc()`` returns None (the shared budget is full), holds them,
frees them oldest first and starts over; idle, it holds nothing. One block of each chunk is filled with a
known byte through ``mgr.buffer()`` and read back before the chunk is freed. Prints JSON lines: "ready";
after the start time (a ``time.monotonic()`` value) arrives on stdin, {"t", "mapped_bytes"} every 0.1 s;
"done" with its counters. Stops early on SIGTERM, SIGINT or stdin EOF.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import kvcached_core as kc

BLOCK_BYTES = 64 * 1024  # in one layer's K (or V) buffer
NUM_LAYERS = 2
NUM_KV_BUFFERS = 2
NUM_PHASES = 4
INTERVAL_S = 0.1  # between two samples
STEP_S = 0.005  # between two chunks
HOLD_S = 0.3  # how long a full batch is held
PATIENCE_S = 0.1  # after a miss, wait this long and try once more

STOP = threading.Event()


def emit(**obj: Any) -> None:
    """Print one JSON line (one thread at a time: the main one before and after the sampler's run)."""
    with contextlib.suppress(BrokenPipeError, ValueError):  # the driver is gone: stdin EOF stops us then
        print(json.dumps(obj), flush=True)


class Engine:
    """A KVCacheManager, the chunks it holds and its counters."""

    def __init__(self, args: argparse.Namespace, start: float) -> None:
        """Make the manager: ``args.capacity`` bytes of virtual capacity, freed pages unmapped after 20 ms."""
        self.args, self.start = args, start
        num_blocks = args.capacity // (BLOCK_BYTES * NUM_LAYERS * NUM_KV_BUFFERS)
        self.chunk = max(4, num_blocks // 128)  # a full budget in about 64 chunks
        self.mgr = kc.KVCacheManager(
            num_blocks=num_blocks,
            block_bytes=BLOCK_BYTES,
            num_layers=NUM_LAYERS,
            num_kv_buffers=NUM_KV_BUFFERS,
            device=args.device,
            name=args.name,
            reserved_pages=0,
            reclaim_delay_ms=20,
        )
        self.buffers = [[self.mgr.buffer(layer, kv) for kv in range(NUM_KV_BUFFERS)] for layer in range(NUM_LAYERS)]
        self.held: collections.deque[tuple[list[int], Any, int]] = collections.deque()  # ids, checked view, byte
        self.allocs = self.misses = self.checks = self.mismatches = 0

    def busy(self) -> bool:
        """Whether now is in one of this engine's busy phases (and the run is not over)."""
        t, duration = time.monotonic() - self.start, self.args.duration
        return not STOP.is_set() and t < duration and int(t * NUM_PHASES / duration) in self.args.busy

    def alloc_chunk(self) -> bool:
        """Allocate a chunk and fill one of its blocks with a known byte; False when the budget is full."""
        ids = self.mgr.alloc(self.chunk)
        if ids is None:
            self.misses += 1
            return False
        n = self.allocs = self.allocs + 1
        block, value = ids[n % len(ids)], n % 255 + 1
        buffer = self.buffers[n % NUM_LAYERS][n // NUM_LAYERS % NUM_KV_BUFFERS]  # a torch.uint8 view
        view = buffer[block * BLOCK_BYTES : (block + 1) * BLOCK_BYTES]
        view.fill_(value)
        self.held.append((ids, view, value))
        return True

    def free_oldest(self) -> None:
        """Read back the oldest chunk's filled block, then free the chunk."""
        ids, view, value = self.held.popleft()
        self.checks += 1
        if not bool((view == value).all()):
            self.mismatches += 1
            print(f"{self.args.name}: a block of chunk {ids[:4]}... read back wrong", file=sys.stderr)
        self.mgr.free(ids)

    def burst(self) -> None:
        """Allocate until the budget (or the virtual capacity) is full, hold, free oldest first; while busy."""
        while self.busy() and (len(self.held) + 1) * self.chunk <= self.mgr.num_blocks:
            if not self.alloc_chunk():  # the budget is full, unless memory the other engine freed is on its way
                STOP.wait(PATIENCE_S)
                if not self.alloc_chunk():
                    break
            STOP.wait(STEP_S)
        hold_until = time.monotonic() + HOLD_S
        while self.busy() and time.monotonic() < hold_until:
            STOP.wait(0.01)
        while self.held and self.busy():
            self.free_oldest()
            STOP.wait(STEP_S)

    def run(self) -> None:
        """Bursts while busy, nothing held while idle, until the duration is over."""
        while not STOP.is_set() and time.monotonic() - self.start < self.args.duration:
            if self.busy():
                self.burst()
            else:
                while self.held:  # the burst is over: free what is left at once
                    self.free_oldest()
                STOP.wait(0.01)

    def sample(self) -> None:
        """Print the mapped bytes at t = 0, 0.1, 0.2, ... s after the start, up to the duration."""
        tick = 0
        while tick * INTERVAL_S <= self.args.duration + 1e-9:
            if STOP.wait(max(0.0, self.start + tick * INTERVAL_S - time.monotonic())):
                return
            emit(t=round(tick * INTERVAL_S, 3), mapped_bytes=self.mgr.snapshot()["mapped_bytes"])
            tick = max(tick + 1, int((time.monotonic() - self.start) / INTERVAL_S) + 1)  # skip ticks missed


def main(argv: Sequence[str] | None = None) -> int:
    """Run one engine; 0 on success, 1 on a block that read back wrong or an error."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="instance name, e.g. engine-A")
    p.add_argument("--busy-phases", default="0,2", help="phases (0-3) in which to allocate (default: %(default)s)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds of the run (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--capacity", type=int, default=512 << 20, help="virtual capacity in bytes (default: %(default)s)")
    args = p.parse_args(argv)
    args.busy = {int(x) for x in args.busy_phases.split(",")}

    import torch  # mgr.buffer() gives torch views; import it before the clock starts

    torch.set_num_threads(1)  # tiny tensors: on a busy machine, more threads only wait for each other
    if args.device != "cpu":  # make the CUDA context (and load the kernels) before the driver takes the rest
        x = torch.full((4096,), 7, dtype=torch.uint8, device=args.device)
        assert bool((x == 7).all())
    emit(event="ready")
    line = sys.stdin.readline()
    if not line:
        return 1
    for signum in (signal.SIGTERM, signal.SIGINT):  # from now on, stop cleanly: free, close, report
        signal.signal(signum, lambda *_: STOP.set())
    threading.Thread(target=lambda: (sys.stdin.read(), STOP.set()), daemon=True).start()  # stop at stdin EOF
    engine = Engine(args, start=float(line))
    sampler = threading.Thread(target=engine.sample)
    sampler.start()  # its first sample is due at the start
    try:
        STOP.wait(max(0.0, engine.start - time.monotonic()))
        engine.run()
        sampler.join()  # its last sample is due at the end of the run
    finally:
        STOP.set()  # after an error or a signal, the sampler stops at once
        sampler.join()
        while engine.held:
            engine.free_oldest()
        engine.buffers = []  # drop the views before the memory under them goes
        engine.mgr.close()
    emit(event="done", misses=engine.misses, checks=engine.checks, mismatches=engine.mismatches)
    return 1 if engine.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
