"""What operation counting costs, and how fast snapshots are while the allocator is busy.

    python benchmarks/operation_counters.py [--json] [--out FILE] [--rounds N]

1. ``pair_us``: the alloc+free pair (k=1, pages mapped) of two builds of this checkout made here with
   CMake, one with counting compiled in and one with ``-DKVCACHED_NO_COUNTERS=ON``. Each round runs both
   builds in fresh processes, alternating which goes first, so drift on the machine hits both alike.
   Where valgrind is installed, ``instructions_per_pair`` counts the instructions of a pair in each build
   under callgrind: a repeatable figure, unlike time on a shared VM, and the one the target (counting
   costs <= 2%) is judged on when present.
2. ``snapshots``: ``operation_snapshot()`` and ``snapshot()`` called back to back while another thread
   allocates and frees without pause (target: p99 <= 20 us). Neither takes the allocator lock.

Needs cmake and pybind11 (the test extra installs it) to build the second variant.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kvcached_core

REPO = Path(__file__).resolve().parent.parent
PAIR_SCRIPT = """
import gc, statistics, sys, time, kvcached_core as kc
assert kc._native.counting == (sys.argv[1] == "on"), "wrong build imported"
s = kc.load_settings({}, control=False, pool_target=0, runtime_dir=sys.argv[2])
m = kc.KVCacheManager(65536, 16384, 1, 2, settings=s, reserved_pages=64)
m.free(m.alloc(1000))
a, f, clock = m.alloc, m.free, time.perf_counter_ns
gc.disable()
batches, iterations = [], int(sys.argv[3])
for _ in range(int(sys.argv[4])):
    t = clock()
    for _ in range(iterations):
        f(a(1))
    batches.append((clock() - t) / max(iterations, 1) / 1000)
