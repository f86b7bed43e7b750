"""The workload process the control-plane benchmark drives: it owns the manager kvctl limits and answers
one JSON line per command."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any

from kvcached_core import _native
from kvcached_core.segment import scan

TARGET_NAME = "bench-target"
WORKLOAD_NUM_BLOCKS = 8192
WORKLOAD_BLOCK_BYTES = 16384  # with 2 buffers and 2 MiB pages: 128 blocks per logical page of 4 MiB
WORKLOAD_RESERVED_PAGES = 2
WORKLOAD_RECLAIM_DELAY_MS = 10
REPLY_TIMEOUT_S = 30.0


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
