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
The work is done by :mod:`kvcached_core.control`; this module parses arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from . import control
from .config import ConfigError, Settings
from .segment import Scan
from .units import format_bytes, parse_size


class UsageError(Exception):
    """Bad input: exit 2, nothing changed."""


def warn_skipped(found: Scan, prog: str) -> None:
    for path, why in found.bad:
        print(f"{prog}: skipping {path}: {why}", file=sys.stderr)


def share_cap(row: dict) -> tuple[int | None, str]:
    """Fair share's cap on a pool while a neighbour is short, and what it does: ``yielding`` (no block above
    it), ``admitting`` (no new request above it) or ``""`` (no cap)."""
    if row["yield_cap_bytes"] is not None:
        return row["yield_cap_bytes"], "yielding"
    if row["admit_cap_bytes"] is not None:
        return row["admit_cap_bytes"], "admitting"
    return None, ""


def format_table(table: list[dict]) -> str:
    header = ("NAME", "PID", "ENGINE", "DEVICE", "POOL", "LIMIT", "SHARE", "MAPPED", "USED")
    lines = [header]
    for r in table:
        limit = format_bytes(r["limit_bytes"])
        if r["limit_status"] == "deferred":
            limit += " (shrinking)"
        cap, doing = share_cap(r)
        share = format_bytes(cap) + (f" ({doing})" if doing else "")
        lines.append(
            (
                r["name"],
                str(r["pid"]),
                r["engine"],
                r["device"],
                r["pool_name"],
                limit,
                share,
                format_bytes(r["mapped_bytes"]),
                format_bytes(r["used_bytes"]),
            )
        )
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def cmd_list(settings: Settings, as_json: bool) -> int:
    found = control.scan_segments(settings)
    warn_skipped(found, "kvctl")
    table = control.rows(found.live)
    print(json.dumps(table, indent=2) if as_json else format_table(table))
    if found.stale and not as_json:
        print(f"({len(found.stale)} stale segment(s) of dead processes; `kvctl gc` removes them)", file=sys.stderr)
    return 0


def cmd_limit(settings: Settings, name: str, limit_of_process: control.LimitOfProcess) -> int:
    """Sets the limit and prints one line per pool; the exit status says how it went."""
    found = control.scan_segments(settings)
    warn_skipped(found, "kvctl")
    status = 0
    for o in control.set_limit(found, name, limit_of_process):
        who = f"{o.name} pid {o.pid}"
        share = "none" if o.share is None else format_bytes(o.share)
        if o.status == "exited":
            print(f"{who}: exited before applying the limit")
            status = max(status, 1)
        elif o.status == "pending":
            why = "stopped (SIGSTOP or a debugger)" if o.stopped else "busy"
            print(
                f"{who}: limit requested, not acknowledged within {control.ACK_TIMEOUT_S:g} s: "
                f"the process is {why} and takes it when it runs again"
            )
            status = 3
        else:
            deferred = o.status == "deferred"
            note = " (above it now: no new allocation until freed blocks bring it down)" if deferred else ""
            print(f"{who} pool {o.pool_name}: limit {share} {o.status}{note}")
    return status


def cmd_gc(settings: Settings) -> int:
    segments, tables = control.collect_stale(settings)
    for path in segments + tables:
        print(f"removed {path}")
    print(f"{len(segments)} stale segment(s) and {len(tables)} stale page table(s) removed")
    return 0


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
    p = sub.add_parser("list", help="every live instance: name, pid, engine, device, pool, limit, share, mapped, used")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = sub.add_parser("limit", help="cap an instance's memory", description="Cap an instance's memory.")
    p.add_argument("name", help="instance name, as `kvctl list` shows it")
    p.add_argument("size", help="512M, 2G, 1.5GiB, plain bytes, or 'none' to remove the limit")
    p = sub.add_parser(
        "limit-percent", help="cap an instance at a percentage of its device's memory", description="Cap an instance."
    )
    p.add_argument("name", help="instance name, as `kvctl list` shows it")
    p.add_argument("percent", help="0 < PCT <= 100, of the memory of the instance's own device")
    sub.add_parser(
        "gc",
        help="remove segments and page tables whose owner is gone",
        description="Remove stale segments and page tables.",
    )
    return parser


def cli_settings(runtime_dir: str | None) -> Settings:
    """The settings for a command line's ``--runtime-dir``; a bad environment or directory is a UsageError."""
    try:
        settings = control.settings_for(runtime_dir)
        control.scan_segments(settings)  # creates and checks the directories now, not halfway through a command
        return settings
    except (ConfigError, PermissionError) as exc:
        raise UsageError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        settings = cli_settings(args.runtime_dir)
        if args.command == "list":
            return cmd_list(settings, args.json)
        if args.command == "limit":
            limit = parse_limit(args.size)
            return cmd_limit(settings, args.name, lambda _pools: limit)
        if args.command == "limit-percent":
            pct = parse_percent(args.percent)
            return cmd_limit(settings, args.name, lambda pools: int(pools[0].info["device_total_bytes"] * pct / 100))
        return cmd_gc(settings)
    except UsageError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 2
    except control.InstanceGone as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 1
    except control.LimitNotTaken as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
