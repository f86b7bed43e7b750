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
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

# Shared with the other benchmarks here (this script's directory is sys.path[0]).
from _common import PAIR_MANAGER, benchmark_parser, machine_info, positive_int, write_report
from control.acknowledgement import measure_cli_limit, measure_in_process, measure_kvctl_main
from control.enforcement import check_enforcement
from control.limit_check import measure_limit_check_cost
from control.startup import measure_startup
from control.workload import (
    TARGET_NAME,
    WORKLOAD_BLOCK_BYTES,
    WORKLOAD_NUM_BLOCKS,
    WORKLOAD_RECLAIM_DELAY_MS,
    WORKLOAD_RESERVED_PAGES,
    Workload,
    find_segment,
)

import kvcached_core
from kvcached_core.config import load_settings
from kvcached_core.segment import segment_dir

KVCTL_MAIN_ROUNDS = 50
STARTUP_RUNS = 10
PAIR_BATCHES_PER_ROUND = 3


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
            "pair_manager": PAIR_MANAGER,
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
