"""One bursty engine for the memory-control demo (normally started by run.py).

It owns one KVCacheManager named ``--name`` and repeats a burst: allocate chunks of blocks until
``alloc()`` returns None (shared budget full, or its memory limit reached), hold them a moment, free the
oldest half (requests finishing), rest, and start over. It never reports samples itself: the driver
reads its mapped bytes from the control segment, as ``kvctl list`` does.

Protocol: prints ``ready`` once the manager exists, starts bursting when a line arrives on stdin, and
stops cleanly (frees everything, closes the manager, which removes its segment) on stdin EOF, SIGTERM or
SIGINT. The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import sys
import threading
from collections.abc import Sequence

import kvcached_core as kc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="instance name, as kvctl shows it (e.g. engine-A)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--num-blocks", type=int, default=4096, help="virtual capacity in blocks (default: %(default)s)")
    p.add_argument("--block-bytes", type=int, default=64 * 1024, help="block size per buffer (default: %(default)s)")
    p.add_argument("--chunk-blocks", type=int, default=16, help="blocks per alloc() call (default: %(default)s)")
    p.add_argument("--hold-s", type=float, default=0.25, help="hold time after a burst (default: %(default)s)")
    p.add_argument("--rest-s", type=float, default=0.05, help="pause after freeing (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run bursts until told to stop; 0 on a clean stop, 1 on an error."""
    args = parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    mgr = kc.KVCacheManager(
        num_blocks=args.num_blocks,
        block_bytes=args.block_bytes,
        num_layers=2,
        num_kv_buffers=2,
        device=args.device,
        name=args.name,
        reserved_pages=0,  # give freed pages back at once ...
        reclaim_delay_ms=20,  # ... after 20 ms
    )
    held: collections.deque[list[int]] = collections.deque()
    stats = {"bursts": 0, "alloc_calls": 0, "alloc_none": 0}
    status = 0
    try:
        print("ready", flush=True)
        if not sys.stdin.readline():  # the driver went away before "go"
            return 0

        def watch_stdin() -> None:
            """Stop when stdin closes: the driver is done (or gone)."""
            while sys.stdin.readline():
                pass
            stop.set()

        threading.Thread(target=watch_stdin, daemon=True).start()
        while not stop.is_set():
            stats["bursts"] += 1
            while not stop.is_set():  # the burst: allocate until alloc() says no
                stats["alloc_calls"] += 1
                ids = mgr.alloc(args.chunk_blocks)
                if ids is None:
                    stats["alloc_none"] += 1
                    break
                held.append(ids)
                stop.wait(0.002)
            stop.wait(args.hold_s)
            for _ in range((len(held) + 1) // 2):  # the oldest half of the requests finish
                mgr.free(held.popleft())
            stop.wait(args.rest_s)
    except Exception as exc:  # reported on stderr; the driver sees the exit status
        print(f"{args.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 1
    finally:
        while held:
            mgr.free(held.popleft())
        mgr.close()
    print(json.dumps({"name": args.name, **stats}), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
