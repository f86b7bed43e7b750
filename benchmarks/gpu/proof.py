"""GPU proof of the CUDA backend: data integrity under churn, unmap never racing the GPU, two processes
sharing one GPU, mapping throughput and the idle footprint. Prints JSON (``--out FILE`` writes it too).

    python benchmarks/gpu/proof.py [--device cuda:0] [--ops 100000] [--out FILE] [--short]

``--short`` runs only a brief churn, for compute-sanitizer (memcheck is slow). Exit status 1 when a check
fails. Every figure is measured in this run; nothing is compared with numbers from elsewhere.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import torch

import kvcached_core as kc

MiB = 1 << 20
GiB = 1 << 30


def settings(runtime: str, **overrides: Any) -> kc.Settings:
    return kc.load_settings({}, runtime_dir=runtime, **overrides)


def churn(device: str, runtime: str, target_ops: int, seed: int = 0) -> dict[str, Any]:
    """Random alloc/free sizes and orders; every allocated block gets fresh random data in every buffer;
    freed blocks are poisoned first; all held blocks are checked every few rounds and at the end."""
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    mgr = kc.KVCacheManager(
        8192, 64 * 1024, 2, 2, device=device, settings=settings(runtime, reclaim_delay_ms=0), reserved_pages=1
    )
    bufs = [mgr.buffer(layer, kv).view(torch.int32).view(8192, -1) for layer in range(2) for kv in range(2)]
    held: dict[int, torch.Tensor] = {}  # block -> its value in each buffer
    ops = mismatches = rounds = checks = 0
    try:
        while ops < target_ops:
            ids = mgr.alloc(rng.randint(1, 256)) or []
            ops += 1
            if ids:
                idx = torch.tensor(ids, device=device)
                values = torch.randint(1, 2**30, (len(ids), len(bufs)), device=device, generator=gen, dtype=torch.int32)
                for i, buf in enumerate(bufs):
                    buf[idx] = values[:, i : i + 1]
                held.update(zip(ids, values, strict=True))
            victims = [b for b in held if rng.random() < 0.45]
            rng.shuffle(victims)
            if victims:
                idx = torch.tensor(victims, device=device)
                for buf in bufs:
                    buf[idx] = -1  # poison: a block read back as -1 was freed under its owner
                mgr.free(victims)
                ops += 1
                for b in victims:
                    del held[b]
            rounds += 1
            if rounds % 25 == 0 or ops >= target_ops:
                mismatches += verify(bufs, held, device)
                checks += 1
            if rounds % 200 == 0:
                torch.cuda.synchronize()
                mgr.trim()  # unmap/remap churn beyond the reclaimer's
        ops_snapshot = mgr.operation_snapshot()
    finally:
        torch.cuda.synchronize()
        mgr.close()
    return {
        "alloc_free_calls": ops,
        "rounds": rounds,
        "full_checks": checks,
        "mismatches": mismatches,
        "page_maps": ops_snapshot["page_maps_total"],
        "page_unmaps": ops_snapshot["page_unmaps_total"],
        "mapping_errors": ops_snapshot["mapping_errors_total"],
    }


def verify(bufs: list[torch.Tensor], held: dict[int, torch.Tensor], device: str) -> int:
    if not held:
        return 0
    keys = torch.tensor(list(held), device=device)
    expect = torch.stack(list(held.values()))
    bad = 0
    for i, buf in enumerate(bufs):
        rows = buf[keys]
        ok = (rows.min(dim=1).values == expect[:, i]) & (rows.max(dim=1).values == expect[:, i])
        bad += int((~ok).sum().item())
    return bad


def unmap_race(device: str, runtime: str) -> dict[str, Any]:
    """Queue a long run of kernels that read some blocks, free them and trim at once: trim must wait for
    the kernels (it fences before unmapping), and the kernels must read intact data."""
    mgr = kc.KVCacheManager(
        4096, 64 * 1024, 1, 2, device=device, settings=settings(runtime, reclaim_delay_ms=0), reserved_pages=0
    )
    try:
        ids = mgr.alloc(512)
        idx = torch.tensor(ids, device=device)
        buf = mgr.buffer(0, 0).view(torch.float32).view(4096, -1)
        buf[idx] = 1.0
        torch.cuda.synchronize()
        acc = torch.zeros((), device=device, dtype=torch.float64)
        launches = 3000
        start = time.perf_counter()
        for _ in range(launches):
            acc += buf[idx].sum(dtype=torch.float64)  # each launch reads every held block
        done = torch.cuda.Event()
        done.record()
        queued_s = time.perf_counter() - start
        mgr.free(ids)
        unmapped = mgr.trim()
        kernels_done_before_unmap = done.query()
        trim_s = time.perf_counter() - start - queued_s
        torch.cuda.synchronize()
        expected = float(launches * len(ids) * buf.shape[1])
        return {
            "launches": launches,
            "blocks_read": len(ids),
            "bytes_unmapped": unmapped,
            "kernels_done_when_trim_returned": bool(kernels_done_before_unmap),
            "trim_waited_ms": round(trim_s * 1000, 2),
            "sum_correct": float(acc.item()) == expected,
        }
    finally:
        mgr.close()


HOLDER = textwrap.dedent(
    """
    import sys, time, json, kvcached_core as kc
    s = kc.load_settings({}, runtime_dir=sys.argv[2], reclaim_delay_ms=0, pool_target=0)
    m = kc.KVCacheManager(1 << 17, 2 << 20, 1, 1, device=sys.argv[1], name="B", settings=s, reserved_pages=0)
    print("ready", flush=True)                # its CUDA context exists before A fills the GPU
    sys.stdin.readline()
    print(json.dumps({"first_alloc": m.alloc(1) is not None}), flush=True)
    sys.stdin.readline()                      # A has freed: take what it released
    held = m.alloc(1) or []                   # one page first: the time to get memory back
    t_first = time.time() if held else None
    while (ids := m.alloc(256)) is not None:
        held += ids
    print(json.dumps({"t_first": t_first, "bytes": len(held) * (2 << 20)}), flush=True)
    sys.stdin.readline()
    m.free(held); m.trim()
    print(json.dumps({"released": True}), flush=True)
    sys.stdin.readline()
    """
)


def two_processes(device: str, runtime: str) -> dict[str, Any]:
    """A fills the GPU, B is refused (alloc returns None, no crash); A frees; B takes the memory A released
    (timed from A's trim returning to B's first successful alloc); A is refused while B holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, device, runtime], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    s = settings(runtime, reclaim_delay_ms=0, pool_target=0)
    a = kc.KVCacheManager(1 << 17, 2 << 20, 1, 1, device=device, name="A", settings=s, reserved_pages=0)
    held: list[int] = []
    start = time.perf_counter()
    while (ids := a.alloc(256)) is not None:
        held += ids
    fill_s = time.perf_counter() - start
    a_bytes = len(held) * (2 << 20)
    proc.stdin.write("\n")
    proc.stdin.flush()
    try:
        b_first = json.loads(proc.stdout.readline())["first_alloc"]
        a.free(held)
        a.trim()
        t_released = time.time()
        proc.stdin.write("\n")
        proc.stdin.flush()
        b = json.loads(proc.stdout.readline())
        a_refused = a.alloc(256) is None  # B holds the memory now
        proc.stdin.write("\n")
        proc.stdin.flush()
        json.loads(proc.stdout.readline())
        a_again = a.alloc(256) is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        proc.kill()
        a.close()
    return {
        "a_filled_bytes": a_bytes,
        "a_fill_s": round(fill_s, 2),
        "a_fill_gib_per_s": round(a_bytes / GiB / fill_s, 1),
        "b_refused_while_a_held": not b_first,
        "b_took_bytes": b["bytes"],
        "b_took_fraction_of_a": round(b["bytes"] / a_bytes, 4),
        # From A's trim returning to B's first page, the message that tells B to try included.
        "b_first_page_after_a_released_ms": None
        if b["t_first"] is None
        else round((b["t_first"] - t_released) * 1000, 2),
        "a_refused_while_b_held": a_refused,
        "a_allocates_again_after_b_released": a_again,
        "b_exit_status": proc.returncode,
    }


