"""One "engine" of the two-process demo: bursts of KV-cache allocation against a shared memory budget.

The worker runs a KVCacheManager and, during its busy phases, behaves like a serving engine under load:
it allocates blocks in chunks (requests arriving) until ``alloc`` returns None (the shared budget is
full) or its own virtual capacity is used up, holds them for a while, then frees them in chunks (requests
finishing) and starts over. During its idle phases it holds nothing, so the reclaimer unmaps its pages and
the other process can map that memory.

Every ``--interval`` seconds a sampler thread prints one JSON line to stdout::

    {"t": 1.2, "tick": 12, "name": "engine-A", "mapped_bytes": ..., "used_bytes": ..., "alloc_misses": ...}

Other lines carry an ``"event"`` key (``ready``, ``started``, ``done``, ``error``). The common start
time comes from ``--start-at`` (a ``time.monotonic()`` value, which is the same clock in every process
on Linux) or, without it, as one line on stdin after the worker has printed ``ready``. When stdin
reaches end-of-file (the driver is gone) the worker stops early.

Run by ``run.py``; ``python worker.py --help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import kvcached_core as kc

NUM_PHASES = 4


@dataclass
class Probe:
    """One block of a chunk that was filled with a known byte, to be read back before it is freed."""

    block: int
    layer: int
    kv: int
    value: int


@dataclass
class Stats:
    """Counters the sampler thread reads while the main thread works."""

    alloc_misses: int = 0
    alloc_calls: int = 0
    checks: int = 0
    mismatches: int = 0
    mismatch_details: list[str] = field(default_factory=list)


class JsonOut:
    """Thread-safe writer of one JSON object per line; remembers when stdout has gone away."""

    def __init__(self, stream: TextIO) -> None:
        """Write to ``stream`` (normally sys.stdout)."""
        self._stream = stream
        self._lock = threading.Lock()
        self.broken = False

    def emit(self, obj: dict[str, Any]) -> None:
        """Print ``obj`` as one line and flush; a closed pipe marks the writer broken instead of raising."""
        line = json.dumps(obj, separators=(",", ":"))
        with self._lock:
            if self.broken:
                return
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.broken = True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options of the worker."""
    p = argparse.ArgumentParser(
        description="One engine of the two-process kvcached demo (normally started by run.py).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--name", required=True, help="label printed with every sample, e.g. engine-A")
    p.add_argument(
        "--busy-phases",
        default="0,2",
        help=f"comma-separated phases (0..{NUM_PHASES - 1}) in which this worker allocates; "
        f"the run is split into {NUM_PHASES} equal phases",
    )
    p.add_argument("--duration", type=float, default=12.0, help="seconds from the common start to the end")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="blocks of virtual capacity; 0 = enough for twice the host budget (KVCACHED_HOST_DEVICE_BYTES, "
        "or 256 MiB when unset)",
    )
    p.add_argument("--block-bytes", type=int, default=64 * 1024, help="bytes of one block in one buffer")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-kv-buffers", type=int, default=2)
    p.add_argument("--reserved-pages", type=int, default=0, help="mapped empty pages kept for reuse")
    p.add_argument("--reclaim-delay-ms", type=int, default=20, help="delay before an empty page is unmapped")
    p.add_argument("--chunk-blocks", type=int, default=16, help="blocks per alloc()/free() call")
    p.add_argument("--step-s", type=float, default=0.005, help="pause between two chunks")
    p.add_argument("--hold-s", type=float, default=0.3, help="how long a full batch is held before freeing")
    p.add_argument(
        "--patience-s",
        type=float,
        default=0.1,
        help="after a miss, keep retrying this long (memory may be on its way back) before holding",
    )
    p.add_argument("--interval", type=float, default=0.1, help="seconds between two JSON samples")
    p.add_argument(
        "--start-at",
        type=float,
        default=None,
        help="common start as a time.monotonic() value; default: read it as one line from stdin",
    )
    args = p.parse_args(argv)
    try:
        args.busy = {int(x) for x in args.busy_phases.split(",") if x.strip()}
    except ValueError:
        p.error(f"--busy-phases {args.busy_phases!r} is not a comma-separated list of integers")
    if not args.busy <= set(range(NUM_PHASES)):
        p.error(f"--busy-phases must name phases between 0 and {NUM_PHASES - 1}")
    if args.duration <= 0 or args.interval <= 0:
        p.error("--duration and --interval must be positive")
    return args