print(statistics.median(batches))
m.close()
"""
CALLGRIND_PAIRS = 20000


def build_variant(workdir: Path, counting: bool) -> Path:
    """Builds the checkout with counting compiled in or out; returns a directory to put on PYTHONPATH.

    Both variants are built here, the same way, so they differ in nothing but KVCACHED_NO_COUNTERS.
    """
    import pybind11

    name = "on" if counting else "off"
    build = workdir / f"build-{name}"
    cmd = [
        "cmake",
        "-S",
        str(REPO),
        "-B",
        str(build),
        f"-DKVCACHED_NO_COUNTERS={'OFF' if counting else 'ON'}",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], check=True, capture_output=True)
    site = workdir / f"site-{name}"
    package = Path(kvcached_core.__file__).parent
    shutil.copytree(package, site / "kvcached_core", ignore=shutil.ignore_patterns("_native*"))
    for built in build.glob("_native*.so"):
        shutil.copy(built, site / "kvcached_core")
    return site


def run_pair(
    variant: str, site: Path | None, runtime: str, iterations: int = 20000, batches: int = 15, wrapper: tuple = ()
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    argv = [*wrapper, sys.executable, "-c", PAIR_SCRIPT, variant, runtime, str(iterations), str(batches)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=runtime)
    if out.returncode != 0:
        raise RuntimeError(f"pair run ({variant}) failed: {out.stderr.strip()[-500:]}")
    return out


def instructions(variant: str, site: Path | None, runtime: str, iterations: int) -> int:
    """Instructions a whole pair-script run executes under callgrind (repeatable, unlike time)."""
    wrapper = ("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null")
    err = run_pair(variant, site, runtime, iterations, 1, wrapper).stderr
    match = re.search(r"Collected : (\d+)", err)
    if match is None:
        raise RuntimeError(f"no instruction count in callgrind's output: {err[-300:]}")
    return int(match.group(1))


def measure_instructions(sites: dict[str, Path], runtime: str) -> dict[str, Any] | None:
    """Instructions per alloc+free pair with counting on and off: the difference of a run with
    CALLGRIND_PAIRS pairs and one with none, so start-up cancels out."""
    if shutil.which("valgrind") is None:
        return None
    per_pair = {}
    for variant, path in sites.items():
        many = instructions(variant, path, runtime, CALLGRIND_PAIRS)
        none = instructions(variant, path, runtime, 0)
        per_pair[variant] = (many - none) / CALLGRIND_PAIRS
    return {
        "counting_on": round(per_pair["on"], 1),
        "counting_off": round(per_pair["off"], 1),
        "overhead_pct": round(100 * (per_pair["on"] - per_pair["off"]) / per_pair["off"], 2),
    }


def measure_counting_cost(rounds: int, workdir: Path) -> dict[str, Any]:
    sites = {"on": build_variant(workdir, True), "off": build_variant(workdir, False)}
    runtime = str(workdir)
    on: list[float] = []
    off: list[float] = []
    for r in range(rounds):
        order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
        for variant in order:
            path = sites[variant]
            (on if variant == "on" else off).append(float(run_pair(variant, path, runtime).stdout.strip()))
    med_on, med_off = statistics.median(on), statistics.median(off)
    return {
        "instructions_per_pair": measure_instructions(sites, runtime),
        "counting_on_us": {"median": round(med_on, 4), "samples": [round(x, 4) for x in on]},
        "counting_off_us": {"median": round(med_off, 4), "samples": [round(x, 4) for x in off]},
        "overhead_pct": round(100 * (med_on - med_off) / med_off, 2),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_snapshots(workdir: Path) -> dict[str, Any]:
    s = kvcached_core.load_settings({}, runtime_dir=str(workdir), reclaim_delay_ms=1)
    mgr = kvcached_core.KVCacheManager(65536, 16384, 1, 2, settings=s, reserved_pages=2)
    stop = threading.Event()
    pairs = [0]

    def churn() -> None:
        a, f = mgr.alloc, mgr.free
        while not stop.is_set():
            for k in (1, 7, 64, 300):
                f(a(k))
            pairs[0] += 4

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        ops_t: list[float] = []
        occ_t: list[float] = []
        clock = time.perf_counter_ns
        for _ in range(20000):
            t = clock()
            mgr.operation_snapshot()
            ops_t.append((clock() - t) / 1000)
            t = clock()
            mgr.snapshot()
            occ_t.append((clock() - t) / 1000)
    finally:
        stop.set()
        worker.join()
        mgr.close()
    return {
        "operation_snapshot_us": {
            "median": round(statistics.median(ops_t), 3),
            "p99": round(percentile(ops_t, 0.99), 3),
        },
        "snapshot_us": {"median": round(statistics.median(occ_t), 3), "p99": round(percentile(occ_t, 0.99), 3)},
        "allocator_pairs_during_run": pairs[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds of both builds (default 6)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-") as tmp:
        workdir = Path(tmp)
        results: dict[str, Any] = {"pair_us": measure_counting_cost(args.rounds, workdir)}
        results["snapshots"] = measure_snapshots(workdir)
    counted = results["pair_us"]["instructions_per_pair"]
    cost_pct = counted["overhead_pct"] if counted else results["pair_us"]["overhead_pct"]
    results["targets"] = {
        "counting_cost_le_2pct": cost_pct <= 2.0,
        "snapshot_p99_le_20us": results["snapshots"]["operation_snapshot_us"]["p99"] <= 20.0
        and results["snapshots"]["snapshot_us"]["p99"] <= 20.0,
    }
    report = {
        "benchmark": "operation_counters",
        "machine": {
            "node": platform.node(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "kvcached_core": kvcached_core.__version__,
        },
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/operation_counters.py", *(argv if argv is not None else sys.argv[1:])]),
        "duration_s": round(time.time() - started, 1),
        "results": results,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        p, snaps = results["pair_us"], results["snapshots"]
        print(
            f"pair k=1: counting on {p['counting_on_us']['median']} us, off {p['counting_off_us']['median']} us "
            f"({p['overhead_pct']:+.2f}%)"
        )
        print(
            f"operation_snapshot p99 {snaps['operation_snapshot_us']['p99']} us, "
            f"snapshot p99 {snaps['snapshot_us']['p99']} us (allocator busy)"
        )
        print(f"targets: {results['targets']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
