"""What the CUDA driver charges to make many bytes usable, for each way of calling it. Prints JSON.

    python benchmarks/gpu/probe_slices.py [--gib 4] [--out FILE]

Burst growth maps thousands of 2 MiB pages; each page costs about one cuMemMap (~1 us) and one
cuMemSetAccess (~30 us), and the access call seems to be charged per physical handle, not per byte. This
probe asks the driver directly (ctypes on libcuda, no kvcached code) how each variant scales, over the same
number of bytes, so the allocator's growth path can be designed on numbers:

- ``pages``: one 2 MiB handle per page, map + access per page (what kvcached does today);
- ``slices_access_each``: 32 MiB handles mapped as 16 slices of 2 MiB (cuMemMap at an offset into the
  handle), access per slice;
- ``slices_access_per_handle``: the same slices, one access call over each handle's 32 MiB;
- ``slices_access_once``: the same slices, one access call over the whole range;
- ``whole_handles``: each 32 MiB handle mapped in one call, access per handle (the driver's floor);
- ``backstop_fill``: one 2 MiB handle mapped at every page, one access call over the whole range;
- unmapping, for ``pages`` and ``slices_access_once``: one call per 2 MiB slice, and one call over a whole
  handle's 16 slices;
- ``slice_remap_ok``: a slice unmapped from the middle of a range mapped with one access call, then mapped
  again at its offset, is readable and writable (cuMemsetD8 + cuCtxSynchronize succeed).

A driver that refuses a mapping at a non-zero offset into a handle (the H200's 580 driver does, with
CUDA_ERROR_NOT_SUPPORTED) gets ``"slices": "not supported ..."`` instead of the slice variants.

Handles are created before the clock starts (kvcached's pool creates them ahead of need).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

MiB = 1 << 20
PAGE = 2 * MiB
SLAB = 32 * MiB


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


class Driver:
    """The few driver calls this probe needs; every failure raises naming the call."""

    def __init__(self, device: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, size = ctypes.c_uint64, ctypes.c_size_t
        sig = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuCtxSynchronize": [],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size, size, u64, u64],
            "cuMemAddressFree": [u64, size],
            "cuMemCreate": [ctypes.POINTER(u64), size, ctypes.POINTER(AllocationProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size, size, u64, u64],
            "cuMemUnmap": [u64, size],
            "cuMemSetAccess": [u64, size, ctypes.POINTER(AccessDesc), size],
            "cuMemsetD8_v2": [u64, ctypes.c_ubyte, size],
        }
        for name, args in sig.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.call("cuInit", 0)
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), device)
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev.value)
        self.call("cuCtxSetCurrent", ctx)
        self.ctx = ctx  # another thread makes it current before its own calls
        self.prop = AllocationProp(type=1, location=Location(type=1, id=dev.value))  # pinned, on this device
        self.access = AccessDesc(location=Location(type=1, id=dev.value), flags=3)  # read + write

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def reserve(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), nbytes, SLAB, 0, 0)
        return ptr.value

    def create(self, nbytes: int) -> int:
        handle = ctypes.c_uint64()
        self.call("cuMemCreate", ctypes.byref(handle), nbytes, ctypes.byref(self.prop), 0)
        return handle.value

    def map(self, addr: int, nbytes: int, handle: int, offset: int = 0) -> None:
        self.call("cuMemMap", addr, nbytes, offset, handle, 0)

    def set_access(self, addr: int, nbytes: int) -> None:
        self.call("cuMemSetAccess", addr, nbytes, ctypes.byref(self.access), 1)

    def unmap(self, addr: int, nbytes: int) -> None:
        self.call("cuMemUnmap", addr, nbytes)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rate(seconds: float, nbytes: int) -> dict:
    return {
        "ms": round(seconds * 1e3, 2),
        "us_per_2mib": round(seconds * 1e6 / (nbytes // PAGE), 2),
        "gib_per_s": round(nbytes / (1 << 30) / seconds, 1),
    }


def probe(drv: Driver, total: int) -> dict:
    pages, slabs, per_slab = total // PAGE, total // SLAB, SLAB // PAGE
    base = drv.reserve(total)
    out: dict = {"bytes": total}
    try:
        small = [drv.create(PAGE) for _ in range(pages)]
        big = [drv.create(SLAB) for _ in range(slabs)]

        def pages_map() -> None:
            for i, h in enumerate(small):
                drv.map(base + i * PAGE, PAGE, h)
                drv.set_access(base + i * PAGE, PAGE)

        out["pages"] = rate(timed(pages_map), total)
        out["pages_unmap_each"] = rate(timed(lambda: [drv.unmap(base + i * PAGE, PAGE) for i in range(pages)]), total)

        def map_slices() -> None:
            for s, h in enumerate(big):
                for k in range(per_slab):
                    drv.map(base + s * SLAB + k * PAGE, PAGE, h, k * PAGE)

        def slices(access) -> float:
            return timed(lambda: (map_slices(), access()))

        def access_each() -> None:
            for i in range(pages):
                drv.set_access(base + i * PAGE, PAGE)

        def access_per_handle() -> None:
            for s in range(slabs):
                drv.set_access(base + s * SLAB, SLAB)

        try:  # the driver may refuse a mapping at an offset into a handle (its documentation allows only 0)
            drv.map(base + PAGE, PAGE, big[0], PAGE)
            drv.unmap(base + PAGE, PAGE)
            offsets = True
        except RuntimeError as exc:
            out["slices"] = f"not supported by this driver: {exc}"
            offsets = False
        if offsets:
            out["slices_access_each"] = rate(slices(access_each), total)
            drv.unmap(base, total)
            out["slices_access_per_handle"] = rate(slices(access_per_handle), total)
            drv.unmap(base, total)
            out["slices_access_once"] = rate(slices(lambda: drv.set_access(base, total)), total)
            # A slice from the middle goes and comes back; the range must stay usable.
            mid = base + (slabs // 2) * SLAB + 3 * PAGE
            drv.unmap(mid, PAGE)
            drv.map(mid, PAGE, big[slabs // 2], 3 * PAGE)
            drv.set_access(mid, PAGE)
            drv.call("cuMemsetD8_v2", base, 7, total)
            drv.call("cuCtxSynchronize")
            out["slice_remap_ok"] = True
            out["slices_unmap_each"] = rate(
                timed(lambda: [drv.unmap(base + i * PAGE, PAGE) for i in range(pages)]), total
            )
            map_slices()
            drv.set_access(base, total)
            out["slices_unmap_per_handle"] = rate(
                timed(lambda: [drv.unmap(base + s * SLAB, SLAB) for s in range(slabs)]), total
            )

        def whole() -> None:
            for s, h in enumerate(big):
                drv.map(base + s * SLAB, SLAB, h)
                drv.set_access(base + s * SLAB, SLAB)

        out["whole_handles"] = rate(timed(whole), total)
        drv.unmap(base, total)
        backstop = small[0]

        def fill() -> None:
            for i in range(pages):
                drv.map(base + i * PAGE, PAGE, backstop)
            drv.set_access(base, total)

        out["backstop_fill"] = rate(timed(fill), total)
        out["backstop_unmap_once"] = rate(timed(lambda: drv.unmap(base, total)), total)
        for h in small + big:
            drv.call("cuMemRelease", h)
    finally:
        drv.call("cuMemAddressFree", base, total)
    return out


def open_driver(probe_name: str, device: int) -> Driver | None:
    """The probe's :class:`Driver` on ``device``, or None after one line saying why (no driver here)."""
    try:
        return Driver(device)
    except (OSError, RuntimeError) as exc:
        print(f"{probe_name}: no usable CUDA driver here ({exc}); run it on a GPU machine")
        return None


def open_torch_device(probe_name: str, device: int):
    """torch on ``device`` with CUDA initialised, and the probe's :class:`Driver` on the same context, or
    None after one line saying why (no torch, no CUDA device, no driver): for probes that also run kernels."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        torch.cuda.set_device(device)
        torch.cuda.init()
        return torch, Driver(device)
    except (ImportError, OSError, RuntimeError) as exc:
        print(f"{probe_name}: no usable CUDA device here ({exc}); run it on a GPU machine")
        return None


def report(result: dict, out: str | None) -> None:
    """Print a probe's JSON, and write it to ``out`` too when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=4, help="bytes made usable by each variant (GiB, default 4)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    drv = open_driver("probe_slices", args.device)
    if drv is None:
        return 2
    report({"probe": "slices", "device": args.device, "variants": probe(drv, args.gib << 30)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
