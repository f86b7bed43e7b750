"""Does a memory-mapping driver call wait for the GPU? Prints JSON.

    python benchmarks/gpu/probe_busy.py [--busy-ms 200] [--out FILE]

kvcached maps pages on the engine's scheduler thread (TP=1) while the GPU still runs the previous step, and
unmaps them on its reclaimer thread. If a call waited for the kernels in flight, every step that maps would
lose vLLM's overlap of CPU scheduling with GPU work: a cost that no idle-GPU timing shows. This probe times
each call from the host twice, with the GPU idle and with a kernel of ``--busy-ms`` spinning on it
(``torch.cuda._sleep``, launched just before), and reports whether the call returned before that kernel
ended:

- ``create``, ``map``, ``set_access``, ``unmap``, ``release``: one 2 MiB and one 32 MiB handle each;
- ``launch_during_sync``: a kernel launched from this thread while another thread sits in
  ``cuCtxSynchronize`` (kvcached's fence before an unmap): does the launch wait for the fence.

A call whose ``busy_ms`` is close to ``--busy-ms`` waits for the GPU; one near its ``idle_ms`` does not.
"""

from __future__ import annotations

import argparse
import threading
import time

from probe_slices import SLAB, Driver, open_torch_device, report

MiB = 1 << 20


def spin(torch, ms: float, cycles_per_ms: float) -> None:
    """Queues a kernel that keeps the GPU busy for about ``ms`` and returns at once."""
    torch.cuda._sleep(int(ms * cycles_per_ms))


def calibrate(torch) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm-up
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def time_call(torch, fn, busy_ms: float, cycles_per_ms: float) -> dict:
    """``fn``'s host time with the GPU idle, then right after a ``busy_ms`` kernel was queued."""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    fn("idle")
    idle = time.perf_counter() - begin
    spin(torch, busy_ms, cycles_per_ms)
    begin = time.perf_counter()
    fn("busy")
    busy = time.perf_counter() - begin
    torch.cuda.synchronize()
    waited = time.perf_counter() - begin
    return {
        "idle_ms": round(idle * 1e3, 3),
        "busy_ms": round(busy * 1e3, 3),
        "kernel_ms": round(waited * 1e3, 1),
        "waits_for_gpu": busy * 1e3 > busy_ms / 2,
    }


def probe_size(torch, drv: Driver, size: int, busy_ms: float, cycles_per_ms: float) -> dict:
    """Every call's idle and busy host time for one handle size (a fresh handle and address per side)."""
    base = drv.reserve(2 * size)
    addr = {"idle": base, "busy": base + size}
    handles: dict[str, int] = {}

    def create(which: str) -> None:
        handles[which] = drv.create(size)

    calls = {
        "create": create,
        "map": lambda w: drv.map(addr[w], size, handles[w]),
        "set_access": lambda w: drv.set_access(addr[w], size),
        "unmap": lambda w: drv.unmap(addr[w], size),
        "release": lambda w: drv.call("cuMemRelease", handles[w]),
    }
    try:
        return {name: time_call(torch, fn, busy_ms, cycles_per_ms) for name, fn in calls.items()}
    finally:
        drv.call("cuMemAddressFree", base, 2 * size)


def probe(torch, drv: Driver, busy_ms: float) -> dict:
    cycles_per_ms = calibrate(torch)
    out: dict = {"busy_ms": busy_ms, "cycles_per_ms": round(cycles_per_ms)}
    for size in (2 * MiB, SLAB):
        out[f"{size // MiB}MiB"] = probe_size(torch, drv, size, busy_ms, cycles_per_ms)

    # A launch while another thread is in cuCtxSynchronize behind a busy kernel.
    spin(torch, busy_ms, cycles_per_ms)
    syncing = threading.Thread(target=lambda: (drv.call("cuCtxSetCurrent", drv.ctx), drv.call("cuCtxSynchronize")))
    syncing.start()
    time.sleep(0.01)
    begin = time.perf_counter()
    spin(torch, 1, cycles_per_ms)
    launch = time.perf_counter() - begin
    syncing.join()
    torch.cuda.synchronize()
    out["launch_during_sync"] = {"launch_ms": round(launch * 1e3, 3), "waits_for_sync": launch * 1e3 > busy_ms / 2}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-ms", type=float, default=200.0, help="how long the GPU is kept busy (ms)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    opened = open_torch_device("probe_busy", args.device)
    if opened is None:
        return 2
    torch, drv = opened
    report({"probe": "busy", "device": args.device, "calls": probe(torch, drv, args.busy_ms)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
