"""kvctl: see and cap the kvcached instances running on this machine.

    kvctl list [--json]              every live instance and pool
    kvctl limit NAME SIZE            cap an instance (512M, 2G, 1.5GiB, bytes, or "none")
    kvctl limit-percent NAME PCT     cap an instance at PCT percent of its device's memory
    kvctl gc                         remove segments (and page tables) whose owner is gone

Exit status: 0 done; 1 the instance (or one of its processes) is gone; 2 bad input (one line on stderr,
nothing changed); 3 a process of the instance is alive but did not take the limit within its wait: it is
stopped (SIGSTOP, a debugger) or busy, and takes it when it runs again, or its segment was locked by another
process and nothing was requested there. Every wait is bounded (about a second for the acknowledgement,
two for a lock).
A limit applies to each process of the instance (each holds memory on its own device); inside one process
it is split across the pools in proportion to their virtual capacity.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

from . import _native
from .config import ConfigError, load_settings
from .segment import Scan, Segment, collect, collect_page_tables, rows, scan, segment_dir
from .units import format_bytes, parse_size

ACK_TIMEOUT_S = 1.0  # how long `limit` waits for every owner to acknowledge


class UsageError(Exception):
    """Bad input: exit 2, nothing changed."""


class GoneError(Exception):
    """The instance (or one of its processes) is not running: exit 1."""


class NotTakenError(Exception):
    """A live process of the instance did not take the request (locked segment): exit 3."""


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``T``/``t``: stopped), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def warn_skipped(found: Scan, prog: str) -> None:
    for path, why in found.bad:
        print(f"{prog}: skipping {path}: {why}", file=sys.stderr)


def format_table(table: list[dict]) -> str:
    header = ("NAME", "PID", "ENGINE", "DEVICE", "POOL", "LIMIT", "MAPPED", "USED")
    lines = [header]
    for r in table:
        limit = format_bytes(r["limit_bytes"])
        if r["limit_status"] == "deferred":
            limit += " (shrinking)"
        lines.append(
            (
                r["name"],
                str(r["pid"]),
                r["engine"],
                r["device"],
                r["pool_name"],
                limit,
                format_bytes(r["mapped_bytes"]),
                format_bytes(r["used_bytes"]),
            )
        )
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def cmd_list(directory: str, as_json: bool) -> int:
    found = scan(directory)
    warn_skipped(found, "kvctl")
    table = rows(found.live)
    print(json.dumps(table, indent=2) if as_json else format_table(table))
    if found.stale and not as_json:
        print(f"({len(found.stale)} stale segment(s) of dead processes; `kvctl gc` removes them)", file=sys.stderr)
    return 0


def split_limit(limit: int | None, pools: Sequence[Segment]) -> list[int | None]:
    """Shares of one process's limit for its pools, in proportion to virtual capacity; they sum to it."""
    if limit is None:
        return [None] * len(pools)
    weights = [max(1, p.info["virtual_bytes"]) for p in pools]
    total = sum(weights)
    shares = [limit * w // total for w in weights]
    shares[-1] += limit - sum(shares)
    return shares


def apply_limit(directory: str, name: str, limit_of_process) -> int:
    """Requests a limit on every pool of ``name`` and waits for the owners to acknowledge it."""
    found = scan(directory)
    warn_skipped(found, "kvctl")
    targets = [s for s in found.live if s.info["name"] == name]
    if not targets:
        raise GoneError(f"no live instance named {name!r}; `kvctl list` shows the live ones")
    by_pid: dict[int, list[Segment]] = defaultdict(list)
    for seg in targets:
        by_pid[seg.info["owner_pid"]].append(seg)
    plan: list[tuple[Segment, int | None]] = []
    for pools in by_pid.values():
        pools.sort(key=lambda s: s.info["pool_name"])
        plan.extend(zip(pools, split_limit(limit_of_process(pools), pools), strict=True))
    revision = 1 + max(
        max(s.info["request_revision"], s.info["applied_revision"], s.info["limit_revision"]) for s in targets
    )
    for seg, share in plan:
        try:
            _native.request_limit(seg.path, share, revision)
        except _native.SegmentError as exc:
            pid = seg.info["owner_pid"]
            if seg.live:
                raise NotTakenError(f"process {pid} of {name!r} is running but {exc}; try again") from None
            raise GoneError(f"process {pid} of {name!r} went away: {exc}") from None
    return report(plan, revision)


def report(plan: list[tuple[Segment, int | None]], revision: int) -> int:
    """Waits until each owner has acknowledged ``revision`` and prints one line per pool."""
    deadline = time.monotonic() + ACK_TIMEOUT_S
    pending = list(plan)
    status = 0
    while pending:
        still: list[tuple[Segment, int | None]] = []
        for seg, share in pending:
            try:
                info = _native.read_segment(seg.path)
            except _native.SegmentError:
                print(f"{seg.info['name']} pid {seg.info['owner_pid']}: exited before applying the limit")
                status = 1
                continue
            if info["handled_revision"] >= revision:
                state = info["limit_status"]
                note = (
                    " (above it now: no new allocation until freed blocks bring it down)" if state == "deferred" else ""
                )
                print(
                    f"{info['name']} pid {info['owner_pid']} pool {info['pool_name']}: "
                    f"limit {'none' if share is None else format_bytes(share)} {state}{note}"
                )
            else:
                still.append((seg, share))
        pending = still
        if pending and time.monotonic() > deadline:
            for seg, _ in pending:
                pid = seg.info["owner_pid"]
                why = "stopped (SIGSTOP or a debugger)" if process_state(pid) in ("T", "t") else "busy"
                print(
                    f"{seg.info['name']} pid {pid}: limit requested, not acknowledged within {ACK_TIMEOUT_S:g} s: "
                    f"the process is {why} and takes it when it runs again"
                )
            return 3
        if pending:
            time.sleep(0.001)
    return status


def parse_limit(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"bad SIZE: {exc}, or 'none'") from None


def parse_percent(text: str) -> float:
    try:
        pct = float(text)
    except ValueError:
        raise UsageError(f"bad PCT {text!r}: give a number between 0 and 100") from None
    if not (0 < pct <= 100) or math.isnan(pct):
        raise UsageError(f"bad PCT {text!r}: give a number between 0 and 100")
    return pct


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other bad input
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvctl",
        description="See and cap the kvcached instances running on this machine.",
        epilog="Exit status: 0 done, 1 the instance is gone, 2 bad input (nothing changed), 3 a live process of "
        "the instance did not take the limit in time (stopped, busy or its segment locked).",
    )
    parser.add_argument("--runtime-dir", help="segment location (default: KVCACHED_RUNTIME_DIR or its default)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("list", help="every live instance: name, pid, engine, device, pool, limit, mapped, used")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = sub.add_parser("limit", help="cap an instance's memory", description="Cap an instance's memory.")
    p.add_argument("name", help="instance name, as `kvctl list` shows it")
    p.add_argument("size", help="512M, 2G, 1.5GiB, plain bytes, or 'none' to remove the limit")
    p = sub.add_parser(
        "limit-percent", help="cap an instance at a percentage of its device's memory", description="Cap an instance."
    )
    p.add_argument("name", help="instance name, as `kvctl list` shows it")
    p.add_argument("percent", help="0 < PCT <= 100, of the memory of the instance's own device")
    sub.add_parser("gc", help="remove segments whose owner is gone", description="Remove stale segments.")
    return parser


def resolve_dir(runtime_dir: str | None) -> str:
    try:
        settings = load_settings(**({"runtime_dir": runtime_dir} if runtime_dir else {}))
        return segment_dir(settings)
    except (ConfigError, PermissionError) as exc:
        raise UsageError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        directory = resolve_dir(args.runtime_dir)
        if args.command == "list":
            return cmd_list(directory, args.json)
        if args.command == "limit":
            limit = parse_limit(args.size)
            return apply_limit(directory, args.name, lambda _pools: limit)
        if args.command == "limit-percent":
            pct = parse_percent(args.percent)
            return apply_limit(directory, args.name, lambda pools: int(pools[0].info["device_total_bytes"] * pct / 100))
        removed = collect(directory)
        tables = collect_page_tables(os.path.join(os.path.dirname(directory), "pagetables"))
        for path in removed + tables:
            print(f"removed {path}")
        print(f"{len(removed)} stale segment(s) and {len(tables)} stale page table(s) removed")
        return 0
    except UsageError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 2
    except GoneError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 1
    except NotTakenError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
