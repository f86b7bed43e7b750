"""How long a limit takes to reach a running process: in process, through kvctl.main, and as a kvctl
command."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

# Shared with the other benchmarks here (this script's directory is sys.path[0]).
from _common import summarize

from kvcached_core import _native, kvctl

from .workload import TARGET_NAME, LibraryError, next_revision

TOGGLE_LIMITS = (1 << 30, 2 << 30)  # far above the workload's use: every request is "applied"
ACK_TIMEOUT_S = 2.0
ROUND_PAUSE_S = 0.002  # between in-process rounds


def measure_in_process(path: str, rounds: int) -> dict[str, Any]:
    """Milliseconds from ``request_limit`` to the owner's acknowledgment, limits alternating.

    Each round polls ``read_segment`` until three things have happened, and times each from the call:
    ``applied_revision >= revision`` (the owner's allocator enforces the limit: the headline),
    ``handled_revision >= revision`` (where the segment has that field: the acknowledgment that kvctl of
    this version waits on) and ``limit_revision >= revision`` (the published state shows the limit).
    A round where the published limit or status was still the old one when ``applied_revision`` was
    seen is counted in ``state_behind_applied_rounds`` (the first such segment is kept as an example).
    """
    clock = time.perf_counter_ns
    read, request = _native.read_segment, _native.request_limit
    has_handled = "handled_revision" in read(path)
    times: dict[str, list[float]] = {"applied": [], "handled": [], "state": []}
    call_us: list[float] = []
    polls: list[int] = []
    statuses: Counter[str] = Counter()
    behind: list[dict[str, Any]] = []
    handled_inconsistent: list[dict[str, Any]] = []
    revision = next_revision(path)
    for i in range(rounds + 2):  # two warm-up rounds
        limit = TOGGLE_LIMITS[i % 2]
        time.sleep(ROUND_PAUSE_S)
        start = clock()
        request(path, limit, revision)
        requested = clock()
        deadline = requested + int(ACK_TIMEOUT_S * 1e9)
        seen: dict[str, tuple[int, dict[str, Any]]] = {}
        wanted = ("applied", "handled", "state") if has_handled else ("applied", "state")
        count = 0
        while len(seen) < len(wanted):
            info = read(path)
            now = clock()
            count += 1
            if "applied" not in seen and info["applied_revision"] >= revision:
                seen["applied"] = (now, info)
            if has_handled and "handled" not in seen and info["handled_revision"] >= revision:
                seen["handled"] = (now, info)
            if "state" not in seen and info["limit_revision"] >= revision:
                seen["state"] = (now, info)
            if now > deadline:
                raise LibraryError(
                    f"revision {revision} (limit {limit}): only {sorted(seen)} of {list(wanted)} seen in "
                    f"{ACK_TIMEOUT_S} s; segment: {info}"
                )
        at_applied = seen["applied"][1]
        if at_applied["applied_limit_bytes"] != limit:
            raise LibraryError(f"revision {revision} applied with the wrong limit (asked {limit}): {at_applied}")
        if seen["state"][1]["limit_bytes"] != limit:
            raise LibraryError(f"revision {revision} published with the wrong limit (asked {limit}): {seen['state']}")
        if i < 2:
            revision += 1
            continue
        if at_applied["limit_bytes"] != limit or at_applied["limit_status"] != "applied":
            behind.append({"revision": revision, "limit": limit, "segment_at_applied_revision": at_applied})
        if has_handled:
            at_handled = seen["handled"][1]
            if at_handled["limit_bytes"] != limit or at_handled["applied_revision"] < revision:
                handled_inconsistent.append({"revision": revision, "limit": limit, "segment": at_handled})
        for key, (when, _) in seen.items():
            times[key].append((when - start) / 1e6)
        call_us.append((requested - start) / 1e3)
        polls.append(count)
        statuses[at_applied["limit_status"]] += 1
        revision += 1
    return {
        "in_process_ms": summarize(times["applied"]),
        "handled_revision_ms": summarize(times["handled"]) if has_handled else None,
        "state_published_ms": summarize(times["state"]),
        "request_call_us": summarize(call_us),
        "polls": {"median": statistics.median(polls), "max": max(polls)},
        "statuses_at_applied_revision": dict(statuses),
        "state_behind_applied_rounds": len(behind),
        "state_behind_applied_example": behind[0] if behind else None,
        "handled_but_state_behind_rounds": len(handled_inconsistent) if has_handled else None,
        "handled_but_state_behind_example": handled_inconsistent[0] if handled_inconsistent else None,
        "segment_has_handled_revision": has_handled,
        "limits": list(TOGGLE_LIMITS),
        "round_pause_ms": ROUND_PAUSE_S * 1000,
    }


def measure_kvctl_main(runtime_dir: str, rounds: int) -> dict[str, Any]:
    """Milliseconds of ``kvctl.main([... 'limit', NAME, SIZE])`` in this process (output captured)."""
    times: list[float] = []
    for i in range(rounds + 2):
        argv = ["--runtime-dir", runtime_dir, "limit", TARGET_NAME, str(TOGGLE_LIMITS[i % 2])]
        out = io.StringIO()
        time.sleep(ROUND_PAUSE_S)
        start = time.perf_counter_ns()
        with contextlib.redirect_stdout(out):
            status = kvctl.main(argv)
        elapsed = (time.perf_counter_ns() - start) / 1e6
        if status != 0 or "applied" not in out.getvalue():
            raise LibraryError(f"kvctl.main({argv}) returned {status}, printed {out.getvalue()!r}")
        if i >= 2:
            times.append(elapsed)
    return summarize(times)


def cli_command(name: str) -> list[str]:
    """The console script ``name`` of this interpreter's environment (else ``python -m``)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which(name)
    return [found] if found else [sys.executable, "-m", f"kvcached_core.{name}"]


def run_timed(args: Sequence[str], cwd: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Milliseconds taken by one subprocess run of ``args``, and its completed process."""
    start = time.perf_counter_ns()
    done = subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, timeout=60)
    return (time.perf_counter_ns() - start) / 1e6, done


def kvctl_limit(runtime_dir: str, size: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run ``kvctl --runtime-dir D limit bench-target SIZE``; raise unless it exits 0."""
    args = cli_command("kvctl") + ["--runtime-dir", runtime_dir, "limit", TARGET_NAME, size]
    elapsed, done = run_timed(args, runtime_dir)
    if done.returncode != 0:
        raise LibraryError(f"{' '.join(args)} exited {done.returncode}; stdout {done.stdout!r}; stderr {done.stderr!r}")
    return elapsed, done


def measure_cli_limit(runtime_dir: str, path: str, runs: int) -> dict[str, Any]:
    """Milliseconds of ``kvctl limit`` subprocess runs (limits alternating), each checked on the segment."""
    times: list[float] = []
    for i in range(runs + 1):
        limit = TOGGLE_LIMITS[i % 2]
        elapsed, done = kvctl_limit(runtime_dir, str(limit))
        if "applied" not in done.stdout:
            raise LibraryError(f"kvctl limit {limit} did not report 'applied': {done.stdout!r}")
        info = _native.read_segment(path)
        if info["limit_bytes"] != limit:
            raise LibraryError(f"kvctl limit {limit} exited 0 but the segment shows {info['limit_bytes']}")
        if i >= 1:
            times.append(elapsed)
    result: dict[str, Any] = summarize(times)
    result["command"] = " ".join(cli_command("kvctl") + ["--runtime-dir", "D", "limit", TARGET_NAME, "SIZE"])
    return result
