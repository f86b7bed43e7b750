"""Per-process state of the plugin: the scheduler's planner (EngineCore) and each worker's page mirrors.

vLLM starts the scheduler and the workers in separate processes (always on CPU; for TP > 1 on GPU), and a
forked child inherits the parent's patches without re-running the plugin, so nothing here is created at
import: the planner when EngineCore has sized the KV cache, a mirror when a worker allocates it.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from typing import Any

from kvcached_core import KVCacheManager, PageMirror, load_settings

_planners: dict[tuple[int, int], KVCacheManager] = {}  # (pid, num_blocks) -> planner
_mirrors: dict[int, list[PageMirror]] = {}  # pid -> this worker's mirrors
# A worker's steps and its idle syncs exclude each other: pages are unmapped only between steps.
_step_lock = threading.RLock()
_idle_syncer: dict[int, threading.Event] = {}  # pid -> stop flag of this worker's idle-sync thread


def add_planner(num_blocks: int, planner: KVCacheManager) -> None:
    _planners[(os.getpid(), num_blocks)] = planner


def planner_for(num_blocks: int) -> KVCacheManager | None:
    """The planner EngineCore made for a KV cache of ``num_blocks`` blocks, or None (not elastic)."""
    return _planners.get((os.getpid(), num_blocks))


def prefix_cache_blocks(num_blocks: int) -> int:
    """How many cached-free blocks may stay mapped (``KVCACHED_PREFIX_CACHE_BYTES``)."""
    planner = planner_for(num_blocks)
    if planner is None:
        return num_blocks
    per_block = planner.block_bytes * planner.num_buffers
    return load_settings().prefix_cache_bytes // per_block


def add_mirror(mirror: PageMirror) -> None:
    """Keep ``mirror`` in sync: before every step (:func:`run_step`), and every ``KVCACHED_WATCH_INTERVAL_MS``
    while the worker is idle, so an idle engine's workers give back what its scheduler released."""
    pid = os.getpid()
    _mirrors.setdefault(pid, []).append(mirror)
    if pid not in _idle_syncer:
        stop = threading.Event()
        _idle_syncer[pid] = stop
        interval = load_settings().watch_interval_ms / 1000
        thread = threading.Thread(target=_sync_while_idle, args=(stop, interval), name="kvcached-idle-sync")
        thread.daemon = True
        thread.start()
        atexit.register(close_all)  # stop the thread and unmap before the interpreter tears down


def sync_mirrors() -> None:
    """Bring this worker's mappings up to the planner's page table."""
    with _step_lock:
        for mirror in _mirrors.get(os.getpid(), ()):
            mirror.sync()


def run_step(step: Callable[[], Any]) -> Any:
    """Sync, then run a worker step, with no idle sync in between or during it."""
    with _step_lock:
        sync_mirrors()
        return step()


def _sync_while_idle(stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        if _step_lock.acquire(blocking=False):  # a step is running: it synced, the next idle turn will
            try:
                if not stop.is_set():
                    sync_mirrors()
            finally:
                _step_lock.release()


def close_all() -> None:
    stop = _idle_syncer.pop(os.getpid(), None)
    if stop is not None:
        stop.set()
    with _step_lock:
        mirrors = _mirrors.pop(os.getpid(), [])
    for mirror in mirrors:
        mirror.close()
    for key in [k for k in _planners if k[0] == os.getpid()]:
        _planners.pop(key).close()
