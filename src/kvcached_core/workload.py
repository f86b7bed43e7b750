"""A KVCacheManager in a process of its own, driven line by line: a real neighbour for tests, benchmarks and
demos (another engine holding memory, an instance for kvctl to cap, a process to kill mid-run).

    python -m kvcached_core.workload [--runtime-dir DIR] [--name NAME] [--hold BLOCKS] [geometry, settings]

It prints ``ready`` once its manager exists and its first ``--hold`` blocks are taken (``ready miss`` when
they could not be), then answers one line per command read from stdin:

    alloc N   ok | miss            take N more blocks and keep them
    grow CAP  ok HELD | miss HELD  take one block at a time until CAP are held (ok) or alloc refuses (miss)
    free N    ok                   free the N blocks held longest (all of them without N)
    trim      ok BYTES             unmap every empty page now
    snap      MAPPED LIMIT USED    mapped bytes, limit bytes (None: no limit), allocated blocks
    json      {SNAPSHOT}           the manager's whole snapshot() as one JSON line
    quit      (no answer)          close the manager and exit 0; so does the end of stdin

Run ``--help`` for the geometry and settings options. :class:`Workload` starts and drives one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence

from .config import load_settings
from .manager import KVCacheManager


class Workload:
    """A running ``python -m kvcached_core.workload`` and its stdin/stdout."""

    def __init__(self, *args: str, cwd: str | None = None, env: dict[str, str] | None = None) -> None:
        """Starts one with these command-line ``args`` and waits for its ``ready`` line (``ready_line``)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcached_core.workload", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
        )
        self.ready_line = self._read()
        if not self.ready_line.startswith("ready"):
            self.kill()
            raise RuntimeError(f"the workload did not start (its error is on stderr): {self.ready_line!r}")

    @property
    def pid(self) -> int:
        """The workload's process id."""
        return self.proc.pid

    def _read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, line: str) -> str:
        """Sends one command and returns its answer ('' once the process is gone)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self, timeout: float = 10) -> int:
        """Closes its stdin (it closes its manager and exits) and returns its exit status."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is cleaned up by the process itself."""
        self.proc.kill()
        self.proc.wait()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvcached_core.workload",
        description="A kvcached manager in its own process, driven by commands on stdin (see the module doc).",
    )
    p.add_argument("--runtime-dir", help="runtime directory (default: KVCACHED_RUNTIME_DIR or its default)")
    p.add_argument("--name", help="instance name kvctl shows (default: python-<pid>)")
    p.add_argument("--engine", help="engine label kvctl shows (default: python)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--blocks", type=int, default=1024, help="blocks of virtual capacity (default 1024)")
    p.add_argument("--block-bytes", type=int, default=64 * 1024, help="bytes of a block per buffer (64 KiB)")
    p.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--kv-buffers", type=int, default=2, help="buffers per layer (default 2)")
    p.add_argument("--hold", type=int, default=0, help="blocks to take before printing ready (default 0)")
    p.add_argument("--host-device-bytes", type=int, help="host memory budget shared by the user's processes")
    p.add_argument("--reclaim-delay-ms", type=int, default=10, help="demand window (default 10 ms)")
    p.add_argument("--reserved-pages", type=int, default=0, help="empty pages kept mapped (default 0)")
    p.add_argument("--pool-target", type=int, default=0, help="physical handles made ahead (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides: dict[str, object] = {"reclaim_delay_ms": args.reclaim_delay_ms}
    if args.runtime_dir:
        overrides["runtime_dir"] = args.runtime_dir
    if args.host_device_bytes is not None:
        overrides["host_device_bytes"] = args.host_device_bytes
    settings = load_settings(**overrides)
    manager = KVCacheManager(
        args.blocks,
        args.block_bytes,
        args.layers,
        args.kv_buffers,
        device=args.device,
        name=args.name,
        engine=args.engine,
        settings=settings,
        reserved_pages=args.reserved_pages,
        pool_target=args.pool_target,
    )
    held: list[int] = []
    if args.hold:
        held = manager.alloc(args.hold) or []
    print("ready" if held or not args.hold else "ready miss", flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "alloc":
            ids = manager.alloc(int(arg))
            held += ids or []
            print("ok" if ids else "miss", flush=True)
        elif command == "grow":
            refused = False
            while len(held) < int(arg) and not refused:
                ids = manager.alloc(1)
                refused = ids is None
                held += ids or []
            print("miss" if refused else "ok", len(held), flush=True)
        elif command == "free":
            n = int(arg) if arg else len(held)
            manager.free(held[:n])
            held = held[n:]
            print("ok", flush=True)
        elif command == "trim":
            print("ok", manager.trim(), flush=True)
        elif command == "snap":
            snap = manager.snapshot()
            print(snap["mapped_bytes"], snap["limit_bytes"], snap["allocated_blocks"], flush=True)
        elif command == "json":
            print(json.dumps(manager.snapshot()), flush=True)
        elif command == "quit":
            break
        else:
            print(f"error: unknown command {command!r}", flush=True)
    manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
