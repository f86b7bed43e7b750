"""Benchmark of the kvcached control plane: kvctl limits reaching a running process, CLI startup, and the
cost of the limit check on the alloc path.

Run it with the installed kvcached-core::

    python benchmarks/control_plane.py --device cpu --json --out benchmarks/results/control_plane_cpu.json

A workload process (``sys.executable`` running a small inline script) owns a ``KVCacheManager`` named
``bench-target`` whose control segment lives in a private runtime directory (``KVCACHED_RUNTIME_DIR`` set
to a fresh temporary directory, handed to the CLI as ``--runtime-dir``). What is measured:

* ``kvctl_to_enforcement``:

  - ``in_process_ms``: from the call of ``_native.request_limit(path, limit, revision)`` (what ``kvctl
    limit`` does) until ``_native.read_segment(path)["applied_revision"] >= revision``, polled in a tight
    loop. The limit alternates between two values far above the workload's use, one round at a time,
    with a short pause between rounds (kvctl calls are spaced out, so the owner's watcher is asleep).
    ``request_call_us`` is the ``request_limit`` call alone; ``polls`` is how many reads each round took.
    ``handled_revision_ms`` (where segments have it) and ``state_published_ms`` time the acknowledgment
    kvctl waits on and the published state showing the limit; ``state_behind_applied_rounds`` counts
    rounds where ``applied_revision`` was visible before the published limit or status had changed.
  - ``kvctl_main_in_process_ms``: ``kvctl.main(["--runtime-dir", D, "limit", NAME, SIZE])`` called in
    this process (scan, request, wait for the acknowledgment, print), without interpreter startup.
  - ``cli_ms``: a subprocess run of the ``kvctl`` console script, ``kvctl --runtime-dir D limit NAME
    SIZE``, which waits for the acknowledgment itself; its exit status must be 0 and its output must say
    ``applied``. This includes interpreter startup (see ``startup_ms``).

* ``enforcement``: limits set with the ``kvctl`` CLI bind the workload. With no blocks held, a limit of
  ``ENFORCE_LIMIT`` bytes: the workload allocates one block at a time until ``alloc`` returns None; it
  must stop at exactly the blocks that fit in the limit's whole pages, and the segment must show used and
  mapped bytes within the limit. Then a lower limit while those blocks are held: kvctl must report it
  ``deferred``, further allocation must fail, and after the workload frees its blocks the segment must
  turn ``applied`` with mapped bytes within the new limit (the reclaimer unmaps the excess; the time this
  took is reported). Finally ``none`` removes the limit and the workload must grow past the old one.
  Every check is listed with its outcome; ``ok`` is true when all pass.

* ``startup_ms``: wall time of ``kvctl --runtime-dir D list`` and ``kvtop --runtime-dir D --once`` run
  as subprocesses (with the workload live, so one row is listed), next to ``python -c pass`` and
  ``python -c "import kvcached_core"`` for scale. ``imports_torch`` runs each command's ``main`` in a
  fresh interpreter and reports whether ``torch`` ended up in ``sys.modules`` (``torch_installed`` says
  whether the check could have caught it).

* ``limit_check_cost``: the alloc+free pair for k=1 (``free(alloc(1))`` with both bound, timed in batches
  exactly as ``alloc_free.py`` does) on one manager with pages kept mapped, with no limit and with a
  limit far above its use (``set_memory_limit``), alternating the two conditions round by round (ABBA
  order) so that drift over the run falls on both. ``relative_difference_pct`` is (limit - no limit) /
  no limit of the pooled medians; ``per_round_difference_pct`` lists it per round and
  ``median_round_difference_pct`` is the median of those. Short rounds of few batches keep the two
  conditions close in time, so a burst of load from another process hits both.

Targets (top-level ``targets``): ``kvctl_to_enforcement_median_le_10ms`` (the in-process median is at most
10 ms *and* every enforcement check passed), ``startup_lt_300ms`` (both ``kvctl list`` and ``kvtop --once``
medians under 300 ms) and ``limit_check_cost_le_2pct`` (the two pair medians at most 2% apart).

With ``--json`` the result is printed as JSON; otherwise as a short table. ``--out FILE`` always writes
JSON. The exit status is 1 when an enforcement check fails, 2 for a device that cannot be used; a
library error (an acknowledgment that never comes, a failing kvctl) stops the run with a traceback. The
workload process and the temporary directory are removed however the run ends (short of SIGKILL, after which
the workload still exits at the end of its stdin but the directory stays). A run takes about ten seconds on
a small machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import io
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

# Shared with the other benchmarks here (this script's directory is sys.path[0]).
from _common import benchmark_parser, machine_info, positive_int, summarize, time_pair_batches, write_report

import kvcached_core
from kvcached_core import KVCacheManager, _native, kvctl
from kvcached_core.config import load_settings
from kvcached_core.segment import scan, segment_dir

TARGET_NAME = "bench-target"
WORKLOAD_NUM_BLOCKS = 8192
WORKLOAD_BLOCK_BYTES = 16384  # with 2 buffers and 2 MiB pages: 128 blocks per logical page of 4 MiB
WORKLOAD_RESERVED_PAGES = 2
WORKLOAD_RECLAIM_DELAY_MS = 10
TOGGLE_LIMITS = (1 << 30, 2 << 30)  # far above the workload's use: every request is "applied"
ENFORCE_LIMIT = 16 << 20
DEFERRED_LIMIT = 8 << 20
ACK_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 2.0
ROUND_PAUSE_S = 0.002  # between in-process rounds
KVCTL_MAIN_ROUNDS = 50
STARTUP_RUNS = 10
PAIR_ITERATIONS = 20000
PAIR_BATCHES_PER_ROUND = 3
PAIR_NUM_BLOCKS = 65536
PAIR_BLOCK_BYTES = 16384
PAIR_RESERVED_PAGES = 64
PAIR_WARM_BLOCKS = 1000
LARGE_LIMIT = 1 << 40  # far above anything the pair manager maps
LONG_RECLAIM_DELAY_MS = 600_000

# The workload: owns one manager and obeys one command per stdin line, answering one JSON line each.
# EOF on stdin (the benchmark exited, however) makes it close the manager and exit.
WORKLOAD_SCRIPT = r"""
import json, os, sys
from kvcached_core import KVCacheManager

