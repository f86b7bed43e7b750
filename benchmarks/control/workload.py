"""The workload process the control-plane benchmark drives: ``python -m kvcached_core.workload`` (the
harness tests and benchmarks share) owning the manager kvctl limits, its replies read as dicts."""

from __future__ import annotations

import json
import os
from typing import Any

from kvcached_core import _native, workload
from kvcached_core.segment import scan

TARGET_NAME = "bench-target"
WORKLOAD_NUM_BLOCKS = 8192
WORKLOAD_BLOCK_BYTES = 16384  # with 2 buffers and 2 MiB pages: 128 blocks per logical page of 4 MiB
WORKLOAD_RESERVED_PAGES = 2
WORKLOAD_RECLAIM_DELAY_MS = 10


class LibraryError(RuntimeError):
    """The control plane did not do what it promises (no acknowledgment, a failing kvctl, ...)."""


class Workload:
    """The workload subprocess (one layer, K and V, the geometry above) and its commands as dicts."""

    def __init__(self, device: str, runtime_dir: str) -> None:
        """Start the workload in ``runtime_dir`` and read its snapshot (``ready``)."""
        args = [
            "--runtime-dir", runtime_dir,
            "--name", TARGET_NAME,
            "--device", device,
            "--blocks", str(WORKLOAD_NUM_BLOCKS),
            "--block-bytes", str(WORKLOAD_BLOCK_BYTES),
            "--layers", "1",
            "--reserved-pages", str(WORKLOAD_RESERVED_PAGES),
            "--reclaim-delay-ms", str(WORKLOAD_RECLAIM_DELAY_MS),
        ]  # fmt: skip
        try:
            self._work = workload.Workload(
                *args, cwd=runtime_dir, env=dict(os.environ, KVCACHED_RUNTIME_DIR=runtime_dir)
            )
        except RuntimeError as exc:
            raise LibraryError(str(exc)) from exc
        self.ready = self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        line = self._work.ask("json")
        if not line.startswith("{"):
            raise LibraryError(f"workload answered {line!r} to json (exit status {self._work.proc.poll()})")
        return json.loads(line)

    def command(self, text: str) -> dict[str, Any]:
        """``grow CAP`` or ``free`` (all held blocks): the blocks held after it, whether an alloc was
        refused (grow), and the manager's snapshot."""
        answer = self._work.ask(text).split()
        if not answer or answer[0] not in ("ok", "miss"):
            raise LibraryError(f"workload answered {answer} to {text!r}")
        snapshot = self._snapshot()
        return {"refused": answer[0] == "miss", "held": snapshot["allocated_blocks"], "snapshot": snapshot}

    def stop(self) -> int | None:
        """Close the workload's stdin (it closes its manager and exits); kill it if it does not within 10 s.
        Returns its exit status."""
        try:
            return self._work.stop(timeout=10)
        except Exception:  # noqa: BLE001 - a hung or broken workload is killed whatever went wrong
            self._work.kill()
            return self._work.proc.returncode


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
