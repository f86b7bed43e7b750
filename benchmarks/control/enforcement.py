"""Whether limits set with kvctl bind the workload: stop at the limit, defer below use, apply after frees,
lift."""

from __future__ import annotations

import time
from typing import Any

from kvcached_core import _native

from .acknowledgement import kvctl_limit
from .workload import WORKLOAD_BLOCK_BYTES, WORKLOAD_NUM_BLOCKS, Workload

ENFORCE_LIMIT = 16 << 20
DEFERRED_LIMIT = 8 << 20
SETTLE_TIMEOUT_S = 2.0


def wait_segment(path: str, ok: Any, timeout_s: float = SETTLE_TIMEOUT_S) -> tuple[bool, float, dict[str, Any]]:
    """Poll the segment until ``ok(info)``; returns (reached, milliseconds waited, last info)."""
    start = time.perf_counter_ns()
    deadline = time.monotonic() + timeout_s
    while True:
        info = _native.read_segment(path)
        if ok(info):
            return True, (time.perf_counter_ns() - start) / 1e6, info
        if time.monotonic() > deadline:
            return False, (time.perf_counter_ns() - start) / 1e6, info
        time.sleep(0.001)


def check_enforcement(work: Workload, runtime_dir: str, path: str) -> dict[str, Any]:
    """Limits set with the kvctl CLI bound the workload's allocation (see the module docstring)."""
    page = work.ready["page_bytes"]
    logical_page = page * 2  # two buffers (K and V) per logical page
    per_page = page // WORKLOAD_BLOCK_BYTES
    checks: list[dict[str, Any]] = []

    def check(what: str, passed: bool, detail: Any) -> None:
        checks.append({"check": what, "passed": bool(passed), "detail": detail})

    work.command("free")
    # A limit with nothing held, then grow until alloc refuses.
    _, done = kvctl_limit(runtime_dir, str(ENFORCE_LIMIT))
    check("kvctl limit 16M reports applied", "applied" in done.stdout, done.stdout.strip())
    expected = ENFORCE_LIMIT // logical_page * per_page
    grown = work.command(f"grow {WORKLOAD_NUM_BLOCKS}")
    snap = grown["snapshot"]
    check(
        f"alloc stops at the {expected} blocks that fit in the limit",
        grown["refused"] and grown["held"] == expected,
        {"held": grown["held"], "refused": grown["refused"]},
    )
    check("used_bytes <= limit (workload snapshot)", snap["used_bytes"] <= ENFORCE_LIMIT, snap)
    reached, waited, info = wait_segment(
        path, lambda i: i["allocated_blocks"] == grown["held"] and i["mapped_bytes"] <= ENFORCE_LIMIT
    )
    check(
        "segment shows mapped_bytes <= limit",
        reached,
        {"mapped_bytes": info["mapped_bytes"], "used_bytes": info["used_bytes"], "waited_ms": round(waited, 3)},
    )

    # A lower limit while held: deferred, no further allocation, applied once freed.
    _, done = kvctl_limit(runtime_dir, str(DEFERRED_LIMIT))
    check("kvctl limit 8M below use reports deferred", "deferred" in done.stdout, done.stdout.strip())
    info = _native.read_segment(path)
    check("segment limit_status is deferred", info["limit_status"] == "deferred", info["limit_status"])
    again = work.command(f"grow {grown['held'] + 1}")
    check(
        "alloc refuses while above a deferred limit",
        again["refused"] and again["held"] == grown["held"],
        {"held": again["held"], "refused": again["refused"]},
    )
    work.command("free")
    reached, shrink_ms, info = wait_segment(
        path, lambda i: i["limit_status"] == "applied" and i["mapped_bytes"] <= DEFERRED_LIMIT
    )
    check(
        "after free: status applied and mapped_bytes <= new limit",
        reached,
        {"limit_status": info["limit_status"], "mapped_bytes": info["mapped_bytes"], "waited_ms": round(shrink_ms, 3)},
    )
    expected_low = DEFERRED_LIMIT // logical_page * per_page
    grown_low = work.command(f"grow {WORKLOAD_NUM_BLOCKS}")
    check(
        f"alloc stops at the {expected_low} blocks of the lower limit",
        grown_low["refused"] and grown_low["held"] == expected_low,
        {"held": grown_low["held"], "refused": grown_low["refused"]},
    )

    # No limit: the workload grows past the old one.
    work.command("free")
    _, done = kvctl_limit(runtime_dir, "none")
    check("kvctl limit none reports applied", "applied" in done.stdout, done.stdout.strip())
    past = 2 * expected
    unbounded = work.command(f"grow {past}")
    check(
        f"without a limit alloc grows to {past} blocks",
        not unbounded["refused"] and unbounded["held"] == past,
        {"held": unbounded["held"], "refused": unbounded["refused"]},
    )
    work.command("free")
    return {
        "ok": all(c["passed"] for c in checks),
        "limit_bytes": ENFORCE_LIMIT,
        "deferred_limit_bytes": DEFERRED_LIMIT,
        "blocks_per_logical_page": per_page,
        "logical_page_bytes": logical_page,
        "shrink_to_applied_ms": round(shrink_ms, 3),
        "checks": checks,
    }