device, name, num_blocks, block_bytes, reserved, delay = sys.argv[1:7]
mgr = KVCacheManager(
    num_blocks=int(num_blocks), block_bytes=int(block_bytes), num_layers=1, num_kv_buffers=2,
    device=device, name=name, reserved_pages=int(reserved), reclaim_delay_ms=int(delay),
)
held = []

def reply(**fields):
    fields["snapshot"] = mgr.snapshot()
    fields["held"] = len(held)
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()

reply(event="ready", pid=os.getpid(), page_bytes=mgr.page_bytes)
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "quit":
        break
    if words[0] == "grow":  # one block at a time, up to CAP held blocks, until alloc returns None
        cap, refused = int(words[1]), False
        while len(held) < cap:
            ids = mgr.alloc(1)
            if ids is None:
                refused = True
                break
            held.extend(ids)
        reply(event="grown", refused=refused)
    elif words[0] == "free":
        if held:
            mgr.free(held)
        held.clear()
        reply(event="freed")
    else:
        reply(event="error", error=f"unknown command {line!r}")
mgr.close()
"""


class LibraryError(RuntimeError):
    """The control plane did not do what it promises (no acknowledgment, a failing kvctl, ...)."""


# ---- the workload process -------------------------------------------------------------------------


class Workload:
    """The workload subprocess and its line protocol; stopped (then killed if need be) by ``stop()``."""

    def __init__(self, device: str, runtime_dir: str) -> None:
        """Start the workload with ``KVCACHED_RUNTIME_DIR=runtime_dir`` and wait for its first reply."""
        env = dict(os.environ, KVCACHED_RUNTIME_DIR=runtime_dir)
        self.stderr_path = os.path.join(runtime_dir, "workload.stderr")
        self._stderr = open(self.stderr_path, "w", encoding="utf-8")  # closed in stop()
        args = [
            sys.executable,
            "-c",
            WORKLOAD_SCRIPT,
            device,
            TARGET_NAME,
            str(WORKLOAD_NUM_BLOCKS),
            str(WORKLOAD_BLOCK_BYTES),
            str(WORKLOAD_RESERVED_PAGES),
            str(WORKLOAD_RECLAIM_DELAY_MS),
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=runtime_dir,  # never the checkout: its kvcached_core has no native module
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        self.ready = self._reply()
        if self.ready.get("event") != "ready":
            raise LibraryError(f"workload did not start: {self.ready}")

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _stderr_tail(self) -> str:
        try:
            with open(self.stderr_path, encoding="utf-8") as fh:
                return fh.read()[-2000:]
        except OSError:
            return ""

    def _reply(self) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise LibraryError(
                f"workload gave no reply in {REPLY_TIMEOUT_S} s; stderr: {self._stderr_tail()}"
            ) from None
        if line is None:
            raise LibraryError(f"workload exited (status {self.proc.poll()}); stderr: {self._stderr_tail()}")
        return json.loads(line)

    def command(self, text: str) -> dict[str, Any]:
        """Send one command line and return the workload's JSON reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if reply.get("event") == "error":
            raise LibraryError(f"workload: {reply['error']}")
        return reply

    def stop(self) -> int | None:
        """Ask the workload to quit, kill it if it does not within 10 s; returns its exit status."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            status = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self._stderr.close()
        return status


def find_segment(directory: str, name: str) -> str:
    """Path of the one live segment of instance ``name`` in ``directory``."""
    found = [s.path for s in scan(directory).live if s.info["name"] == name]
    if len(found) != 1:
        raise LibraryError(f"expected one live segment named {name!r} in {directory}, found {found}")
    return found[0]


def next_revision(path: str) -> int:
    """The revision kvctl would use next for this segment."""
    info = _native.read_segment(path)
    return 1 + max(info["request_revision"], info["applied_revision"], info["limit_revision"])


# ---- 1. kvctl to enforcement ----------------------------------------------------------------------


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


# ---- 1c. enforcement ------------------------------------------------------------------------------


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


# ---- 2. startup -----------------------------------------------------------------------------------

TORCH_PROBE = r"""
import contextlib, io, json, sys
from kvcached_core import {module}
with contextlib.redirect_stdout(io.StringIO()):
    status = {module}.main({argv!r})