class Worker:
    """The allocation loop, the sampler thread and the bookkeeping of one engine."""

    def __init__(self, args: argparse.Namespace, out: JsonOut) -> None:
        """Keep the options; the manager is made later by :meth:`make_manager`."""
        self.args = args
        self.out = out
        self.stop = threading.Event()
        self.stop_reason = ""
        self.stats = Stats()
        self.start = 0.0
        self.phase_len = args.duration / NUM_PHASES
        self.mgr: kc.KVCacheManager | None = None
        self.buffers: list[list[Any]] = []
        self.held: collections.deque[tuple[list[int], Probe | None]] = collections.deque()
        self.held_blocks = 0
        self.counter = 0
        self.peak_mapped = 0

    # -- setup -------------------------------------------------------------------------------------------

    def make_manager(self) -> None:
        """Create the KVCacheManager; the host budget, if any, comes from the KVCACHED_* environment."""
        a = self.args
        num_blocks = a.num_blocks
        if num_blocks <= 0:
            budget = kc.load_settings().host_device_bytes or 256 << 20
            num_blocks = 2 * budget // (a.block_bytes * a.num_layers * a.num_kv_buffers)
        self.mgr = kc.KVCacheManager(
            num_blocks=num_blocks,
            block_bytes=a.block_bytes,
            num_layers=a.num_layers,
            num_kv_buffers=a.num_kv_buffers,
            device=a.device,
            name=a.name,
            reserved_pages=a.reserved_pages,
            reclaim_delay_ms=a.reclaim_delay_ms,
        )
        self.buffers = [[self.mgr.buffer(layer, kv) for kv in range(a.num_kv_buffers)] for layer in range(a.num_layers)]

    # -- time --------------------------------------------------------------------------------------------

    def now(self) -> float:
        """Seconds since the common start."""
        return time.monotonic() - self.start

    def busy(self) -> bool:
        """Whether the current phase is one of this worker's busy phases (and the run is not over)."""
        t = self.now()
        if t >= self.args.duration or self.stop.is_set():
            return False
        return min(int(t / self.phase_len), NUM_PHASES - 1) in self.args.busy

    def sleep(self, seconds: float) -> None:
        """Sleep, waking early when asked to stop."""
        self.stop.wait(max(0.0, seconds))

    # -- memory checks -----------------------------------------------------------------------------------

    def block_view(self, probe: Probe) -> Any:
        """The bytes of ``probe``'s block in its buffer (a torch.uint8 view, no copy)."""
        bb = self.args.block_bytes
        return self.buffers[probe.layer][probe.kv][probe.block * bb : (probe.block + 1) * bb]

    def write_probe(self, ids: list[int]) -> Probe:
        """Fill one block of a new chunk with a value derived from a counter; returns what to check later."""
        self.counter += 1
        a = self.args
        probe = Probe(
            block=ids[self.counter % len(ids)],
            layer=self.counter % a.num_layers,
            kv=(self.counter // a.num_layers) % a.num_kv_buffers,
            value=self.counter % 255 + 1,
        )
        self.block_view(probe).fill_(probe.value)
        return probe

    def verify_probe(self, probe: Probe) -> None:
        """Read the block back; a byte that differs from what was written counts as a mismatch."""
        view = self.block_view(probe)
        ok = bool((view == probe.value).all().item())
        self.stats.checks += 1
        if not ok:
            self.stats.mismatches += 1
            if len(self.stats.mismatch_details) < 5:
                wrong = int((view != probe.value).sum().item())
                self.stats.mismatch_details.append(
                    f"block {probe.block} layer {probe.layer} kv {probe.kv}: "
                    f"{wrong} of {view.numel()} bytes differ from {probe.value}"
                )

    # -- allocation --------------------------------------------------------------------------------------

    def alloc_chunk(self) -> bool:
        """Allocate one chunk (smaller at the end of virtual capacity); False on a miss."""
        assert self.mgr is not None
        want = min(self.args.chunk_blocks, self.mgr.num_blocks - self.held_blocks)
        if want <= 0:
            return False
        self.stats.alloc_calls += 1
        ids = self.mgr.alloc(want)
        if ids is None:
            self.stats.alloc_misses += 1
            return False
        self.held.append((ids, self.write_probe(ids)))
        self.held_blocks += len(ids)
        return True

    def free_chunk(self) -> None:
        """Free the oldest chunk (first in, first out, like requests finishing), checking its probe first."""
        assert self.mgr is not None
        ids, probe = self.held.popleft()
        if probe is not None:
            self.verify_probe(probe)
        self.mgr.free(ids)
        self.held_blocks -= len(ids)

    def release_all(self) -> None:
        """Free everything held, chunk by chunk without pauses (the burst is over)."""
        while self.held:
            self.free_chunk()

    def fill(self) -> None:
        """Allocate until the budget or virtual capacity stops us, retrying a miss for ``patience_s``."""
        assert self.mgr is not None
        missing_since: float | None = None
        while self.busy():
            if self.held_blocks >= self.mgr.num_blocks:
                return  # own virtual capacity used up
            if self.alloc_chunk():
                missing_since = None
                self.sleep(self.args.step_s)
                continue
            now = time.monotonic()
            if missing_since is None:
                missing_since = now
            if now - missing_since >= self.args.patience_s:
                return  # nothing came back for a while: the budget is full
            self.sleep(0.01)

    def drain(self) -> None:
        """Free the held chunks one at a time with a pause between them."""
        while self.held and self.busy():
            self.free_chunk()
            self.sleep(self.args.step_s)

    def run(self) -> None:
        """Busy phases: fill, hold, drain, repeat. Idle phases: hold nothing. Ends at the duration."""
        while not self.stop.is_set() and self.now() < self.args.duration:
            if not self.busy():
                self.release_all()
                self.sleep(0.01)
                continue
            self.fill()
            hold_until = time.monotonic() + self.args.hold_s
            while self.busy() and time.monotonic() < hold_until:
                self.sleep(0.01)
            self.drain()
        self.release_all()

    # -- sampling ----------------------------------------------------------------------------------------

    def sample(self, tick: int) -> None:
        """Print one sample of the manager's occupancy."""
        assert self.mgr is not None
        snap = self.mgr.snapshot()
        self.peak_mapped = max(self.peak_mapped, snap["mapped_bytes"])
        self.out.emit(
            {
                "t": round(self.now(), 3),
                "tick": tick,
                "name": self.args.name,
                "mapped_bytes": snap["mapped_bytes"],
                "used_bytes": snap["used_bytes"],
                "alloc_misses": self.stats.alloc_misses,
                "pool_bytes": snap["pool_ready_handles"] * snap["page_bytes"],
                "busy": self.busy(),
            }
        )
        if self.out.broken:
            self.request_stop("stdout closed")

    def sampler(self, done: threading.Event) -> None:
        """Sample at ticks k * interval after the common start until ``done`` is set."""
        tick = 0
        while True:
            due = self.start + tick * self.args.interval
            if done.wait(max(0.0, due - time.monotonic())):
                return
            self.sample(tick)
            # Skip ticks that are already over (the process was descheduled): samples stay on the grid.
            tick = max(tick + 1, int((time.monotonic() - self.start) / self.args.interval) + 1)

    def request_stop(self, reason: str) -> None:
        """Ask the main loop to finish early."""
        if not self.stop.is_set():
            self.stop_reason = reason
            self.stop.set()


def read_start(args: argparse.Namespace) -> float:
    """The common start: ``--start-at`` or one line on stdin. Raises EOFError when stdin closes first."""
    if args.start_at is not None:
        return float(args.start_at)
    line = sys.stdin.readline()
    if not line:
        raise EOFError("stdin closed before the start time arrived")
    return float(line)


def watch_stdin(worker: Worker) -> None:
    """Stop the worker when stdin reaches end-of-file: the driver that started it is gone."""
    try:
        while sys.stdin.readline():
            pass
    except (OSError, ValueError):
        pass
    worker.request_stop("stdin closed (driver gone)")


def warm_up_device(device: str) -> None:
    """Create the CUDA context and load the kernels used later, so that no first-use allocation happens
    while the two workers compete for memory. Nothing to do on the CPU."""
    if device == "cpu":
        return
    import torch

    x = torch.empty(4096, dtype=torch.uint8, device=device)
    x.fill_(7)
    assert bool((x == 7).all().item())
    _ = int((x != 7).sum().item())
    torch.cuda.synchronize()


def wait_for_reclaim(mgr: kc.KVCacheManager, reserved_pages: int, timeout: float = 2.0) -> int:
    """After everything was freed, wait for the reclaimer to unmap down to ``reserved_pages`` pages;
    returns the mapped bytes left (more than the reserve means memory did not come back in time)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = mgr.snapshot()
        if snap["mapped_pages"] <= reserved_pages or time.monotonic() >= deadline:
            return int(snap["mapped_bytes"])
        time.sleep(0.01)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one worker; 0 on success, 1 on a data mismatch or an error."""
    args = parse_args(argv)
    out = JsonOut(sys.stdout)
    worker = Worker(args, out)

    def on_signal(signum: int, _frame: object) -> None:
        """SIGTERM/SIGINT: finish early but cleanly (free, wait for the reclaimer, close)."""
        worker.request_stop(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    import torch  # noqa: F401  (the block checks use torch views; import it before the clock starts)

    warm_up_device(args.device)
    out.emit({"event": "ready", "name": args.name, "pid": os.getpid(), "device": args.device})
    try:
        start = read_start(args)
    except (EOFError, ValueError) as exc:
        out.emit({"event": "error", "name": args.name, "error": f"no start time: {exc}"})
        return 1
    if args.start_at is None:
        threading.Thread(target=watch_stdin, args=(worker,), daemon=True).start()

    sampler_done = threading.Event()
    sampler: threading.Thread | None = None
    status = 0
    try:
        worker.make_manager()
        assert worker.mgr is not None
        snap = worker.mgr.snapshot()
        out.emit(
            {
                "event": "started",
                "name": args.name,
                "pid": os.getpid(),
                "device": worker.mgr.device,
                "num_blocks": worker.mgr.num_blocks,
                "virtual_bytes": snap["total_blocks"] * args.block_bytes * snap["num_buffers"],
                "page_bytes": snap["page_bytes"],
                "logical_page_bytes": snap["page_bytes"] * snap["num_buffers"],
                "busy_phases": sorted(args.busy),
            }
        )
        worker.start = start
        worker.sleep(start - time.monotonic())
        sampler = threading.Thread(target=worker.sampler, args=(sampler_done,), daemon=True)
        sampler.start()
        worker.run()
    except Exception as exc:  # reported to the driver, then the process exits nonzero
        out.emit({"event": "error", "name": args.name, "error": f"{type(exc).__name__}: {exc}"})
        status = 1
    finally:
        if worker.mgr is not None and not worker.mgr.closed:
            try:
                worker.release_all()
            except Exception as exc:
                out.emit({"event": "error", "name": args.name, "error": f"release: {exc}"})
                status = 1
        sampler_done.set()
        if sampler is not None:
            sampler.join()
        left_mapped = None
        if worker.mgr is not None and not worker.mgr.closed:
            left_mapped = wait_for_reclaim(worker.mgr, args.reserved_pages)
            worker.buffers = []
            worker.mgr.close()
    if worker.stats.mismatches:
        status = 1
    out.emit(
        {
            "event": "done",
            "name": args.name,
            "t": round(worker.now(), 3) if worker.start else None,
            "alloc_calls": worker.stats.alloc_calls,
            "alloc_misses": worker.stats.alloc_misses,
            "checks": worker.stats.checks,
            "mismatches": worker.stats.mismatches,
            "mismatch_details": worker.stats.mismatch_details,
            "peak_mapped_bytes": worker.peak_mapped,
            "mapped_bytes_after_release": left_mapped,
            "stopped_early": worker.stop_reason or None,
        }
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