def throughput(device: str, runtime: str) -> dict[str, Any]:
    """GiB/s of making pages usable (created on the path, no pool) for 2 MiB and 32 MiB pages."""
    out = {}
    for page in (2 * MiB, 32 * MiB):
        n = (4 * GiB) // page
        mgr = kc.KVCacheManager(
            n, page, 1, 1, device=device, settings=settings(runtime), page_bytes=page, pool_target=0, reserved_pages=0
        )
        try:
            mgr.alloc(1)  # first touch outside the timing
            start = time.perf_counter()
            ids = mgr.alloc(n - 1)
            elapsed = time.perf_counter() - start
            assert ids is not None
            out[f"{page // MiB}MiB"] = {"gib_per_s": round((n - 1) * page / GiB / elapsed, 1), "pages": n - 1}
        finally:
            mgr.close()
    return out


def idle_footprint(device: str, runtime: str) -> dict[str, Any]:
    """After a burst, how long until mapped - used <= the configured reserve (target: within 1 s)."""
    reserved = 2
    mgr = kc.KVCacheManager(16384, 256 * 1024, 4, 2, device=device, settings=settings(runtime), reserved_pages=reserved)
    try:
        ids = mgr.alloc(12000)  # about 23 GiB across 8 buffers
        peak = mgr.snapshot()["mapped_bytes"]
        mgr.free(ids)
        freed_at = time.perf_counter()
        logical_page = mgr.page_bytes * 8
        while True:
            snap = mgr.snapshot()
            if snap["mapped_bytes"] - snap["used_bytes"] <= reserved * logical_page:
                break
            if time.perf_counter() - freed_at > 5:
                break
            time.sleep(0.002)
        settle = time.perf_counter() - freed_at
        return {
            "burst_mapped_bytes": peak,
            "idle_footprint_bytes": snap["mapped_bytes"] - snap["used_bytes"],
            "reserve_bytes": reserved * logical_page,
            "settled_s": round(settle, 3),
            "within_1s": settle <= 1.0 and snap["mapped_bytes"] - snap["used_bytes"] <= reserved * logical_page,
        }
    finally:
        mgr.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU proof of the kvcached CUDA backend (JSON report).")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--ops", type=int, default=100_000, help="alloc/free calls in the churn (default 1e5)")
    parser.add_argument("--out", help="also write the JSON report here")
    parser.add_argument("--short", action="store_true", help="a brief churn only (for compute-sanitizer)")
    args = parser.parse_args(argv)
    if "cuda" not in kc.available_backends():
        print(f"proof.py: no usable CUDA: {kc.cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvcached-proof-") as runtime:
        report: dict[str, Any] = {"device": torch.cuda.get_device_name(args.device), "command": " ".join(sys.argv)}
        if args.short:
            report["churn"] = churn(args.device, runtime, 300)
        else:
            report["churn"] = churn(args.device, runtime, args.ops)
            report["unmap_race"] = unmap_race(args.device, runtime)
            report["throughput"] = throughput(args.device, runtime)
            report["idle_footprint"] = idle_footprint(args.device, runtime)
            report["two_processes"] = two_processes(args.device, runtime)
    checks = {
        "no_mismatches": report["churn"]["mismatches"] == 0,
        "no_mapping_errors": report["churn"]["mapping_errors"] == 0,
    }
    if not args.short:
        checks["ops_ge_1e5"] = report["churn"]["alloc_free_calls"] >= 100_000
        race = report["unmap_race"]
        checks["unmap_waits_for_kernels"] = race["kernels_done_when_trim_returned"] and race["sum_correct"]
        checks["idle_footprint_within_1s"] = report["idle_footprint"]["within_1s"]
        two = report["two_processes"]
        checks["two_processes_share"] = (
            two["b_refused_while_a_held"]
            and two["b_took_fraction_of_a"] > 0.95
            and two["a_refused_while_b_held"]
            and two["a_allocates_again_after_b_released"]
            and two["b_exit_status"] == 0
        )
    report["checks"] = checks
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