print(json.dumps({{"status": status, "torch": "torch" in sys.modules}}))
"""


def imports_torch(module: str, argv: list[str], cwd: str) -> dict[str, Any]:
    """Runs ``kvcached_core.<module>.main(argv)`` in a fresh interpreter; did it import torch?"""
    code = TORCH_PROBE.format(module=module, argv=argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=60)
    if done.returncode != 0:
        raise LibraryError(f"{module}.main({argv}) probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_startup(runtime_dir: str, runs: int) -> dict[str, Any]:
    """Subprocess wall time of ``kvctl list`` and ``kvtop --once`` (interleaved), with baselines."""
    commands = {
        "kvctl_list": cli_command("kvctl") + ["--runtime-dir", runtime_dir, "list"],
        "kvtop_once": cli_command("kvtop") + ["--runtime-dir", runtime_dir, "--once"],
        "python_bare": [sys.executable, "-c", "pass"],
        "python_import_kvcached_core": [sys.executable, "-c", "import kvcached_core"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(runs + 1):
        for name, args in commands.items():
            elapsed, done = run_timed(args, runtime_dir)
            if done.returncode != 0:
                raise LibraryError(f"{' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
            if name in ("kvctl_list", "kvtop_once") and TARGET_NAME not in done.stdout:
                raise LibraryError(f"{' '.join(args)} does not list the live {TARGET_NAME}: {done.stdout!r}")
            if i >= 1:
                times[name].append(elapsed)
    torch_installed = importlib.util.find_spec("torch") is not None
    kvctl_probe = imports_torch("kvctl", ["--runtime-dir", runtime_dir, "list"], runtime_dir)
    kvtop_probe = imports_torch("kvtop", ["--runtime-dir", runtime_dir, "--once"], runtime_dir)
    return {
        "startup_ms": {name: summarize(values) for name, values in times.items()},
        "imports_torch": {"kvctl_list": kvctl_probe["torch"], "kvtop_once": kvtop_probe["torch"]},
        "torch_installed": torch_installed,
    }


# ---- 3. limit check cost --------------------------------------------------------------------------


def measure_limit_check_cost(device: str, runtime_dir: str, rounds: int, batches: int) -> dict[str, Any]:
    """Pair k=1 per call with no limit and with a large one, alternating (ABBA) on one manager."""
    mgr = KVCacheManager(
        num_blocks=PAIR_NUM_BLOCKS,
        block_bytes=PAIR_BLOCK_BYTES,
        num_layers=1,
        num_kv_buffers=2,
        device=device,
        name="bench-pair",
        reserved_pages=PAIR_RESERVED_PAGES,
        reclaim_delay_ms=LONG_RECLAIM_DELAY_MS,
        settings=load_settings(runtime_dir=runtime_dir),
    )
    try:
        ids = mgr.alloc(PAIR_WARM_BLOCKS)
        if ids is None:
            raise LibraryError(f"alloc({PAIR_WARM_BLOCKS}) for the warm-up returned None: {mgr.snapshot()}")
        mgr.free(ids)
        mapped_before = mgr.snapshot()["mapped_pages"]
        alloc, free = mgr.alloc, mgr.free
        time_pair_batches(alloc, free, 1, PAIR_ITERATIONS // 10, 2)
        samples: dict[str, list[float]] = {"no_limit": [], "large_limit": []}
        per_round: list[float] = []
        for r in range(rounds):
            order = ("no_limit", "large_limit") if r % 2 == 0 else ("large_limit", "no_limit")
            medians: dict[str, float] = {}
            for condition in order:
                result = mgr.set_memory_limit(LARGE_LIMIT if condition == "large_limit" else None)
                if result["status"] != "applied":
                    raise LibraryError(f"set_memory_limit for {condition} returned {result}")
                batch = time_pair_batches(alloc, free, 1, PAIR_ITERATIONS, batches)
                samples[condition].extend(batch)
                medians[condition] = statistics.median(batch)
            per_round.append(round(100 * (medians["large_limit"] / medians["no_limit"] - 1), 3))
        mapped_after = mgr.snapshot()["mapped_pages"]
        if mapped_after != mapped_before:
            raise LibraryError(f"mapped pages changed during the pair loops: {mapped_before} -> {mapped_after}")
    finally:
        mgr.close()
    no_limit = summarize(samples["no_limit"])
    large = summarize(samples["large_limit"])
    return {
        "pair_us_no_limit": no_limit,
        "pair_us_large_limit": large,
        "relative_difference_pct": round(100 * (large["median"] / no_limit["median"] - 1), 3),
        "per_round_difference_pct": per_round,
        "median_round_difference_pct": round(statistics.median(per_round), 3),
        "large_limit_bytes": LARGE_LIMIT,
        "rounds": rounds,
        "batches_per_round": batches,
        "iterations_per_batch": PAIR_ITERATIONS,
        "mapped_pages": mapped_before,
    }


# ---- report ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def private_runtime_dir() -> Iterator[str]:
    """A fresh owner-only temporary directory, removed on the way out."""
    path = tempfile.mkdtemp(prefix="kvcached-bench-")
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def source_info() -> dict[str, Any]:
    """The checkout this script belongs to (commit and changed files), as far as git can tell.

    The numbers come from the installed package, which is normally built from this checkout; a dirty
    tree says that it may hold changes the commit does not.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "changed_files": None}
    return {"commit": commit, "changed_files": [line[3:] for line in changed]}


