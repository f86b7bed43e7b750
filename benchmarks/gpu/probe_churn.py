"""Do page-table changes slow the GPU's work or the engine's launches; is KV read through mapped pages slower?

Prints JSON.

    python benchmarks/gpu/probe_churn.py [--gib 8] [--seconds 3] [--out FILE]

Serving on the H200 (``benchmarks/results/h200-vllm/``, runs 14 and 15) cost kvcached 1.06-1.5x vanilla's
TPOT and up to a third of its saturation throughput, while a profile of the engine's scheduler thread put
under 6 % of it in kvcached code, and ``probe_busy.py`` showed that no driver call waits for the GPU from the
host's side. What that timing does not show is what the GPU and the engine's own thread pay: every
cuMemMap, cuMemSetAccess and cuMemUnmap changes the GPU's page tables, which may invalidate its TLBs and
stall kernels that are running, and may hold a driver lock that the engine's kernel launches wait for. And
vLLM's own KV cache is one cudaMalloc, kvcached's is made of separately mapped 32 MiB handles: a kernel that
gathers blocks across it may miss the TLB more.

The probe runs a KV-like read on the GPU without pause, a gather of ``--block-kib`` blocks at random
ids over a ``--gib`` buffer (what paged attention reads), and times it with CUDA events:

- ``cudamalloc``, ``mapped``: the buffer from torch's allocator, or reserved and mapped as 32 MiB handles
  (one access call each), nothing else running: what reading through mapped pages costs;
- ``mapped_churn`` and ``cudamalloc_churn``: the same read while another thread maps and unmaps 32 MiB
  handles on a separate range as fast as the driver lets it (map + access, then unmap);
- ``mapped_churn_backstop``: as kvcached does with its backstop, every unmap is followed by a map of one
  shared handle and an access call, and every map by an unmap of it;
- ``mapped_churn_create``: each handle also created before its map and released after its unmap, as when a
  burst outgrows kvcached's pool of handles (16 by default; a 40 GiB burst of a 32-layer model takes 1280);
- ``cudamalloc_sync``: another thread in cuCtxSynchronize over and over (kvcached's fence before an unmap).

Per variant: the median and p99 gather time, the read bandwidth, the host time to launch a tiny kernel
(``launch_us``: vLLM's engine thread launches hundreds per step and is CPU-bound at these rates) and, beside
churn, the driver calls per second that ran and what one took from the host. A churn variant's ``slowdown``
over its quiet variant is what the GPU pays; its ``launch_slowdown``, what the engine's thread pays.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from probe_slices import SLAB, Driver, open_torch_device, report


class MappedBuffer:
    """``nbytes`` of device memory as 32 MiB handles mapped back to back, readable by torch."""

    def __init__(self, torch, drv: Driver, nbytes: int) -> None:
        self.drv, self.nbytes = drv, nbytes
        self.base = drv.reserve(nbytes)
        self.handles = []
        for offset in range(0, nbytes, SLAB):
            handle = drv.create(SLAB)
            self.handles.append(handle)
            drv.map(self.base + offset, SLAB, handle)
            drv.set_access(self.base + offset, SLAB)
        interface = {"shape": (nbytes,), "typestr": "|u1", "data": (self.base, False), "strides": None, "version": 3}
        self.tensor = torch.as_tensor(_CudaArray(interface), device="cuda")

    def close(self) -> None:
        del self.tensor
        for k, handle in enumerate(self.handles):
            self.drv.unmap(self.base + k * SLAB, SLAB)
            self.drv.call("cuMemRelease", handle)
        self.drv.call("cuMemAddressFree", self.base, self.nbytes)


class _CudaArray:
    """A raw device pointer as torch reads one (``__cuda_array_interface__``)."""

    def __init__(self, interface: dict) -> None:
        self.__cuda_array_interface__ = interface


class Churn:
    """A thread that changes page tables on a range of its own until stopped, counting its driver calls.

    ``mode``: ``map`` maps 8 handles (map + access) and unmaps them, over and over; ``backstop`` does the same
    as kvcached does with its backstop (each unmap followed by a map of one shared handle and an access call,
    each map preceded by an unmap of it); ``create`` also creates each handle before it is mapped and
    releases it after its unmap (what a burst past kvcached's handle pool does); ``sync`` calls
    cuCtxSynchronize over and over (kvcached's fence before it unmaps)."""

    MODES = ("map", "backstop", "create", "sync")

    def __init__(self, drv: Driver, mode: str, pages: int = 8) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, not {mode!r}")
        self.drv, self.mode, self.pages = drv, mode, pages
        self.calls = 0
        self.error: str | None = None  # a driver call that failed on the churn thread (it then stops)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._churn()
        except RuntimeError as exc:
            self.error = str(exc)

    def _churn(self) -> None:
        drv, backstop, create = self.drv, self.mode == "backstop", self.mode == "create"
        drv.call("cuCtxSetCurrent", drv.ctx)
        if self.mode == "sync":
            while not self._stop.is_set():
                drv.call("cuCtxSynchronize")
                self.calls += 1
            return
        base = drv.reserve(self.pages * SLAB)
        handles = [] if create else [drv.create(SLAB) for _ in range(self.pages)]
        shared = drv.create(SLAB)
        addrs = [base + k * SLAB for k in range(self.pages)]
        if backstop:  # every page starts on the shared handle, as kvcached's unmapped pages do
            for addr in addrs:
                drv.map(addr, SLAB, shared)
                drv.set_access(addr, SLAB)
        try:
            while not self._stop.is_set():
                if create:
                    handles = [drv.create(SLAB) for _ in addrs]
                    self.calls += len(addrs)
                for addr, handle in zip(addrs, handles, strict=True):
                    if backstop:
                        drv.unmap(addr, SLAB)
                    drv.map(addr, SLAB, handle)
                    drv.set_access(addr, SLAB)
                    self.calls += 3 if backstop else 2
                for addr in addrs:
                    drv.unmap(addr, SLAB)
                    self.calls += 1
                    if backstop:
                        drv.map(addr, SLAB, shared)
                        drv.set_access(addr, SLAB)
                        self.calls += 2
                if create:
                    for handle in handles:
                        drv.call("cuMemRelease", handle)
                    self.calls += len(handles)
                    handles = []
        finally:
            if backstop:
                for addr in addrs:
                    drv.unmap(addr, SLAB)
            for handle in (*handles, shared):
                drv.call("cuMemRelease", handle)
            drv.call("cuMemAddressFree", base, self.pages * SLAB)

    def __enter__(self) -> Churn:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.started


def gather_times(torch, buffer, block_bytes: int, blocks: int, seconds: float) -> list[float]:
    """Milliseconds of each gather of ``blocks`` random blocks, run back to back for ``seconds``."""
    rows = buffer.view(torch.int64).view(-1, block_bytes // 8)  # one row per block
    out = torch.empty((blocks, block_bytes // 8), dtype=torch.int64, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(7)
    index = [torch.randint(0, rows.shape[0], (blocks,), device="cuda", generator=generator) for _ in range(8)]
    times: list[float] = []
    torch.cuda.synchronize()
    deadline = time.perf_counter() + seconds
    k = 0
    while time.perf_counter() < deadline:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.index_select(rows, 0, index[k % len(index)], out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        k += 1
    return times


def launch_us(torch, launches: int = 2000) -> float:
    """Host microseconds per launch of a tiny kernel, launched back to back: what a CPU-bound engine (vLLM's
    piecewise steps launch hundreds of kernels each) pays per kernel."""
    small = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(launches):
        small.add_(1)
    host = time.perf_counter() - begin
    torch.cuda.synchronize()
    return round(host * 1e6 / launches, 2)


def summary(times: list[float], read_bytes: int) -> dict:
    ordered = sorted(times)
    median = statistics.median(ordered)
    return {
        "gathers": len(times),
        "median_ms": round(median, 4),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4),
        "gib_per_s": round(read_bytes / (1 << 30) / (median / 1e3), 1),
    }


def probe(torch, drv: Driver, nbytes: int, block_bytes: int, blocks: int, seconds: float) -> dict:
    read = block_bytes * blocks
    out: dict = {"buffer_gib": nbytes / (1 << 30), "block_bytes": block_bytes, "blocks_per_gather": blocks}
    malloc = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    mapped = MappedBuffer(torch, drv, nbytes)
    try:
        for name, buffer in (("cudamalloc", malloc), ("mapped", mapped.tensor)):
            gather_times(torch, buffer, block_bytes, blocks, 0.3)  # warm-up
            out[name] = summary(gather_times(torch, buffer, block_bytes, blocks, seconds), read)
            out[name]["launch_us"] = launch_us(torch)
        for name, buffer, mode in (
            ("mapped_churn", mapped.tensor, "map"),
            ("mapped_churn_backstop", mapped.tensor, "backstop"),
            ("mapped_churn_create", mapped.tensor, "create"),
            ("cudamalloc_churn", malloc, "map"),
            ("cudamalloc_sync", malloc, "sync"),
        ):
            with Churn(drv, mode) as churn:
                result = summary(gather_times(torch, buffer, block_bytes, blocks, seconds), read)
                result["launch_us"] = launch_us(torch)
            quiet = out["mapped" if buffer is mapped.tensor else "cudamalloc"]
            result["driver_calls_per_s"] = round(churn.calls / churn.seconds)
            result["us_per_call"] = round(churn.seconds * 1e6 / max(churn.calls, 1), 1)  # while the GPU reads
            result["slowdown"] = round(result["median_ms"] / quiet["median_ms"], 3)
            result["launch_slowdown"] = round(result["launch_us"] / quiet["launch_us"], 3)
            if churn.error:
                result["churn_error"] = churn.error
            out[name] = result
        out["mapped_over_cudamalloc"] = round(out["mapped"]["median_ms"] / out["cudamalloc"]["median_ms"], 3)
    finally:
        mapped.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=8, help="size of the buffer read (GiB, default 8)")
    parser.add_argument("--block-kib", type=int, default=64, help="bytes of one gathered block (KiB, default 64)")
    parser.add_argument("--blocks", type=int, default=4096, help="blocks per gather (default 4096)")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each variant runs (default 3)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    for name in ("gib", "block_kib", "blocks"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    if (args.gib << 30) % (args.block_kib << 10) or args.block_kib % 8:
        parser.error("--block-kib must be a multiple of 8 that divides the buffer (a power of two)")
    opened = open_torch_device("probe_churn", args.device)
    if opened is None:
        return 2
    torch, drv = opened
    nbytes = args.gib << 30
    result = probe(torch, drv, nbytes, args.block_kib << 10, args.blocks, args.seconds)
    report({"probe": "churn", "device": args.device, **result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
