"""kvtop: a live view of every kvcached instance on this machine.

    kvtop                  refresh in place until Ctrl-C
    kvtop --once           print one frame and exit (for scripts)
    kvtop --once --json    the same rows as `kvctl list --json`

Each row is one pool of one process. The bar spans the pool's limit (or its device's memory when it has
no limit): '#' is memory holding allocated blocks, '+' is mapped but free (the reserve), '.' is headroom.
SHARE is fair share's cap while a neighbour on the device is short (KVCACHED_FAIR_SHARE): 'a' no new
request above it, 'y' no block above it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from . import control
from .config import Settings
from .kvctl import UsageError, _Parser, cli_settings, share_cap, warn_skipped
from .units import format_bytes

BAR_WIDTH = 30


def bar(used: int, mapped: int, scale: int, width: int = BAR_WIDTH) -> str:
    """``[###++.....]``: used, mapped-but-free and headroom, relative to ``scale`` bytes."""
    if scale <= 0:
        return "[" + "?" * width + "]"
    n_used = min(width, round(width * used / scale))
    n_mapped = min(width - n_used, max(0, round(width * mapped / scale) - n_used))
    return "[" + "#" * n_used + "+" * n_mapped + "." * (width - n_used - n_mapped) + "]"


def frame(settings: Settings, live: bool = False) -> tuple[str, list[dict]]:
    """One screen of text and the rows it shows (``live``: the refreshing view, which Ctrl-C quits)."""
    found = control.scan_segments(settings)
    warn_skipped(found, "kvtop")
    table = control.rows(found.live)
    stamp = time.strftime("%H:%M:%S")
    total_mapped = sum(r["mapped_bytes"] for r in table)
    quits = "  (Ctrl-C quits)" if live else ""
    lines = [f"kvtop {stamp}  {len(table)} pool(s)  mapped {format_bytes(total_mapped)}{quits}", ""]
    header = (
        f"{'NAME':<20} {'PID':>7} {'DEVICE':<7} {'POOL':<6} {'LIMIT':>8} {'SHARE':>8} {'MAPPED':>8} {'USED':>8}  BAR"
    )
    lines.append(header)
    for r in table:
        scale = r["limit_bytes"] if r["limit_bytes"] is not None else r["device_total_bytes"]
        limit = format_bytes(r["limit_bytes"]) + ("*" if r["limit_status"] == "deferred" else "")
        cap, doing = share_cap(r)
        share = format_bytes(cap) + doing[:1]
        lines.append(
            f"{r['name'][:20]:<20} {r['pid']:>7} {r['device']:<7} {r['pool_name'][:6]:<6} {limit:>8} {share:>8} "
            f"{format_bytes(r['mapped_bytes']):>8} {format_bytes(r['used_bytes']):>8}  "
            f"{bar(r['used_bytes'], r['mapped_bytes'], scale)}"
        )
    if not table:
        lines.append("(no live kvcached instance)")
    if any(r["limit_status"] == "deferred" for r in table):
        lines.append("* above its limit: shrinking as blocks are freed")
    if any(share_cap(r)[1] for r in table):
        lines.append("a/y: a neighbour is short; no new request (a) or no block (y) above the equal share")
    return "\n".join(lines), table


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtop", description="Live view of every kvcached instance on this machine.")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print the rows as JSON")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes (default 0.5)")
    parser.add_argument("--runtime-dir", help="segment location (default: KVCACHED_RUNTIME_DIR or its default)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.json and not args.once:
            raise UsageError("--json needs --once")
        if not args.interval > 0:
            raise UsageError("--interval must be a positive number of seconds")
        settings = cli_settings(args.runtime_dir)
        if args.once:
            text, table = frame(settings)
            print(json.dumps(table, indent=2) if args.json else text)
            return 0
        while True:
            text, _ = frame(settings, live=True)
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")  # home + clear: redraw in place
            sys.stdout.flush()
            time.sleep(args.interval)
    except UsageError as exc:
        print(f"kvtop: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