def evaluate_targets(results: dict[str, Any]) -> dict[str, bool]:
    """The control plane's targets, as pass/fail."""
    ack = results["kvctl_to_enforcement"]["in_process_ms"]["median"]
    startup = results["startup_ms"]
    cost = results["limit_check_cost"]["relative_difference_pct"]
    return {
        "kvctl_to_enforcement_median_le_10ms": ack <= 10.0 and results["enforcement"]["ok"],
        "startup_lt_300ms": startup["kvctl_list"]["median"] < 300.0 and startup["kvtop_once"]["median"] < 300.0,
        "limit_check_cost_le_2pct": abs(cost) <= 2.0,
    }


def run_all(device: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement; the workload and the temporary directory are gone when it returns or raises."""
    results: dict[str, Any] = {}
    with private_runtime_dir() as runtime_dir:
        work = Workload(device, runtime_dir)
        try:
            directory = segment_dir(load_settings(runtime_dir=runtime_dir))
            path = find_segment(directory, TARGET_NAME)
            ack = measure_in_process(path, args.rounds)
            ack["kvctl_main_in_process_ms"] = measure_kvctl_main(runtime_dir, KVCTL_MAIN_ROUNDS)
            ack["cli_ms"] = measure_cli_limit(runtime_dir, path, args.cli_runs)
            results["kvctl_to_enforcement"] = ack
            results["enforcement"] = check_enforcement(work, runtime_dir, path)
            results.update(measure_startup(runtime_dir, args.startup_runs))
        finally:
            results["workload_exit_status"] = work.stop()
        results["limit_check_cost"] = measure_limit_check_cost(
            device, runtime_dir, args.pair_rounds, PAIR_BATCHES_PER_ROUND
        )
    return results


def build_report(device: str, args: argparse.Namespace) -> dict[str, Any]:
    """The full JSON document: metadata, results and targets."""
    started = dt.datetime.now(dt.timezone.utc)
    results = run_all(device, args)
    return {
        "benchmark": "control_plane",
        "device": device,
        "machine": machine_info(device),
        "timestamp": started.isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "source": source_info(),
        "native_module": kvcached_core._native.__file__,
        "parameters": {
            "ack_rounds": args.rounds,
            "kvctl_main_rounds": KVCTL_MAIN_ROUNDS,
            "cli_runs": args.cli_runs,
            "startup_runs": args.startup_runs,
            "pair_rounds": args.pair_rounds,
            "watch_interval_ms": load_settings().watch_interval_ms,
            "workload_manager": {
                "num_blocks": WORKLOAD_NUM_BLOCKS,
                "block_bytes": WORKLOAD_BLOCK_BYTES,
                "num_layers": 1,
                "num_kv_buffers": 2,
                "reserved_pages": WORKLOAD_RESERVED_PAGES,
                "reclaim_delay_ms": WORKLOAD_RECLAIM_DELAY_MS,
            },
            "pair_manager": {
                "num_blocks": PAIR_NUM_BLOCKS,
                "block_bytes": PAIR_BLOCK_BYTES,
                "num_layers": 1,
                "num_kv_buffers": 2,
                "reserved_pages": PAIR_RESERVED_PAGES,
            },
        },
        "duration_s": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds(), 2),
        "results": results,
        "targets": evaluate_targets(results),
    }


def format_table(report: dict[str, Any]) -> str:
    """A short human-readable summary of the report."""
    r = report["results"]
    ack = r["kvctl_to_enforcement"]
    rows = [
        ("request_limit -> applied (ms)", ack["in_process_ms"]),
        ("kvctl.main limit, in process (ms)", ack["kvctl_main_in_process_ms"]),
        ("kvctl limit subprocess (ms)", ack["cli_ms"]),
    ]
    rows += [(f"startup {name} (ms)", s) for name, s in r["startup_ms"].items()]
    cost = r["limit_check_cost"]
    rows += [
        ("pair k=1, no limit (us)", cost["pair_us_no_limit"]),
        ("pair k=1, large limit (us)", cost["pair_us_large_limit"]),
    ]
    lines = [
        f"control_plane on {report['device']} ({report['machine']['node']})",
        f"{'':40}{'median':>10}{'p99':>10}",
    ]
    lines += [f"{name:40}{s['median']:>10.3f}{s['p99']:>10.3f}" for name, s in rows]
    lines.append(
        f"limit check cost: {cost['relative_difference_pct']:+.2f}% "
        f"(median of {cost['rounds']} rounds {cost['median_round_difference_pct']:+.2f}%)"
    )
    failed = [c["check"] for c in r["enforcement"]["checks"] if not c["passed"]]
    lines.append(f"enforcement: {'ok' if r['enforcement']['ok'] else 'FAILED: ' + '; '.join(failed)}")
    lines.append(f"imports torch: {r['imports_torch']} (torch installed: {r['torch_installed']})")
    lines.append("targets: " + ", ".join(f"{k}={v}" for k, v in report["targets"].items()))
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; bad arguments exit with status 2 (argparse)."""
    parser = benchmark_parser(
        "Benchmark the kvcached control plane: kvctl limit to enforcement, kvctl/kvtop startup, "
        "and the cost of the limit check on alloc."
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=200, metavar="N", help="in-process limit rounds (default: 200)"
    )
    parser.add_argument(
        "--cli-runs", type=positive_int, default=20, metavar="N", help="kvctl limit subprocess runs (default: 20)"
    )
    parser.add_argument(
        "--startup-runs",
        type=positive_int,
        default=STARTUP_RUNS,
        metavar="N",
        help=f"runs of each startup command (default: {STARTUP_RUNS})",
    )
    parser.add_argument(
        "--pair-rounds",
        type=positive_int,
        default=40,
        metavar="N",
        help="alternating rounds of the pair loop with and without a limit (default: 40)",
    )
    return parser.parse_args(argv)


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the workload


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print or write its report."""
    args = parse_args(argv)
    if args.device.startswith("cuda") and "cuda" not in kvcached_core.available_backends():
        print(f"device {args.device} unavailable: {kvcached_core.cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    report = build_report(args.device, args)
    text = write_report(report, args.out)
    print(text if args.json else format_table(report))
    if not report["results"]["enforcement"]["ok"]:
        print("enforcement check failed; see results.enforcement.checks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
